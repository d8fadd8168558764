#!/usr/bin/env bash
# Session 24, run C: tile sweeps for sigmoid attention (both sizes) and Gemma-2 at 16x16x1024x128; sigmoid vs compile.
dir=$OUT/run24c; mkdir -p $dir
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind24c TRITON_CACHE_DIR=/tmp/tri24c PYTHONPATH=.
start=$(date +%s)
t() { echo "$1 t=$(( $(date +%s) - start ))" >> $dir/rc.txt; }
git log --oneline -1 > $dir/commit.txt
timeout 120 python -m benchmarks.bench_programs --programs sigmoid_attention --impls compile,flashlight --out $dir/sigmoid > $dir/sigmoid.log 2>&1; t "sigmoid rc=$?"
timeout 200 python tools/program_config_sweep.py sigmoid_attention 0,1 > $dir/sigmoid_sweep.txt 2>&1; t "sigmoid sweep rc=$?"
left=$(( 560 - ($(date +%s) - start) ))
timeout $left python tools/tile_config_sweep.py gemma2 16x16x1024x128 > $dir/gemma2_sweep.txt 2>&1; t "gemma2 sweep rc=$?"
cd $OUT && tar czf run24c.tar.gz run24c && rm -rf run24c
