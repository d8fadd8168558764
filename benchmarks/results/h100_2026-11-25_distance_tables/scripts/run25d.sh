#!/usr/bin/env bash
# Session 25, run D: tile sweeps for T5 with its distance table (D128 runs at 186-231 TFLOP/s).
dir=$OUT/run25d; mkdir -p $dir
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind25d TRITON_CACHE_DIR=/tmp/tri25d PYTHONPATH=.
start=$(date +%s)
t() { echo "$1 t=$(( $(date +%s) - start ))" >> $dir/rc.txt; }
git log --oneline -1 > $dir/commit.txt; git diff --stat >> $dir/commit.txt
for shape in 8x16x2048x128 16x16x1024x128 4x32x4096x64; do
  timeout 170 python tools/tile_config_sweep.py t5_hf $shape > $dir/sweep_t5_hf_$shape.txt 2>&1; t "$shape rc=$?"
done
cd $OUT && tar czf run25d.tar.gz run25d && rm -rf run25d
