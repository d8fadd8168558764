"""Hugging Face models as users run them, with ``attn_implementation="eager"``: HF's own attention code (rotary
embeddings, K/V heads repeated in the graph, HF's masks, a float32 softmax), random weights.

Shared by ``test/test_hf_models.py`` (one small layer, CPU) and ``benchmarks/bench_hf_models.py`` (GPU).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # transformers' model type
    overrides: dict  # config fields beyond the common sizes (grouped heads, windows, ...)
    attentions_per_layer: int = 1  # T5: encoder self, decoder self, decoder cross
    query_heads_per_kv_head: int = 1  # grouped K/V (GQA): num_key_value_heads = heads / this
    position_matmuls: bool = False  # relative-position scores are matmuls of their own (DeBERTa's c2p and p2c)
    what: str = ""


FAMILIES = [
    Family("llama", {}, query_heads_per_kv_head=4, what="GQA (4 query heads per K/V head), rotary, causal"),
    Family("mistral", dict(sliding_window=512), query_heads_per_kv_head=4, what="GQA, sliding window 512"),
    Family("gemma2", dict(sliding_window=512, query_pre_attn_scalar=128), query_heads_per_kv_head=2,
           what="GQA, soft-cap 50, window 512 on alternate layers"),
    Family("qwen3", {}, query_heads_per_kv_head=4, what="GQA, q/k RMS norms"),
    Family("gpt2", {}, what="causal, scores divided by a tensor, finfo.min mask"),
    Family("gpt_bigcode", dict(multi_query=True), what="MQA"),
    Family("bloom", {}, what="ALiBi added by baddbmm"),
    Family("bert", {}, what="bidirectional, padding mask"),
    Family("t5", {}, attentions_per_layer=3, what="relative position buckets, encoder-decoder"),
    Family("xglm", {}, what="mask added to a [B, H, M, N] view, softmax on [B·H, M, N]"),
    Family(
        "deberta-v2",
        dict(relative_attention=True, pos_att_type=["p2c", "c2p"], position_buckets=256, max_relative_positions=-1,
             norm_rel_ebd="layer_norm", share_att_key=True),
        position_matmuls=True,
        what="DeBERTa-v3: disentangled relative-position bias (two more matmuls, gathered), padding mask",
    ),
]
BY_NAME = {family.name: family for family in FAMILIES}


def _sizes(hidden: int, heads: int, layers: int, head_dim: int) -> dict[str, Any]:
    """The common sizes under each family's own field names (a config takes the ones it has)."""
    return dict(
        hidden_size=hidden, n_embd=hidden, d_model=hidden,
        num_attention_heads=heads, n_head=heads, num_heads=heads, attention_heads=heads,
        num_hidden_layers=layers, n_layer=layers, num_layers=layers, num_decoder_layers=layers,
        intermediate_size=4 * hidden, n_inner=4 * hidden, d_ff=4 * hidden, ffn_dim=4 * hidden,
        head_dim=head_dim, d_kv=head_dim, vocab_size=1024, max_position_embeddings=4096, n_positions=4096,
    )


def _settable(config: Any, key: str) -> bool:
    """A field the config has and takes (Falcon derives ``head_dim``, a property without a setter)."""
    derived = getattr(type(config), key, None)
    return hasattr(config, key) and not (isinstance(derived, property) and derived.fset is None)


def build(
    family: Family, hidden: int, heads: int, layers: int, attn_implementation: str = "eager", **overrides: Any
) -> torch.nn.Module:
    """The family's base model (no LM head) with random weights, in eval mode; ``overrides`` over the family's."""
    import transformers

    base = transformers.AutoConfig.for_model(family.name)
    fields = {**family.overrides, **overrides}
    sizes = _sizes(hidden, heads, layers, hidden // heads)
    if family.query_heads_per_kv_head > 1:
        sizes["num_key_value_heads"] = heads // family.query_heads_per_kv_head
    settings = {key: value for key, value in sizes.items() if _settable(base, key) and key not in fields}
    config = transformers.AutoConfig.for_model(family.name, **settings, **fields)
    return transformers.AutoModel.from_config(config, attn_implementation=attn_implementation).eval()


def forward(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The last hidden state; an encoder-decoder gets the first half of ``ids`` as its decoder input."""
    inputs: dict[str, Any] = dict(input_ids=ids, attention_mask=mask)
    if model.config.is_encoder_decoder:
        inputs["decoder_input_ids"] = ids[:, : ids.shape[1] // 2]
    return model(**inputs).last_hidden_state


def token_inputs(batch: int, length: int, padded: bool, device: Any = "cpu") -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random token ids, and with ``padded`` a mask whose second sequence ends a quarter early (right padding)."""
    ids = torch.randint(3, 1024, (batch, length), device=device)
    if not padded:
        return ids, None
    mask = torch.ones(batch, length, dtype=torch.long, device=device)
    mask[1 % batch, length - length // 4 :] = 0
    return ids, mask
