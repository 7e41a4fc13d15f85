#!/usr/bin/env bash
# Prepared for the next GPU lease (issue 4: the shipped tiny models miss the multi-needle bar).
# Trains a larger tiny GDN and Mamba-2 on one H200 (~4 min each), evaluates Plain at the training
# length, and returns the HF model dirs under $OUT. Run from the repo root with the fla wheels in
# .whl (see bench/results/overhead-gpu.md for how they were fetched):
#
#   device run (carry [".whl"]): bash bench/gpu/train_tiny_gpu.sh
#
# Sizes stay under the 20 MB shipping limit: GDN hidden 192 x 6 layers x 6 heads (J=36), MLP 512.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-out/gpu-train}
mkdir -p "$OUT"
for fam in gdn mamba2; do
  extra=""; [ $fam = gdn ] && extra="--bigram-heads 3"   # half the heads bigram-induction (see backbone._init_gdn)
  timeout 330 python3 jobs/train_backbone.py --family $fam --out "$OUT/tiny-$fam" --run-dir /tmp/run-$fam $extra \
    --device cuda --minutes 4 --hidden 192 --layers 6 --heads 6 --mlp 512 --tokens-per-step 65536 \
    --lr 2e-3 --threads 8 2>&1 | grep -v "Writing model" | tail -25 || true
  timeout 120 python3 jobs/train_backbone.py --family $fam --out "$OUT/tiny-$fam" --eval-only --length 2048 \
    --n 20 --threads 8 --write-readme 2>&1 | tail -3 || true
done
ls -la "$OUT"/*
