"""What the planner counts of a decoder's config, beyond its sizes: quantities no model code
reads, so they live beside their readers (the planner's formulas) rather than on the configs.
"""

from __future__ import annotations

from jshard.models import DecoderConfig, LlamaConfig
from jshard.moe import capacity


def input_projections(config: DecoderConfig, combined: bool = False) -> int:
    """The reductions of a block's input gradients under TP (`communication.tensor_traffic`): XLA:CPU
    reduces each column-parallel linear's own (a GPT's qkv and up: 2; a Llama's q, kv and
    gate_up: 3); XLA:GPU (`combined`) sums those of linears reading the same normed input first,
    one reduction per input (attention's and the MLP's: 2)."""
    return 2 if combined or not isinstance(config, LlamaConfig) else 3


def column_outputs(config: DecoderConfig) -> int:
    """Width per token of the column-parallel linears' outputs, split under TP: a GPT's qkv and
    up (3·embed + mlp); a Llama's q, k, v, gate and up (embed + 2·kv_heads·head_dim + 2·mlp)."""
    if isinstance(config, LlamaConfig):
        return config.embed + 2 * config.kv_heads * config.head_dim + 2 * config.mlp
    return 3 * config.embed + config.mlp


def attention_widths(config: DecoderConfig) -> int:
    """Width per token of attention's projections, split under TP: q, k, v and the attention
    output (a GPT's 4·embed; a Llama's 2·embed + 2·kv_heads·head_dim)."""
    if isinstance(config, LlamaConfig):
        return 2 * config.embed + 2 * config.kv_heads * config.head_dim
    return 4 * config.embed


def mlp_widths(config: DecoderConfig) -> int:
    """Width per token of the MLP's hidden values that its backward reads, split under TP: the
    up projection's outputs and the activation's (a GPT's up and GELU, 2·mlp; a Llama's gate,
    up and their product, 3·mlp)."""
    return (3 if isinstance(config, LlamaConfig) else 2) * config.mlp


def fp8_cast_widths(config: DecoderConfig) -> int:
    """Width per token of what a block's FP8 products cast (`nn.fp8`): each projection's input
    forward and its output's gradient backward (a GPT's qkv, out, up, down: 3·embed + mlp in,
    5·embed + mlp out; a Llama's q, kv, out, gate_up, down: 4·embed + mlp in, 3·embed +
    2·kv_heads·head_dim + 2·mlp out)."""
    if isinstance(config, LlamaConfig):
        return 7 * config.embed + 2 * config.kv_heads * config.head_dim + 3 * config.mlp
    return 8 * config.embed + 2 * config.mlp


def is_moe(config: DecoderConfig) -> bool:
    return bool(getattr(config, "experts", 0))


def slots_per_token(config: DecoderConfig) -> float:
    """A MoE layer's dispatch buffer slots per token, E · C / seq (C = `moe.capacity` of a whole
    row): what the experts compute, filled or not (about capacity factor × top_k; E when dropless)."""
    return config.experts * capacity(config.seq_len, config.experts, config.top_k, config.capacity_factor) / config.seq_len
