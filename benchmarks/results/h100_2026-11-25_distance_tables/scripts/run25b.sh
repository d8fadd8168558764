#!/usr/bin/env bash
# Session 25, run B: GPU smoke again (run A's smoke failed every non-GQA idiom, unexplained); Flex's T5 with scale 1;
# T5 against Flex.
dir=$OUT/run25b; mkdir -p $dir
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind25b TRITON_CACHE_DIR=/tmp/tri25b PYTHONPATH=.
start=$(date +%s)
t() { echo "$1 t=$(( $(date +%s) - start ))" >> $dir/rc.txt; }
git log --oneline -1 > $dir/commit.txt; git diff --stat >> $dir/commit.txt
timeout 200 python tools/gpu_smoke.py 1 > $dir/smoke.txt 2>&1; t "smoke rc=$?"
timeout 100 python scratch_gpu/flex_t5_check.py > $dir/flex_t5_check.txt 2>&1; t "check rc=$?"
left=$(( 560 - ($(date +%s) - start) ))
timeout $left python -m benchmarks.bench_attention --variants t5_bias,t5_hf --shapes 16x16x1024x64,4x32x4096x64,8x16x2048x128,1x16x16384x128 \
   --impls compile,flashlight,flex --out $dir/t5_flex > $dir/t5_flex.log 2>&1; t "flex rc=$?"
cd $OUT && tar czf run25b.tar.gz run25b && rm -rf run25b
