#!/usr/bin/env bash
# Session 24, run D: Gemma-2 at the issue grid's four H32 D128 shapes.
dir=$OUT/run24d; mkdir -p $dir
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind24d TRITON_CACHE_DIR=/tmp/tri24d PYTHONPATH=.
git log --oneline -1 > $dir/commit.txt
timeout 500 python -m benchmarks.bench_attention --variants gemma2 --shapes 16x32x1024x128,4x32x4096x128,2x32x8192x128,1x32x16384x128 \
   --impls compile,flashlight,flex --out $dir/gemma2_h32_d128 > $dir/gemma2_h32_d128.log 2>&1; echo "rc=$?" > $dir/rc.txt
cd $OUT && tar czf run24d.tar.gz run24d && rm -rf run24d
