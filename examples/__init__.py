"""Agents that learn through the streamrl gateway, each in its own folder with a README (examples/README.md)."""
