#!/usr/bin/env bash
# Session 25, run C: GPU smoke with upstream's matmul padding forced (S = 300 is unaligned); T5 over the issue grid.
dir=$OUT/run25c; mkdir -p $dir
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind25c TRITON_CACHE_DIR=/tmp/tri25c PYTHONPATH=.
start=$(date +%s)
t() { echo "$1 t=$(( $(date +%s) - start ))" >> $dir/rc.txt; }
git log --oneline -1 > $dir/commit.txt; git diff --stat >> $dir/commit.txt
timeout 200 python -c "
import sys, runpy, torch._inductor.config as c
c.force_shape_pad = True
sys.argv = ['tools/gpu_smoke.py', '1']
runpy.run_path('tools/gpu_smoke.py', run_name='__main__')" > $dir/smoke_forced_padding.txt 2>&1; t "smoke rc=$?"
left=$(( 560 - ($(date +%s) - start) ))
timeout $left python -m benchmarks.bench_attention --variants t5_hf \
   --shapes 16x16x1024x64,8x16x2048x64,4x16x4096x64,2x16x8192x64,1x16x16384x64,16x16x1024x128,8x16x2048x128,4x16x4096x128,2x16x8192x128,1x16x16384x128,16x32x1024x64,4x32x4096x64,16x32x1024x128,4x32x4096x128 \
   --impls compile,flashlight,flex --out $dir/t5_hf_grid > $dir/t5_hf_grid.log 2>&1; t "grid rc=$?"
cd $OUT && tar czf run25c.tar.gz run25c && rm -rf run25c
