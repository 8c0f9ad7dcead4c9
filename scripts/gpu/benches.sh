#!/usr/bin/env bash
# On a GPU machine where the pieces are staged (docs/gpu.md), in a copy of the repository: install, then
# run the named benchmarks with the settings of docs/benchmarks.md, each writing its JSON and a log
# into OUT (the device tool's $OUT). One command per session saves the start-up of each part.
#   usage: scripts/gpu/benches.sh STASH OUT BENCH...
#   BENCH: capture | sampler-logprob | lora-load | engine | gateway | gateway-isolated | gateway-paired | gateway-scaling | hotswap | loop-two-gpu | loop-one-gpu | loop-multi | loop-real | model | learn | sft | unpaced-real | judge-real | trainer | policies | policies-serving
#   learn: bench/learn_bench.py, PRESET (default short; `learn_bench.py presets` lists them all) over SEEDS (default 0: one run per
#          mode; more seeds are run while they fit: the bench skips a run that would not end inside the device's
#          limit, DEVICE_LIMIT_S (default 570) counted from this script's start, and says so), MODES (default
#          pipeline,sync,inflight; a seed's first mode turns with its value), LEARN_SECONDS (each run's demo time, default the preset's); OUT gets
#          learn-PRESET-sSEEDS.json (rewritten after every run), .log, .png (with matplotlib), and per run its
#          log's tail and trainer history; pool the commands' files with `learn_bench.py merge`. On a fresh
#          machine run `model` first (its own command: the install and the conversion, about 2.5 minutes), so
#          that each learn command's 10 minutes go to the engine's start (about 2 minutes) and the runs
#   engine: start PRESET's shared engine (ENGINE_PRESET overrides it, e.g. autotask's longer context for every agent
#          preset) in a session of its own, so that it outlives this command on the device machine, and wait until
#          it answers; every later learn command on that machine then runs against it (--upstream) instead of
#          starting its own: one engine start per machine instead of one per command (an engine bench naming
#          another preset stops the one running first)
#   hotswap: bench/hotswap_bench.py on SmolLM2 (after model), streamed answers of MAX_TOKENS (default 512) from
#          CLIENTS (default 64) clients while VERSIONS (default 12) versions are published 2 s apart, in MODES
#          (default pipeline,inflight,inflight-recompute; pipeline-room: pinned with room for a fourth version):
#          publish -> served (with the versions that waited for room, from the gateway's log), and the chunk gaps
#          (decode steps as the clients see them) in the second after each swap against the others, requests moved
#   sft:   bench/sft_bench.py (after model): streamrl sft against a plain transformers + peft loop, tokens/s, with
#          the trainer's default packing and with rows of 1,024 tokens
#   model: install, and convert SmolLM2-135M-Instruct into STASH/models/smollm2-135m (where learn and loop-real
#          look for it: --model-cache STASH)
#   lora-load: VERSIONS (default 24, a third each idle / generating / beside a GPU neighbour), STREAMS (128)
#   gateway: ROUNDS (default 2) more interleaved rounds; GATEWAY_CPUS (e.g. 0-1) adds off and on with the gateway
#          process on those CPUs alone (off-pinned, on-pinned) to the same rounds
#   gateway-isolated: the gateway bench (direct, off, on, and off / on with the gateway on GATEWAY_CPUS alone, e.g.
#          0,1: a CPU and its siblings; ROUNDS, default 3), every placement in the same interleaved rounds
#   gateway-paired: the gateway bench's direct, off, on and on-kafka-python (ROUNDS, default 2), then off and on side
#          by side, PAIRS (default 20) pairs of closed-loop bursts of PAIR_SECONDS (default 2): on / off per pair;
#          GATEWAY_SECONDS (default 6) per phase
#   gateway-scaling: GATEWAY_CPUS (a taskset list, e.g. 0-7) pins the gateways there and the load elsewhere
#   loop-multi: (x2 / x4 machines) REPLICA_GPUS (default 0,1) vLLM replicas and TRAINER_GPUS (default 2,3)
#          trainer ranks, SHAPE (default qwen2.5-7b); on x2: REPLICA_GPUS=0 TRAINER_GPUS=1
#   capture: ROUNDS (default 3), REQUESTS per mode and round (default 1024), PY_SPY (seconds, default 0),
#          PY_SPY_CORE=1 (the engine core alone, every round: each function's CPU ms per 1k tokens vs chat),
#          CAPTURE_MODES (default chat,chat-capture,gateway), ENGINE_CPUS (vLLM pinned there: a CPU list or
#          gpu-local; the client and the gateway on the other CPUs), TAG (suffix of capture.json / .log)
#   env:   LR (loop learning rate, default 3e-3; loop-real 5e-4), ENGINES (vLLM replicas, default 1),
#          MAX_AHEAD (pipeline's steps ahead, default 1; loop-real 2), CONCURRENCY (groups in flight,
#          default 16), LOOP_SECONDS (per mode, default 150), UNTIL (target reward, default 0.8), LOOP_MODES
#          (learn_bench's --modes, default pipeline,sync);
#          loop-real only: GROUP (group size, 16), GPS (groups per step, 8), MAX_TOKENS (128); its UNTIL
#          defaults to 2 (out of reach: both modes run LOOP_SECONDS and the held-out curves are compared)
#   loop-real: SmolLM2-135M-Instruct (its wheel staged in STASH/wheels) on the arithmetic task, one GPU,
#          held-out accuracy of every version on 256 problems
#   unpaced-real: the same model and task, a producer that does not wait (RATES groups in flight, default
#          16), backlog wait against freshest, each its own `streamrl up` (about 3.5 minutes a mode)
#   judge-real: SmolLM2 as the judge: judge_bench's throughput (256 groups of 8, 32 at once), then the same
#          model trained on the arithmetic task for LOOP_SECONDS (default 120) with the exact-match reward and
#          with the judge's only (`streamrl up --demo --demo-reward exact|judge`), held-out accuracy per version;
#          JUDGE_RUNS (default "throughput exact judge") picks the parts; a 4,096 context (the exact run of
#          2026-12-01 had 2,048: the policy's requests are far below either, the judge's groups of 16 are not)
#   policies: #43, bench/policies_bench.py on SmolLM2 (after model; converted here otherwise): POLICIES (default 1,8,2,4,
#          run in this order) policies on one engine (LoRA slots for 8) and one gateway, one real trainer each (all on
#          the one GPU, vLLM capped at 0.35 of it), the same load for every count: CLIENTS (default 16) clients of
#          GROUP (16) calls in flight, MAX_TOKENS (128) tokens a reply; POLICY_SECONDS (default 30) measured per
#          count once every policy serves a trained version; a count that would not end inside DEVICE_LIMIT_S
#          (default 570, from this script's start) is skipped; OUT gets policies.json, .log and policies-logs.tar.gz
#          (each count's combined log without the 200 lines, trainer histories)
#   policies-serving: the same with training imitated (`policies_bench.py --imitate-training RATE`, default 1.0 version/s
#          over all policies, each a copy of one random adapter; no trainer on the GPU): what P costs the engine alone
set -uo pipefail
stash=${1:?STASH}; out=${2:?OUT}; shift 2
repo=$(cd "$(dirname "$0")/../.." && pwd)
site=/root/site
bash "$repo/scripts/gpu/install.sh" "$stash" "$site" > "$out/install.log" 2>&1 || { tail -20 "$out/install.log"; exit 1; }
export PYTHONPATH=$site PATH=$site/bin:$PATH PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
shared_urls=/root/shared-engine.urls  # written by the engine bench's engine while it serves
shared_engine_pid() {  # the engine bench's engine process, when it still runs (up or starting)
  local pid; pid=$(cat /root/shared-engine.pid 2>/dev/null)
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && echo "$pid"
}
wait_shared_engine() {  # wait_shared_engine PID: until it serves, exits, or the device's limit comes near
  until [ -s "$shared_urls" ] || ! kill -0 "$1" 2>/dev/null || (( SECONDS > ${DEVICE_LIMIT_S:-570} )); do sleep 1; done
}
cd /root  # outside the checkout: its streamrl/ folder would shadow the laid-out package

run_logs() {  # run_logs DIR NAME: each run's log tail (no engine lines, no 200s), its hot-swap lines, trainer history into OUT
  local d r
  for d in "$1"/s*-*/; do
    [ -d "$d" ] || continue
    r=$(basename "$d")
    grep -v 'HTTP/1.1" 200' "$d/up.log" 2>/dev/null | grep -v '^engine' | tail -300 > "$out/$2-$r.log"
    grep 'streamrl.gateway.hotswap' "$d/up.log" > "$out/$2-$r-swaps.log" 2>/dev/null  # every version's, whole run
    cp "$d/history.jsonl" "$out/$2-$r-history.jsonl" 2>/dev/null
  done
}

loop() {  # loop NAME ARGS...: bench/learn_bench.py run ARGS, pipeline then sync, its JSON, logs and histories in OUT
  local name=$1 dir=/root/lb-$1 modes=${LOOP_MODES:-pipeline,sync}
  shift
  rm -rf "$dir"
  python3 "$repo/bench/learn_bench.py" run "$@" --modes "$modes" --max-seconds "${LOOP_SECONDS:-150}" \
      --lora-rank 16 --micro-batch-tokens 16384 --out "$dir" --json "$out/$name.json" > "$out/$name.log" 2>&1
  run_logs "$dir" "$name"
  tail -40 "$out/$name.log"
}

synthetic() {  # the random 1.5B (or SHAPE) model on the synthetic task: the loop's settings of docs/benchmarks.md
  echo --warmup --until-reward "${UNTIL:-0.8}" --learning-rate "${LR:-3e-3}" --group-size 8 --groups-per-step 16 \
      --max-tokens 256 --max-ahead "${MAX_AHEAD:-1}" --row-tokens 1024 --context-words 400 --max-model-len 4096 \
      --stall-s 30
}

for bench in "$@"; do
  echo "== $bench $(date -u +%T)"
  case $bench in
    capture)  # every way of asking for tokens, chat / capture / gateway interleaved over ROUNDS (default 3)
      python3 "$repo/bench/capture_bench.py" --shape qwen2.5-1.5b --requests "${REQUESTS:-1024}" --concurrency 256 \
          --max-tokens 256 \
          --modes "${CAPTURE_MODES:-chat,chat-capture,gateway}" --rounds "${ROUNDS:-3}" \
          --py-spy "${PY_SPY:-0}" ${PY_SPY_CORE:+--py-spy-core} --engine-cpus "${ENGINE_CPUS:-}" --out /root/cb \
          --json "$out/capture${TAG:-}.json" > "$out/capture${TAG:-}.log" 2>&1
      for f in /root/cb/py-spy-*.txt; do  # the engine core's per-round profiles stay: capture.json sums them
        case $f in */py-spy-core-*) ;; *) [ -f "$f" ] && cp "$f" "$out/" ;; esac
      done
      tail -"$([ -n "${PY_SPY_CORE:-}" ] && echo 60 || echo 12)" "$out/capture${TAG:-}.log" ;;
    sampler-logprob)  # the sampled token's logprob in vLLM's GPU sampler against torch's kernels
      python3 "$repo/bench/sampler_logprob_bench.py" --json "$out/sampler-logprob.json" > "$out/sampler-logprob.log" 2>&1
      tail -4 "$out/sampler-logprob.log" ;;
    lora-load)  # adapter loads into a generating engine: load time, generation's pause, where the time goes
      python3 "$repo/bench/lora_load_bench.py" --shape qwen2.5-1.5b --rank 16 --versions "${VERSIONS:-24}" \
          --streams "${STREAMS:-128}" --max-tokens 512 --interval-s 1.5 --gpu-neighbour --py-spy --out /root/llb \
          --json "$out/lora-load.json" > "$out/lora-load.log" 2>&1
      for f in /root/llb/py-spy-lora-*.txt; do [ -f "$f" ] && gzip -c "$f" > "$out/$(basename "$f").gz"; done
      tail -8 "$out/lora-load.log" ;;
    gateway)  # ROUNDS (default 2) interleaved rounds after the full pass; GATEWAY_CPUS pins the gateway process
      python3 "$repo/bench/gateway_bench.py" --seconds 8 --stream-rate 20 --rounds "${ROUNDS:-2}" \
          ${GATEWAY_CPUS:+--gateway-cpus "$GATEWAY_CPUS" --modes direct,off,on,on-framed,on-json,on-dashboard,off-pinned,on-pinned} \
          --json "$out/gateway${TAG:-}.json" \
          > "$out/gateway${TAG:-}.log" 2>&1; tail -16 "$out/gateway${TAG:-}.log" ;;
    gateway-isolated)  # the gateway bench with the gateway on GATEWAY_CPUS alone as well, in the same rounds
      python3 "$repo/bench/gateway_bench.py" --seconds 6 --stream-rate 0 --modes direct,off,on,off-pinned,on-pinned \
          --rounds "${ROUNDS:-3}" --gateway-cpus "${GATEWAY_CPUS:?gateway-isolated needs GATEWAY_CPUS, e.g. 0,1}" \
          --json "$out/gateway-isolated.json" > "$out/gateway-isolated.log" 2>&1; tail -16 "$out/gateway-isolated.log" ;;
    gateway-paired)  # on / off taken seconds apart: the host's drift between phases is larger than logging's cost
      python3 "$repo/bench/gateway_bench.py" --seconds "${GATEWAY_SECONDS:-6}" --stream-rate 0 --modes direct,off,on,on-kafka-python \
          --rounds "${ROUNDS:-2}" --pairs "${PAIRS:-20}" --pair-seconds "${PAIR_SECONDS:-2}" \
          --json "$out/gateway-paired.json" > "$out/gateway-paired.log" 2>&1; tail -16 "$out/gateway-paired.log" ;;
    gateway-scaling)  # #18: 1, 2, 4, 8 gateway processes on one port, logging on, and publish -> served
      python3 "$repo/bench/gateway_scaling.py" --processes 1,2,4,8 --seconds 10 --concurrency 64 --clients 4 \
          --stub-processes 2 --versions 20 --version-interval 0.5 ${GATEWAY_CPUS:+--gateway-cpus "$GATEWAY_CPUS"} \
          --json "$out/gateway-scaling.json" \
          > "$out/gateway-scaling.log" 2>&1; tail -12 "$out/gateway-scaling.log" ;;
    loop-two-gpu|loop-one-gpu)
      # shellcheck disable=SC2046  # synthetic's words are separate flags
      loop "$bench" --layout "${bench#loop-}" --shape qwen2.5-1.5b --shared-engine --engines "${ENGINES:-1}" \
          --concurrency "${CONCURRENCY:-16}" $(synthetic) ;;
    loop-multi)  # #17: replicas and trainer ranks on their own GPUs of one host, each mode its own stack
      # shellcheck disable=SC2046
      loop loop-multi --layout two-gpu --shape "${SHAPE:-qwen2.5-7b}" --no-shared-engine --replica-gpus "${REPLICA_GPUS:-0,1}" \
          --trainer-gpus "${TRAINER_GPUS:-2,3}" --concurrency "${CONCURRENCY:-32}" $(synthetic) ;;
    loop-real)  # the real model on the arithmetic task, pipeline against sync on one GPU
      loop "loop-real${TAG:-}" --layout one-gpu --model smollm2-135m --model-cache "$stash" --task arithmetic \
          --eval-problems 256 --shared-engine --until-reward "${UNTIL:-2}" --learning-rate "${LR:-5e-4}" \
          --group-size "${GROUP:-16}" --groups-per-step "${GPS:-8}" --concurrency "${CONCURRENCY:-16}" \
          --max-tokens "${MAX_TOKENS:-128}" --max-ahead "${MAX_AHEAD:-2}" --max-model-len 1024 --stall-s 10 ;;
    hotswap)  # pinned against in-flight updates (keep, recompute): publish -> served, chunk gaps around the moves
      python3 "$repo/bench/hotswap_bench.py" --model "$stash/models/smollm2-135m" --stream \
          --modes "${MODES:-pipeline,inflight,inflight-recompute}" --max-tokens "${MAX_TOKENS:-512}" \
          --clients "${CLIENTS:-64}" --versions "${VERSIONS:-12}" --train-s 2 --json "$out/hotswap.json" \
          --logs "$out/hotswap-logs" > "$out/hotswap.log" 2>&1; grep -v '^ \|^{\|^}' "$out/hotswap.log" | tail -8 ;;
    model)  # the real model converted once per machine, outside the timed commands
      streamrl model smollm2-135m "$stash/models/smollm2-135m" --cache "$stash/wheels" > "$out/model.log" 2>&1
      tail -1 "$out/model.log" ;;
    engine)  # one shared engine for this machine's later learn commands (it outlives this command: setsid)
      engine_preset=${ENGINE_PRESET:-${PRESET:-short}}
      engine_pid=$(shared_engine_pid)
      if [ -n "$engine_pid" ] && [ "$(cat /root/shared-engine.preset)" != "$engine_preset" ]; then
        kill -TERM "$engine_pid"; while kill -0 "$engine_pid" 2>/dev/null; do sleep 1; done  # its GPU memory back
        echo "stopped the engine of $(cat /root/shared-engine.preset)"; engine_pid=
      fi
      if [ -z "$engine_pid" ]; then
        setsid nohup python3 "$repo/bench/learn_bench.py" serve --preset "$engine_preset" --model-cache "$stash" \
            --out /root/shared-engine --urls "$shared_urls" > /root/shared-engine.log 2>&1 < /dev/null &
        engine_pid=$!
        echo "$engine_pid" > /root/shared-engine.pid; echo "$engine_preset" > /root/shared-engine.preset
      fi  # else the same preset's engine, up or still starting: waited for as a new one
      wait_shared_engine "$engine_pid"
      cp /root/shared-engine.log "$out/engine.log"
      if [ -s "$shared_urls" ]; then echo "engine of $engine_preset up after ${SECONDS} s: $(tr '\n' ' ' < "$shared_urls")"
      elif kill -0 "$engine_pid" 2>/dev/null; then echo "the engine is still starting after ${SECONDS} s"
      else echo "the engine did not start:"; tail -20 /root/shared-engine.log; fi ;;
    learn)  # pipeline against sync over seeds: one preset, runs interleaved on one engine, statistics over seeds
      preset=${PRESET:-short} seeds=${SEEDS:-0}
      name=learn-$preset-s${seeds//,/-}${TAG:-}
      budget=$(( ${DEVICE_LIMIT_S:-570} - SECONDS )); (( budget < 120 )) && budget=120
      rm -rf "/root/$name"
      upstreams=()  # the engine bench's engine when one runs on this machine, else the bench starts its own
      engine_pid=$(shared_engine_pid); [ -n "$engine_pid" ] && wait_shared_engine "$engine_pid"
      if [ -s "$shared_urls" ]; then while read -r u; do upstreams+=(--upstream "$u"); done < "$shared_urls"; fi
      python3 "$repo/bench/learn_bench.py" run --preset "$preset" --seeds "$seeds" --modes "${MODES:-pipeline,sync,inflight}" \
          --model-cache "$stash" ${LEARN_SECONDS:+--max-seconds "$LEARN_SECONDS"} --budget-s "$budget" "${upstreams[@]}" \
          --out "/root/$name" --json "$out/$name.json" > "$out/$name.log" 2>&1
      run_logs "/root/$name" "$name"
      tail -40 "$out/$name.log" ;;
    unpaced-real)  # agents that do not wait for the trainer: the real model, wait against freshest
      streamrl model smollm2-135m /root/stash/models/smollm2-135m --cache "$stash/wheels" > "$out/model.log" 2>&1
      python3 "$repo/bench/unpaced_bench.py" --model /root/stash/models/smollm2-135m --task arithmetic \
          --group-size 16 --max-tokens 128 --rates "${RATES:-16}" --seconds "${LOOP_SECONDS:-90}" \
          --engine '{"device": "0", "gpu_memory_utilization": 0.35}' --out /root/unpaced \
          --trainer '{"device": "cuda:0", "learning_rate": 5e-4, "groups_per_step": 8, "lora_rank": 16, "micro_batch_tokens": 16384}' \
          --json "$out/unpaced-real.json" > "$out/unpaced-real.log" 2>&1; tail -8 "$out/unpaced-real.log" ;;
    judge-real)
      streamrl model smollm2-135m /root/stash/models/smollm2-135m --cache "$stash/wheels" > "$out/model.log" 2>&1
      runs=${JUDGE_RUNS:-throughput exact judge}
      if [[ " $runs " == *" throughput "* ]]; then
        python3 "$repo/bench/judge_bench.py" --model /root/stash/models/smollm2-135m --groups 256 --group-size 8 \
            --concurrency 32 --out /root/jb --json "$out/judge-gpu.json" > "$out/judge-gpu.log" 2>&1
        tail -6 "$out/judge-gpu.log"
      fi
      cat > /root/judge-up.toml <<'TOML'
[engine]
device = "0"
gpu_memory_utilization = 0.35
max_model_len = 4096
[trainer]
device = "cuda:0"
[trainer.optim]
learning_rate = 5e-4
[trainer.lora]
rank = 16
[trainer.compute]
micro_batch_tokens = 16384
[trainer.feed]
groups_per_step = 8
[demo]
group_size = 16
max_tokens = 128
concurrency = 16
max_ahead = 2
until_reward = 2.0
eval_problems = 256
TOML
      for reward in exact judge; do
        [[ " $runs " == *" $reward "* ]] || continue
        rm -rf "/root/judge-$reward"
        streamrl up --config /root/judge-up.toml --model /root/stash/models/smollm2-135m --port 0 \
            --work-dir "/root/judge-$reward" --demo --demo-task arithmetic --demo-reward "$reward" \
            --demo-max-seconds "${LOOP_SECONDS:-120}" --demo-eval-out "$out/judge-$reward-eval.jsonl" \
            --demo-summary "$out/judge-$reward-summary.json" > "$out/judge-$reward.log" 2>&1
        grep -v 'HTTP/1.1" 200' "$out/judge-$reward.log" | grep -v '^engine' | tail -300 > "$out/judge-$reward-tail.log"
        rm -f "$out/judge-$reward.log"; tail -4 "$out/judge-$reward-tail.log"
      done ;;
    sft)  # streamrl sft against a plain transformers + peft loop, tokens/s; one row per micro-batch (0), then 1k rows
      for rows in 0 1024; do
        extra=(); (( rows )) && extra=(--row-tokens "$rows")
        python3 "$repo/bench/sft_bench.py" --model "$stash/models/smollm2-135m" --out /root/sft-bench "${extra[@]}" \
            --json "$out/sft-rows-$rows.json" > "$out/sft-rows-$rows.log" 2>&1
        tail -2 "$out/sft-rows-$rows.log"
      done ;;
    policies)  # #43: 1-8 policies on one engine, real trainers, the same total load: tokens/s, publish -> served
      budget=$(( ${DEVICE_LIMIT_S:-570} - SECONDS )); (( budget < 120 )) && budget=120
      rm -rf /root/pb
      python3 "$repo/bench/policies_bench.py" --model smollm2-135m --model-cache "$stash" \
          --policies "${POLICIES:-1,8,2,4}" --clients "${CLIENTS:-16}" --group-size "${GROUP:-16}" \
          --groups-per-step "${GPS:-8}" --max-tokens "${MAX_TOKENS:-128}" --seconds "${POLICY_SECONDS:-30}" \
          --learning-rate 5e-4 --lora-rank 16 --micro-batch-tokens 4096 --engine-device 0 \
          --gpu-memory-utilization 0.35 --trainer-device cuda:0 --budget-s "$budget" --out /root/pb \
          --json "$out/policies.json" > "$out/policies.log" 2>&1
      (cd /root/pb && for d in p*/; do
         grep -v 'HTTP/1.1" 200' "$d/up.log" | grep -v '^engine' | tail -2000 > "$d/up-tail.log"
       done; tail -200 engine.log > engine-tail.log
       tar czf "$out/policies-logs.tar.gz" engine-tail.log p*/up-tail.log p*/history*.jsonl p*/*.json 2>/dev/null)
      tail -14 "$out/policies.log" ;;
    policies-serving)  # #43: the same counts and load, training imitated (no trainers; RATE versions/s published)
      budget=$(( ${DEVICE_LIMIT_S:-570} - SECONDS )); (( budget < 120 )) && budget=120
      rm -rf /root/pbs
      python3 "$repo/bench/policies_bench.py" --model smollm2-135m --model-cache "$stash" \
          --policies "${POLICIES:-1,8,2,4}" --clients "${CLIENTS:-16}" --group-size "${GROUP:-16}" \
          --max-tokens "${MAX_TOKENS:-128}" --seconds "${POLICY_SECONDS:-30}" --lora-rank 16 --engine-device 0 \
          --gpu-memory-utilization 0.35 --imitate-training "${RATE:-1.0}" --budget-s "$budget" --out /root/pbs \
          --json "$out/policies-serving.json" > "$out/policies-serving.log" 2>&1
      tail -14 "$out/policies-serving.log" ;;
    trainer) (cd "$repo" && python3 bench/trainer_bench.py --shapes qwen2.5-1.5b --rows 4 --warmup 2 --steps 3 \
               --variants eager,compile --out "$out/trainer.json" > "$out/trainer.log" 2>&1); tail -8 "$out/trainer.log" ;;
    *) echo "unknown bench $bench" ;;
  esac
done
