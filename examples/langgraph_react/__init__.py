"""A ReAct agent written with LangGraph (README.md)."""
