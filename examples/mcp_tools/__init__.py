"""An agent that discovers its tools from an MCP server over stdio (README.md)."""
