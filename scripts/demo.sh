#!/usr/bin/env bash
# Set up .venv and run the demo end to end on the embedded default: broker, vLLM on a tiny model built
# here, gateway, trainer and the demo producer; prints the reward version after version. Ctrl-C stops all.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/streamrl up --demo "$@"
