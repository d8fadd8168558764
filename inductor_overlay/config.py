"""Flashlight's configuration, in the style of ``torch._inductor.config`` (supports ``config.patch``).

Every value here is part of the FX-graph cache key (see ``fx_passes.post_grad.FlashlightPostGradPass.uuid``).
"""

import os
import sys

from torch.utils._config_module import install_config_module

# Master switch consulted at compile time. `flashlight.enabled(False)` and FLASHLIGHT_DISABLE=1 act on the patches
# themselves; this flag is for tests and bisecting: patches stay installed but pass straight through.
enabled: bool = True

# If anything raises while the overlay is active, recompile the graph on upstream Inductor's path and warn once.
fault_containment: bool = os.environ.get("FLASHLIGHT_FAULT_CONTAINMENT", "1") != "0"

# Technique 1-4 together: fuse softmax(chain(q @ kᵀ)) @ v into one online-softmax Triton kernel.
attention_fusion: bool = os.environ.get("FLASHLIGHT_ATTENTION_FUSION", "1") != "0"
# Training: attention whose inputs require grad gets a fused forward and a fused backward (fx_passes/attention_training.py).
fused_backward: bool = os.environ.get("FLASHLIGHT_FUSED_BACKWARD", "1") != "0"
# The backward kernel's tiles, "BLOCK_M1,BLOCK_N1,BLOCK_M2,BLOCK_N2,warps,stages" (for sweeps, tools/gpu_training.py);
# empty: the defaults of kernel/attention_backward.py.
backward_tiles: str = os.environ.get("FLASHLIGHT_BACKWARD_TILES", "")

# Tiles that the position mask leaves entirely visible run the chain without its mask (a loop of their own),
# where that pays (see attention_fusion._worth_a_visible_loop).
split_visible_tiles: bool = os.environ.get("FLASHLIGHT_SPLIT_VISIBLE_TILES", "1") != "0"
# ... for head dims up to this (a mask read from a tensor splits at any head dim).
visible_loop_max_head_dim: int = int(os.environ.get("FLASHLIGHT_VISIBLE_LOOP_MAX_HEAD_DIM", "128"))
# ... in the backward too (attention_training._backward_visible_loop).
backward_visible_loop: bool = os.environ.get("FLASHLIGHT_BACKWARD_VISIBLE_LOOP", "1") != "0"

# The gradient of a table the chain gathers by the distance n - m (T5's learned bucket table) from the fused backward:
# the kernel sums the read's gradient per diagonal, the graph scatters the sums into the table's rows. Off, such
# attention trains on upstream's path, whose backward accumulates the gathered [H, M, N] gradient into the table:
# 1,900-3,100x slower a step on an H200 (bf16, 2x16x1024x64 to 4x16x2048x64, 2026-11-28,
# results/training/t5_learned_table_h200.txt).
distance_gather_gradients: bool = os.environ.get("FLASHLIGHT_DISTANCE_GATHER_GRADIENTS", "1") != "0"

# The backward takes the constant factors out of the chain's derivative (1/sqrt(d), a soft-cap's c and 1/c) and
# multiplies dQ and dK by them once, as they are stored, instead of every logit (logit_scale.fold_gradient_factors).
fold_gradient_factors: bool = os.environ.get("FLASHLIGHT_FOLD_GRADIENT_FACTORS", "1") != "0"

# Matmuls fed by pointwise ops of another matmul with no softmax between (sigmoid attention, (A·B)·C) fuse only
# where the kernel beats two GEMMs: inner dims (D, Dv) up to this, and on a GPU at least this many rows (M·batch)
# so the row tiles fill the machine (the fused kernel does not split N).
linear_fusion_max_inner_dim: int = 128
linear_fusion_min_rows: int = 16384

# DiffAttn-style head combinations with scalar coefficients: True runs the heads of a group in turn in one program
# and combines them there (one kernel, no per-head outputs in memory); False runs one attention kernel over all heads
# and a pointwise kernel for the combination. On the H100, True took up to 16% less time at head dim 128 and S 512,
# and within 1% as much at the longest D64 rows (benchmarks/results/h100_2026-11-23_diff_partial_sum/).
combine_head_groups_in_kernel: bool = os.environ.get("FLASHLIGHT_COMBINE_HEAD_GROUPS_IN_KERNEL", "1") != "0"

# In training, the same distribution is applied on Dynamo's graph before autograd (fx_passes/head_groups_pre_grad.py),
# so that differential attention trains as one fused attention over all heads with its combination differentiated
# on the [.., M, Dv] outputs.
distribute_head_groups_in_training: bool = os.environ.get("FLASHLIGHT_DISTRIBUTE_HEAD_GROUPS_IN_TRAINING", "1") != "0"

# Heads of such a group that read one V (DiffAttn's pair) share one pass over the column tiles: each V tile is loaded
# once for all of their accumulators, instead of once per head in turn. Their accumulators (heads × Dv columns per
# row) are live together, so this applies up to the given width; wider groups run in turn.
share_v_tile_in_head_groups: bool = os.environ.get("FLASHLIGHT_SHARE_V_TILE_IN_HEAD_GROUPS", "1") != "0"
shared_v_max_accumulator_columns: int = 256

# The block-skipping pre-pass tests 64 column tiles per step (vectors of tile bounds) instead of one: at long
# sequences a one-tile-per-step scan costs as much as the visible tiles' work (sliding windows).
vector_tile_scan: bool = os.environ.get("FLASHLIGHT_VECTOR_TILE_SCAN", "1") != "0"

# A boolean mask passed in as a tensor is reduced by the graph, once per call, to a table of per-cell states
# (none / some / all masked) that the block-skipping pre-pass reads, as FlexAttention's BlockMask but derived.
mask_tensor_tables: bool = os.environ.get("FLASHLIGHT_MASK_TENSOR_TABLES", "1") != "0"

# The table of an additive mask the graph computes (HF's causal-and-padding mask) evaluates only the first row of a
# block of 32 rows where the bias provably varies along the rows only through position formulas that are constant
# over the block (every block the causal diagonal does not cross), instead of every row.
row_invariant_mask_blocks: bool = os.environ.get("FLASHLIGHT_ROW_INVARIANT_MASK_BLOCKS", "1") != "0"

# A sum over at most this many elements of values that do not depend on the scores (IPA's squared distance
# between query and key points) moves into the score chain, unrolled per tile element, instead of being
# materialised as an M×N tensor the kernel reads.
chain_reduction_max_elements: int = 16

# The probabilities reduced against a per-pair tensor beside P·V (IPA's Σ_j a_ij·z_ij) accumulate in the same
# loop up to this many channels; the kernel holds a [BLOCK_M, BLOCK_N, channels] tile of the pair tensor, so its
# tiles shrink as channels grow. On the H100 the fused IPA core ran 1.9× faster than default torch.compile at
# 32 channels (S 768) and 0.78× at 128 (S 256: 16×16 tiles, too few programs), hence 64.
pair_reduction_max_channels: int = 64

# A value the score chain computes from the distance n - m alone (T5's bucketed bias: a log, a gather from its
# table) is computed once per distance, into a small table the kernel reads per logit (fx_passes/distance_tables.py).
distance_tables: bool = os.environ.get("FLASHLIGHT_DISTANCE_TABLES", "1") != "0"

# A softmax scaled by a tensor (a temperature, or 1/sqrt(d) with every size symbolic) that upstream rewrote into its
# sign trick gets its logits back where it feeds a matmul (fx_passes/signed_scales.py).
rejoin_signed_scales: bool = os.environ.get("FLASHLIGHT_REJOIN_SIGNED_SCALES", "1") != "0"

# A ``gather`` off the score path (DeBERTa's content-to-position scores, gathered from a [B·H, M, 2k] matmul at the
# relative position) moves into the chain: read per logit, no M×N tensor in memory. Off by default: on the H100,
# DeBERTa-v3's whole forward at B16 S512 ran 4.56 ms with it and 4.39 ms reading the gathered bias (another process;
# default compile 4.98 and 5.01), h100_2026-11-25_hf_score_views/.
gathers_in_score_chain: bool = os.environ.get("FLASHLIGHT_GATHERS_IN_SCORE_CHAIN", "0") == "1"

# A chain that only scales the scores by constants and masks them to -inf leaves its scale to the kernel's exp2
# factor: one fma per logit scales it and subtracts the row max (fx_passes/logit_scale.py).
fold_logit_scale: bool = os.environ.get("FLASHLIGHT_FOLD_LOGIT_SCALE", "1") != "0"

# A chain that guards its scores against NaN and infinity (``nan_to_num``) runs without the guards, and a row tile
# whose softmax state shows a NaN or an infinity runs again with them (fx_passes/finite_speculation.py).
speculate_finite_scores: bool = os.environ.get("FLASHLIGHT_SPECULATE_FINITE_SCORES", "1") != "0"

# Captured integer positions that a mask orders or that ALiBi subtracts (``arange`` made once outside the compiled
# function, a registered buffer of it, HF's ``position_ids``) are checked once per call for consecutive values; where
# they are, the kernel computes them from its own tile positions (no load per tile, 32-bit arithmetic), and where they
# are not it runs the chain that reads them (fx_passes/chain_modules.affine_positions).
affine_positions: bool = os.environ.get("FLASHLIGHT_AFFINE_POSITIONS", "1") != "0"

# Row tiles are launched last first: under a causal mask (or any mask whose visible columns grow with the row)
# the longest programs start first and the short ones fill the tail, as FlashAttention schedules them.
last_rows_first: bool = os.environ.get("FLASHLIGHT_LAST_ROWS_FIRST", "1") != "0"

# Skip key tiles that the user's position mask (causal, sliding window, ...) sets entirely to -inf.
block_skipping: bool = os.environ.get("FLASHLIGHT_BLOCK_SKIPPING", "1") != "0"

# Tile configs (BLOCK_M, BLOCK_N, warps, stages) of the fused kernel: "always" autotunes among the pruned list at
# every compile; "max-autotune" does so only under Inductor's max-autotune (``mode="max-autotune"``), as Inductor
# treats its own templates and FlexAttention its kernel, and otherwise compiles the list's first config alone
# (no benchmarking step, one Triton compile).
tile_autotuning: str = os.environ.get("FLASHLIGHT_TILE_AUTOTUNING", "max-autotune")

# Attention that upstream's SDPA pattern matcher recognises: "sdpa" keeps upstream's rewrite to
# scaled_dot_product_attention, "flashlight" fuses it with the overlay instead, "unmasked_sdpa" keeps the rewrite
# only where it applies no mask: with a mask SDPA runs a kernel that reads it per element and visits every tile,
# where the overlay skips masked tiles (see benchmarks/results for the measurements).
sdpa_pattern_policy: str = os.environ.get("FLASHLIGHT_SDPA_PATTERN_POLICY", "unmasked_sdpa")
# tanh in an attention kernel's score chain (soft-capping), where eager's tanh is only 16-bit precise, as the GPU's
# tanh.approx.f32 (one instruction; the PTX ISA bounds its relative error by 2^-11, the H100 measured 9.9e-6) instead
# of libdevice's tanhf: a tanh of an fp16/bf16 value (eager rounds its result to 16 bits, bf16: up to 3.9e-3), or a
# float32 tanh of the 16-bit score upcast and scaled by constants or by values computed without the scores (a run-time
# cap under dynamic=True; eager's argument carries the score's rounding;
# kernel.online_softmax_attention.tanhs_of_16_bit_precision). Soft-cap on the H100: 1.6-1.8x faster
# (benchmarks/results/h100_2026-11-23_gqa_route_fast_tanh/fast_tanh/).
fast_tanh: bool = os.environ.get("FLASHLIGHT_FAST_TANH", "1") != "0"

# Under "sdpa" and "unmasked_sdpa", attention SDPA's fused kernels compute exactly (constant scale, no mask or the
# top-left causal mask, K/V read directly or repeated over query-head groups, fp16/bf16) runs as SDPA on these device
# types (fx_passes/sdpa_route.py); "flashlight" keeps it fused. On the H100 the route ran causal attention at
# 0.98-1.03x of eager SDPA over the 20-shape grid, where our causal kernel ran at 0.72-0.90x
# (benchmarks/results/h100_2026-11-23_causal_sdpa_route/grid/). FLASHLIGHT_SDPA_ROUTE_DEVICES= (empty) turns it off.
sdpa_route_devices: tuple = tuple(filter(None, os.environ.get("FLASHLIGHT_SDPA_ROUTE_DEVICES", "cuda").split(",")))


# Attention masked by tensors made outside the graph (a registered ``tril`` buffer sliced to the length, positions made
# once, a mask passed in), which is the in-function causal form exactly when those tensors hold the causal mask, runs
# as ``torch.cond`` between that form's kernel (SDPA's causal kernel where the policy and devices above give it that
# form, else ours with the causal formula) and the kernel that reads the masks:
# ``mask_checks.known_causal`` checks the tensors on the device from their second call on and answers from that check
# while they keep their version (fx_passes/causal_tensor_route.py). In training (any policy or device) the checked
# branch is the causal formula's fused forward and backward (SDPA's pair where SDPA takes causal attention). A write
# through ``tensor.data`` changes no version: set FLASHLIGHT_CAUSAL_TENSOR_ROUTE=0 for programs that write masks that
# way.
causal_tensor_route: bool = os.environ.get("FLASHLIGHT_CAUSAL_TENSOR_ROUTE", "1") != "0"

# In inference, where that check finds the mask not causal, the same attention runs as ``torch.cond`` between the
# kernel with a band's formula (a causal sliding window of W keys, a prefix of P keys every row sees, or both; W and P
# read off the mask's first and last rows in the graph) and the kernel that reads the mask: ``mask_checks.known_band``
# checks on the device, from the second call that sees the same tensors, that the mask is exactly that band
# (fx_passes/band_tensor_route.py). A write through ``tensor.data`` changes no version: set
# FLASHLIGHT_BAND_TENSOR_ROUTE=0 for programs that write masks that way.
band_tensor_route: bool = os.environ.get("FLASHLIGHT_BAND_TENSOR_ROUTE", "1") != "0"

# Attention whose chain reads positions made outside the graph (a 1-D integer tensor made once, a registered position
# buffer sliced to the length) runs as ``torch.cond`` between the kernel of the same attention written with ``arange``
# in the graph and the kernel that reads the positions: ``mask_checks.known_arange`` checks that they hold 0, 1, ...
# on the device from their second call on and answers from that check while they keep their version
# (fx_passes/arange_positions_route.py), in inference and in training (forward and backward each under a ``cond`` on one
# check); not under CUDA graphs or AOTInductor. A write through
# ``tensor.data`` changes no version: set FLASHLIGHT_ARANGE_POSITIONS_ROUTE=0 for programs that write positions so.
arange_positions_route: bool = os.environ.get("FLASHLIGHT_ARANGE_POSITIONS_ROUTE", "1") != "0"

install_config_module(sys.modules[__name__])
