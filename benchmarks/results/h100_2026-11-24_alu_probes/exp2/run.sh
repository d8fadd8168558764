#!/usr/bin/env bash
# Session 23, run A: the probability exp2's error, smoke with pack 2, an exp2 A/B, key padding after an overlay-off compile.
dir=$OUT/run23a; mkdir -p $dir
export TORCHINDUCTOR_CACHE_DIR=/tmp/ind23a TRITON_CACHE_DIR=/tmp/tri23a PYTHONPATH=.
start=$(date +%s)
t() { echo "$1 t=$(( $(date +%s) - start ))" >> $dir/rc.txt; }
timeout 60 python tools/measure_probability_exp2_error.py > $dir/exp2_error.txt 2>&1; t "exp2_error rc=$?"
FLASHLIGHT_EXP2_PACK=2 timeout 150 python tools/gpu_smoke.py 1 > $dir/smoke_pack2.txt 2>&1; t "smoke rc=$?"
timeout 60 python -m benchmarks.bench_attention --variants key_padding --shapes 8x16x2048x128 \
   --impls compile,flashlight,sdpa --out $dir/key_padding > $dir/key_padding.log 2>&1; t "kp rc=$?"
for v in softcap alibi head_bias gemma2; do
  left=$(( 570 - ($(date +%s) - start) ))
  if [ $left -lt 40 ]; then t "SKIPPED $v"; continue; fi
  timeout $left python -m benchmarks.bench_attention --variants $v --shapes 16x16x1024x64,4x32x4096x64,8x16x2048x128 \
     --impls flashlight_exp2_tl,flashlight_exp2_ftz,flashlight_exp2_pack2,flashlight_exp2_pack4,flex --out $dir/$v > $dir/$v.log 2>&1
  t "$v rc=$?"
done
cd $OUT && tar czf run23a.tar.gz run23a && rm -rf run23a
