#!/usr/bin/env bash
# Issue 4's last model bar (tiny Mamba-2, Plain single_3 >= 90 at 1K/2K) for a GPU lease.
# The CPU chain v2 -> v3 -> v4 of bench/results/tiny-mamba2-growth.md, from scratch, with the
# bigram product layer present from step 0 (session 13 found the uuid misses are induction
# collisions; session 15's 78-min CPU run of stage 1 is in the same file), at 16x the batch:
#   1. scratch:  5 layers (product layer 0 held + 4 with the bigram induction init), default curriculum
#   2. grow:     + the offset layer in front (conv 8, fitted dt gate), multikey first (bind-grow)
#   3. uuid:     the uuid-heavy mix, layers 0-1 (the two built circuits) held
#   4. eval:     Plain, the six tasks at 1K and 2K, N examples each; scores go in the model README
# The device tool runs at most 10 min per call, so it is two calls on a warm machine (runs/ stays):
#   device run: bash bench/gpu/train_mamba2_gpu.sh scratch     (~7 min)
#   device run: bash bench/gpu/train_mamba2_gpu.sh rest        (~7 min; HF dirs come back under $OUT)
# No fla is needed (transformers' Mamba-2 falls back to its PyTorch scan without mamba_ssm).
# CPU smoke of the whole chain (~3 min):
#   DEVICE=cpu SCALE=0.01 TOKENS=2048 N=1 THREADS=2 bash bench/gpu/train_mamba2_gpu.sh all
set -euo pipefail
DEVICE=${DEVICE:-cuda}   # cuda | cpu
SCALE=${SCALE:-1}        # multiplies every stage's minutes (a smoke uses 0.01)
TOKENS=${TOKENS:-65536}  # tokens per optimizer step (the CPU recipe used 4096)
N=${N:-50}               # eval examples per task and length
THREADS=${THREADS:-8}
OUT=${OUT:-out/gpu-mamba2}
R=${RUNS:-runs/gpu-mamba2}
PY=${PY:-python3}
stage=${1:-all}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$R"
minutes() { "$PY" -c "print(round($1 * $SCALE, 4))"; }
train() { "$PY" jobs/train_backbone.py --family mamba2 --device "$DEVICE" --threads "$THREADS" \
            --tokens-per-step "$TOKENS" --bigram-heads 4 --heads 8 "$@" 2>&1 | grep -v "falling back" | tail -12; }

if [[ $stage == scratch || $stage == all ]]; then
  train --out "$R/stage1-scratch" --run-dir "$R/ck1" --minutes "$(minutes 6)" --seed 0 \
    --layers 5 --product-layer lag1 --freeze-mixer-layers 0
fi
if [[ $stage == rest || $stage == all ]]; then
  test -f "$R/stage1-scratch/config.json" || { echo "no $R/stage1-scratch: run the scratch stage first"; exit 2; }
  train --out "$R/stage2-grow" --run-dir "$R/ck2" --init-from "$R/stage1-scratch" --minutes "$(minutes 2.5)" \
    --layers 6 --conv 8 --offset-heads 6:3 --prepend-layers 1 --new-layer-lr-mult 10 --freeze-new-mixer \
    --freeze-mixer-layers 1 --phases bind-grow --lr 5e-4
  train --out "$R/stage3-uuid" --run-dir "$R/ck3" --init-from "$R/stage2-grow" --minutes "$(minutes 2.5)" \
    --layers 6 --conv 8 --offset-heads 6:3 --freeze-mixer-layers 0 1 --phases uuid --lr 3e-4
  for d in stage1-scratch stage3-uuid; do
    "$PY" jobs/train_backbone.py --family mamba2 --out "$R/$d" --eval-only --device "$DEVICE" \
      --length 1024 2048 --n "$N" --threads "$THREADS" --write-readme 2>&1 | grep '"scores"' || true
  done
  cp -r "$R"/stage1-scratch "$R"/stage2-grow "$R"/stage3-uuid "$OUT"/
fi
