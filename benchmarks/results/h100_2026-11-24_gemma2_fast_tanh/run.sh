#!/usr/bin/env bash
# Session 24, run A: Gemma-2's float32 tanh of the upcast bf16 score as tanh.approx.f32; GPU smoke.
dir=$OUT/run24a; mkdir -p $dir
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind24a TRITON_CACHE_DIR=/tmp/tri24a PYTHONPATH=.
start=$(date +%s)
t() { echo "$1 t=$(( $(date +%s) - start ))" >> $dir/rc.txt; }
git log --oneline -1 > $dir/commit.txt; git diff --stat >> $dir/commit.txt
timeout 200 python tools/gpu_smoke.py > $dir/smoke.txt 2>&1; t "smoke rc=$?"
timeout 200 python -m benchmarks.bench_attention --variants gemma2 --shapes 16x16x1024x64,4x32x4096x64,8x16x2048x128,1x16x16384x128 \
   --impls compile,flashlight,flashlight_libdevice_tanh,flex --out $dir/gemma2_four > $dir/gemma2_four.log 2>&1; t "four rc=$?"
left=$(( 570 - ($(date +%s) - start) ))
timeout $left python -m benchmarks.bench_attention --variants gemma2 \
   --shapes 16x16x1024x128,8x16x2048x64,4x16x4096x64,4x16x4096x128,2x16x8192x64,2x16x8192x128,1x16x16384x64,16x32x1024x64,8x32x2048x64,8x32x2048x128,2x32x8192x64,1x32x16384x64 \
   --impls compile,flashlight,flex --out $dir/gemma2_grid > $dir/gemma2_grid.log 2>&1; t "grid rc=$?"
cd $OUT && tar czf run24a.tar.gz run24a && rm -rf run24a
