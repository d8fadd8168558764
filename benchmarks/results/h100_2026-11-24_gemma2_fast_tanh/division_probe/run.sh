#!/usr/bin/env bash
# Session 24, run B: a score chain's division by a constant as a product (A/B), fp16 smoke case.
dir=$OUT/run24b; mkdir -p $dir
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind24b TRITON_CACHE_DIR=/tmp/tri24b PYTHONPATH=.
start=$(date +%s)
t() { echo "$1 t=$(( $(date +%s) - start ))" >> $dir/rc.txt; }
git log --oneline -1 > $dir/commit.txt; git diff --stat >> $dir/commit.txt
for v in softcap gemma2 key_padding; do
  left=$(( 450 - ($(date +%s) - start) ))
  if [ $left -lt 40 ]; then t "SKIPPED $v"; continue; fi
  timeout $left python -m benchmarks.bench_attention --variants $v --shapes 16x16x1024x64,4x32x4096x64,8x16x2048x128,1x16x16384x128 \
     --impls compile,flashlight,flashlight_true_division,flex --out $dir/$v > $dir/$v.log 2>&1
  t "$v rc=$?"
done
left=$(( 580 - ($(date +%s) - start) ))
timeout $left python tools/gpu_smoke.py --case=2 > $dir/smoke_fp16.txt 2>&1; t "smoke rc=$?"
cd $OUT && tar czf run24b.tar.gz run24b && rm -rf run24b
