#!/usr/bin/env bash
# Session 27, run A: HF families after the score-view rewrites (bf16 check), XGLM and DeBERTa-v2 timed, the smoke.
dir=$OUT/run27a; mkdir -p $dir
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind27a TRITON_CACHE_DIR=/tmp/tri27a PYTHONPATH=.
start=$(date +%s)
t() { echo "$1 t=$(( $(date +%s) - start ))" >> $dir/rc.txt; }
git log --oneline -1 > $dir/commit.txt; git diff --stat >> $dir/commit.txt
timeout 240 python tools/gpu_hf_models.py bfloat16 > $dir/gpu_hf_models_bf16.txt 2>&1; t "bf16 rc=$?"
timeout 240 python -m benchmarks.bench_hf_models --families xglm,deberta-v2 --padding both --out $dir/hf_new > $dir/hf_new.log 2>&1; t "bench rc=$?"
left=$(( 570 - ($(date +%s) - start) ))
timeout $left python tools/gpu_smoke.py --case=0 > $dir/gpu_smoke.txt 2>&1; t "smoke rc=$?"
cd $OUT && tar czf run27a.tar.gz run27a && rm -rf run27a
