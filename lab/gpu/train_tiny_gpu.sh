#!/usr/bin/env bash
# Prepared for a GPU lease (the tiny models' multi-needle bar): trains a larger tiny GDN and
# Mamba-2 on one H200 (~4 min each), evaluates Plain at the training length, and returns the HF
# model dirs under $OUT. Run from the repo root with the fla wheels in .whl (see
# bench/gpu/README.md for how they are fetched):
#
#   device run (carry [".whl"]): bash lab/gpu/train_tiny_gpu.sh
#
# Sizes stay under the 20 MB shipping limit: GDN hidden 192 x 6 layers x 6 heads (J=36), MLP 512.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-out/gpu-train}
mkdir -p "$OUT"
for fam in gdn mamba2; do
  extra=()
  [ $fam = gdn ] && extra=(--set model.bigram_heads=3)   # half the heads bigram-induction (see backbone._init_gdn)
  timeout 330 python3 lab/train_backbone.py --set model.family=$fam --set out="$OUT/tiny-$fam" \
    --set run_dir=/tmp/run-$fam "${extra[@]}" --set train.device=cuda --set train.minutes=4 \
    --set model.hidden=192 --set model.layers=6 --set model.heads=6 --set model.mlp=512 \
    --set train.tokens_per_step=65536 --set train.lr=0.002 --set train.threads=8 2>&1 \
    | grep -v "Writing model" | tail -25 || true
  timeout 120 python3 lab/train_backbone.py --set out="$OUT/tiny-$fam" --set eval_only=true \
    --set 'eval.lengths=[2048]' --set eval.n=20 --set train.threads=8 --set eval.write_readme=true 2>&1 | tail -3 || true
done
ls -la "$OUT"/*
