#!/usr/bin/env bash
# Session 23, run B: lazy rescaling A/B (smoke, variants, DiffAttn D128 as the issue writes it).
dir=$OUT/run23b; mkdir -p $dir
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind23b TRITON_CACHE_DIR=/tmp/tri23b PYTHONPATH=.
start=$(date +%s)
t() { echo "$1 t=$(( $(date +%s) - start ))" >> $dir/rc.txt; }
FLASHLIGHT_LAZY_RESCALE=1 timeout 120 python tools/gpu_smoke.py 1 > $dir/smoke_lazy.txt 2>&1; t "smoke rc=$?"
timeout 200 python -m benchmarks.bench_programs --programs diff_attention_two_matmuls --size-indices 6,7,8,9,11 \
   --impls compile,flashlight_eager_rescale,flashlight_lazy_rescale --out $dir/diff128 > $dir/diff128.log 2>&1; t "diff rc=$?"
for v in softcap gemma2 document sliding_window key_padding; do
  left=$(( 570 - ($(date +%s) - start) ))
  if [ $left -lt 40 ]; then t "SKIPPED $v"; continue; fi
  timeout $left python -m benchmarks.bench_attention --variants $v --shapes 16x16x1024x64,4x32x4096x64,8x16x2048x128 \
     --impls flashlight_eager_rescale,flashlight_lazy_rescale,flex --out $dir/$v > $dir/$v.log 2>&1
  t "$v rc=$?"
done
cd $OUT && tar czf run23b.tar.gz run23b && rm -rf run23b
