#!/usr/bin/env bash
# Set up .venv and run the whole test suite. The tests start the services they need themselves
# (embedded broker, vLLM on a tiny model built here) once per session.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
