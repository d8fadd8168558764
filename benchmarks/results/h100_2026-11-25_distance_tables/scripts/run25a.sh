#!/usr/bin/env bash
# Session 25, run A: distance tables (T5's bias computed once per distance) vs the per-logit chain, Flex, compile.
dir=$OUT/run25a; mkdir -p $dir
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind25a TRITON_CACHE_DIR=/tmp/tri25a PYTHONPATH=.
start=$(date +%s)
t() { echo "$1 t=$(( $(date +%s) - start ))" >> $dir/rc.txt; }
git log --oneline -1 > $dir/commit.txt; git diff --stat >> $dir/commit.txt
timeout 330 python -m benchmarks.bench_attention --variants t5_bias,t5_hf --shapes 16x16x1024x64,4x32x4096x64,8x16x2048x128,1x16x16384x128 \
   --impls compile,flashlight,flashlight_per_logit_distance,flex --out $dir/t5_four > $dir/t5_four.log 2>&1; t "four rc=$?"
left=$(( 560 - ($(date +%s) - start) ))
timeout $left python tools/gpu_smoke.py 1 > $dir/smoke.txt 2>&1; t "smoke rc=$?"
cd $OUT && tar czf run25a.tar.gz run25a && rm -rf run25a
