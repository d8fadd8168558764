#!/usr/bin/env bash
# Session 27, run B: DeBERTa-v2 with the gathers in the kernel: bench (both paddings), tile sweep; HF check.
dir=$OUT/run27b; mkdir -p $dir
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind27b TRITON_CACHE_DIR=/tmp/tri27b PYTHONPATH=.
start=$(date +%s)
t() { echo "$1 t=$(( $(date +%s) - start ))" >> $dir/rc.txt; }
git log --oneline -1 > $dir/commit.txt; git diff --stat >> $dir/commit.txt
timeout 200 python -m benchmarks.bench_hf_models --families deberta-v2,xglm --padding both --out $dir/hf_new > $dir/hf_new.log 2>&1; t "bench rc=$?"
timeout 240 python scratch_gpu/deberta_sweep.py > $dir/deberta_sweep.txt 2>&1; t "sweep rc=$?"
left=$(( 580 - ($(date +%s) - start) ))
timeout $left python tools/gpu_hf_models.py bfloat16 > $dir/gpu_hf_models_bf16.txt 2>&1; t "bf16 rc=$?"
cd $OUT && tar czf run27b.tar.gz run27b && rm -rf run27b
