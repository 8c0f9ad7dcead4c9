"""A tool agent written with the OpenAI Agents SDK (README.md)."""
