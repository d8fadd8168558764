#!/usr/bin/env bash
# Session 25, run E: T5 with 128x32 tiles at head dim 128 (gathers); the four shapes and the D128 grid shapes.
dir=$OUT/run25e; mkdir -p $dir
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind25e TRITON_CACHE_DIR=/tmp/tri25e PYTHONPATH=.
start=$(date +%s)
t() { echo "$1 t=$(( $(date +%s) - start ))" >> $dir/rc.txt; }
git log --oneline -1 > $dir/commit.txt; git diff --stat >> $dir/commit.txt
timeout 280 python -m benchmarks.bench_attention --variants t5_bias,t5_hf --shapes 16x16x1024x64,4x32x4096x64,8x16x2048x128,1x16x16384x128 \
   --impls compile,flashlight,flex --out $dir/t5_four > $dir/t5_four.log 2>&1; t "four rc=$?"
left=$(( 560 - ($(date +%s) - start) ))
timeout $left python -m benchmarks.bench_attention --variants t5_hf \
   --shapes 16x16x1024x128,4x16x4096x128,2x16x8192x128,16x32x1024x128,4x32x4096x128,8x32x2048x128,2x32x8192x128,1x32x16384x128 \
   --impls compile,flashlight,flex --out $dir/t5_hf_d128 > $dir/t5_hf_d128.log 2>&1; t "d128 rc=$?"
cd $OUT && tar czf run25e.tar.gz run25e && rm -rf run25e
