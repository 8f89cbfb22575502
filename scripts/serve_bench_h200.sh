#!/usr/bin/env bash
# The serving measurements of docs/serving.md, one call on the device machine (one GPU):
#   scripts/serve_bench_h200.sh [process whole thread before]     (default: all; results under $OUT)
# The issue's workload: random Llama-3.2-1B, bf16, 256 slots, 512 requests, prompts 64-512 tokens,
# 32-256 new tokens, ignore_eos; at 64 requests/s (Poisson) and all at once. Four servers, one after
# the other: engine core process (streamed, plus the same requests offline through LLM.generate),
# engine core process (whole answers), engine thread (--engine-thread), and the server of the
# commit before core processes (its package copied to .old/, if present).
# Session 16: `api1 api4` -- the same burst three times through one front end and through four
# (`serve --api-servers 4`), each command with its own offline passes: scripts/serve_bench_h200.sh api1 api4
# Session 17: `api1c4 api4c4` -- the same, each burst sent by 4 client processes instead of one;
# `old1c4 api1c4`: api1c4 on the package in .old/ (carried: it is ignored) against this one
# (e.g. `git archive 97394c4 pagedlab | tar -x -C .old`: the front end before session 17's changes)
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BASE=${PYTHONPATH:-}
export PYTHONPATH=$PWD${BASE:+:$BASE}
SERVE=${SERVE:-"--model random:llama-3.2-1b --slots 256 --max-model-len 2048"}
W=${W:-"--input-len 288 --output-len 144 --range-ratio 0.78 --ignore-eos --num-prompts 512 --warmup 16 --no-progress"}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
run() { local name=$1; shift; echo "=== $name"; local t=$SECONDS
        timeout 420 python3 -m pagedlab bench serve "$@" --out "$OUT/$name"; echo "=== $name rc=$? in $((SECONDS - t)) s"
        rm -f "$OUT/$name"/*.png; }
what=${*:-process whole thread before}
API="--offline --offline-passes 3 --rate inf,inf,inf"
for w in $what; do case $w in
process) run process_stream --serve "$SERVE" --offline --rate 64,inf $W ;;
api1)    run api1 --serve "$SERVE --api-servers 1" $API $W ;;
api4)    run api4 --serve "$SERVE --api-servers 4" $API $W ;;
api1c4)  run api1c4 --serve "$SERVE --api-servers 1" $API --client-procs 4,4,4 $W ;;   # (session 17) the
api4c4)  run api4c4 --serve "$SERVE --api-servers 4" $API --client-procs 4,4,4 $W ;;   # bursts from 4 clients
old1c4)  [ -d .old/pagedlab ] && (cd .old && run old1c4 --serve "$SERVE" $API --client-procs 4,4,4 $W) ;;  # api1c4 on .old
whole)   run process_whole --serve "$SERVE" --no-stream --rate inf $W ;;
thread)  run thread_stream --serve "$SERVE --engine-thread" --rate 64,inf $W ;;
before)  if [ -d .old/pagedlab ]; then       # run from inside .old: `python -m` puts the cwd first
           (cd .old && exec python3 -m pagedlab serve $SERVE --port 8377 --log-level warning) &
           pid=$!
           for i in $(seq 1 300); do curl -sf localhost:8377/health >/dev/null && break; sleep 1; done
           run before_stream --url http://127.0.0.1:8377 --rate 64,inf $W
           kill -INT $pid; wait $pid
         fi ;;
esac; done
