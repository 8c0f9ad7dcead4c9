"""Tic-tac-toe against a scripted opponent (README.md)."""
