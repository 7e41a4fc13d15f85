#!/usr/bin/env bash
# The tiny Mamba-2 model bar (Plain single_3 >= 90 at 1K/2K) on a GPU lease.
# The CPU chain of lab/results/tiny-mamba2-growth.md (p1 -> p2 -> p3), from scratch, with the
# bigram product layer present from step 0 (the uuid misses are induction collisions; see the same
# file), at 16x the batch:
#   1. scratch:  5 layers (product layer 0 held + 4 with the bigram induction init), default curriculum
#   2. grow:     + the offset layer in front (conv 8, fitted dt gate), multikey first (bind-grow)
#   3. uuid:     the uuid-heavy mix, layers 0-1 (the two built circuits) held
#   4. eval:     Plain, the six tasks at 1K and 2K, N examples each; scores go in the model README
# The device tool runs at most 10 min per call, so it is two calls on a warm machine (runs/ stays):
#   device run: bash lab/gpu/train_mamba2_gpu.sh scratch     (~7 min)
#   device run: bash lab/gpu/train_mamba2_gpu.sh rest        (~7 min; HF dirs come back under $OUT)
# No fla is needed (transformers' Mamba-2 falls back to its PyTorch scan without mamba_ssm).
# CPU smoke of the whole chain (~3 min):
#   DEVICE=cpu SCALE=0.01 TOKENS=2048 N=1 THREADS=2 bash lab/gpu/train_mamba2_gpu.sh all
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
train() { "$PY" lab/train_backbone.py --set model.family=mamba2 --set train.device="$DEVICE" \
            --set train.threads="$THREADS" --set train.tokens_per_step="$TOKENS" --set model.bigram_heads=4 \
            --set model.heads=8 "$@" 2>&1 | grep -v "falling back" | tail -12; }

if [[ $stage == scratch || $stage == all ]]; then
  train --set out="$R/stage1-scratch" --set run_dir="$R/ck1" --set train.minutes="$(minutes 6)" \
    --set train.seed=0 --set model.layers=5 --set train.product_layer=lag1 --set 'train.freeze_mixer_layers=[0]'
fi
if [[ $stage == rest || $stage == all ]]; then
  test -f "$R/stage1-scratch/config.json" || { echo "no $R/stage1-scratch: run the scratch stage first"; exit 2; }
  train --set out="$R/stage2-grow" --set run_dir="$R/ck2" --set train.init_from="$R/stage1-scratch" \
    --set train.minutes="$(minutes 2.5)" --set model.layers=6 --set model.conv=8 --set 'model.offset_heads=[[6,3]]' \
    --set train.grow_prepend=1 --set train.new_layer_lr_mult=10 --set train.freeze_new_mixer=true \
    --set 'train.freeze_mixer_layers=[1]' --set curriculum=bind-grow --set train.lr=0.0005
  train --set out="$R/stage3-uuid" --set run_dir="$R/ck3" --set train.init_from="$R/stage2-grow" \
    --set train.minutes="$(minutes 2.5)" --set model.layers=6 --set model.conv=8 --set 'model.offset_heads=[[6,3]]' \
    --set 'train.freeze_mixer_layers=[0,1]' --set curriculum=uuid --set train.lr=0.0003
  for d in stage1-scratch stage3-uuid; do
    "$PY" lab/train_backbone.py --set out="$R/$d" --set eval_only=true --set train.device="$DEVICE" \
      --set 'eval.lengths=[1024,2048]' --set eval.n="$N" --set train.threads="$THREADS" \
      --set eval.write_readme=true 2>&1 | grep '"scores"' || true
  done
  cp -r "$R"/stage1-scratch "$R"/stage2-grow "$R"/stage3-uuid "$OUT"/
fi
