"""An MCP server (the official ``mcp`` SDK's ``MCPServer``) over the shop's SQLite database, on stdio:
``python -m examples.mcp_tools.server DB``. The agent (agent.py) writes the database, starts the server and
discovers these tools. It imports nothing of streamrl, as a server of tools would not: started from the
repository's root, that folder's ``streamrl/`` would stand in front of an installed (not editable) streamrl."""

from __future__ import annotations

import sqlite3
import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer


def serve(db_path: str) -> MCPServer:
    db = sqlite3.connect(f"file:{db_path}?mode=ro", uri=True, check_same_thread=False)
    server = MCPServer("shop")

    @server.tool()
    def list_products() -> list[str]:
        """The names of all products the shop sells."""
        return [name for (name,) in db.execute("SELECT name FROM products ORDER BY name")]

    @server.tool()
    def price_of(item: str) -> str:
        """The price of one unit of a product, in cents."""
        row = db.execute("SELECT price_cents FROM products WHERE name = ?", (item.strip().lower(),)).fetchone()
        return f"one {item} costs {row[0]} cents" if row else f"no product {item!r}; list_products names them"

    @server.tool()
    def stock_of(item: str) -> str:
        """How many units of a product are in stock."""
        row = db.execute("SELECT stock FROM products WHERE name = ?", (item.strip().lower(),)).fetchone()
        return f"{row[0]} in stock" if row else f"no product {item!r}; list_products names them"

    return server


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_file():
        sys.exit("usage: python -m examples.mcp_tools.server DB (an SQLite file agent.write_database made)")
    serve(sys.argv[1]).run("stdio")
