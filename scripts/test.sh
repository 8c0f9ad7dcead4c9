#!/usr/bin/env bash
# Set up .venv and run the test suite: everything by default (the tests start the services they need
# themselves: embedded broker, vLLM on a tiny model built here, once per session), or with --unit only
# tests/unit, the tier that needs no server. Other arguments go to pytest. The 25 slowest tests are listed
# at the end, to keep the suite inside its time (README).
set -euo pipefail
cd "$(dirname "$0")/.."
paths=()
if [[ "${1:-}" == "--unit" ]]; then
    shift
    paths=(tests/unit)
fi
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q --durations=25 "${paths[@]}" "$@"
