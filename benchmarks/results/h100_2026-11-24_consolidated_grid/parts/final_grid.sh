#!/usr/bin/env bash
# usage: final_grid.sh VARIANTS NAME   — each variant in its own process, so a CUDA fault costs one variant only
variants=$1; name=$2; dir=$OUT/$name; mkdir -p $dir
shapes=16x16x1024x64,4x32x4096x64,8x16x2048x128,1x16x16384x128
start=$(date +%s)
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $dir/gpu.txt
for v in ${variants//,/ }; do
  left=$(( 560 - ($(date +%s) - start) ))
  if [ $left -lt 60 ]; then echo "SKIPPED $v (time)" >> $dir/skipped.txt; continue; fi
  PYTHONPATH=. timeout $left python -m benchmarks.bench_attention --variants $v --shapes $shapes \
     --impls compile,flashlight,flex_formula,sdpa,flex --out $dir/$v > $dir/$v.log 2>&1
  echo "$v rc=$? t=$(( $(date +%s) - start ))" >> $dir/rc.txt
done
cd $OUT && tar czf $name.tar.gz $name && rm -rf $name
