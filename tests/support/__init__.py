"""Helpers the tests share (not tests themselves): importable as ``support.*`` (pyproject's pytest
``pythonpath`` puts tests/ on the path)."""
