"""Layers that know the logical names of their inputs, weights and outputs.

A layer never names a mesh axis. It knows, say, that it maps (batch, seq, embed) to
(batch, seq, mlp) with a weight (embed, mlp), and asks the active rules where each name
lives. From that alone follow the collectives of every strategy (the scaling book's
sharded-matmul cases):

- a weight dim on a ZeRO axis (`fsdp`): all-gather the weight before use (`param`); its
  autodiff transpose is the gradient's reduce-scatter, and under ZeRO-3 the gathered
  weight is not kept for backward but gathered again (see `remat_policy`);
- an input dim laid out differently from what the output wants (sequence parallel's
  seq): all-gather it before the matmul;
- a contracting dim split over an axis (row-parallel): the product is a partial sum,
  reduced by `psum`, or by `psum_scatter` where the output wants that axis on a dim
  (sequence parallel);
- an output dim split like the weight's (column-parallel): no communication;
- an axis that should split another dim of an activation than it does (a mixture of
  experts' buffer, from its rows to its experts: `jshard.moe`): an all-to-all.

Outside a jshard step these are plain Flax layers: the same model runs on one device, or
under `jax.jit` with the compiler placing collectives (`jshard.constrain`).

One module per idea, lower first (none imports a higher one, nor anything above `jshard.nn`):

- `model_shardings.py`: a model's own sharding requests in JAX's API (`out_sharding=`,
  `reshard`, `with_sharding_constraint` over its author's mesh axes), met inside a step;
- `step.py`: the step context (`StepContext`, `step_context`, `in_step`), what a step's
  trace carries for the layers besides the rules;
- `layouts.py`: layout algebra (`Layout`, `layout`, `relayout_local`, `relayout`); layouts
  are specs as tuples, one tuple of mesh axes per dim: `((data, fsdp), (), (tensor,))`;
- `params.py`: the step's split-param protocol (`LocalBlock`, `ShardWithReplica`, `param`,
  `remat_policy`, `gathers_weights`, `holds_replicas`);
- `softmax.py`: attention's softmax, keeping only its output for backward (`probabilities`);
- `context.py`: context parallelism (`split_input`, `positions`, `ring_attention`,
  `gathered_kv_attention`, `all_to_all_attention`, `balanced_order`);
- `layers.py`: `matmul`, `Linear`, `Embed`, `LayerNorm`, `RMSNorm`, and the elementwise work
  between them recomputed in backward (`recomputed`, `gelu`, `swiglu`);
- `attn.py`: the kernel choice (`attention_implementation`, `attention`, `xla_attention`) and the KV
  cache (`KVCache`, `cached_attention`);
- `losses.py`: `cross_entropy`, a padded vocabulary kept out of the logits
  (`padded_vocab`, `without_padded_vocab`) and the losses a layer adds (`with_loss_gradient`,
  `scaled_losses`).
"""

from jshard.nn.attn import ATTENTION, KVCache, attention, attention_implementation, cached_attention, xla_attention
from jshard.nn.context_parallel import (
    QUERY_TILE,
    balanced_order,
    check_context_length,
    context_attention,
    context_axes,
    gathered_kv_attention,
    input_layout,
    laid_out_input,
    positions,
    query_tile,
    ring_attention,
    split_input,
)
from jshard.nn.layers import Embed, LayerNorm, Linear, RMSNorm, gelu, matmul, recomputed, swiglu
from jshard.nn.layouts import Layout, layout, relayout, relayout_local
from jshard.nn.losses import PAD_LOGIT, cross_entropy, padded_vocab, scaled_losses, with_loss_gradient, without_padded_vocab
from jshard.nn.params import (
    LocalBlock,
    ShardWithReplica,
    gathered_layout,
    gathers_weights,
    holds_replicas,
    param,
    remat_policy,
)
from jshard.nn.step_context import StepContext, compute_dtype, current_step, in_step, step_context
from jshard.rules import manual_axes  # as `nn.manual_axes`, which callers read from here

__all__ = [
    "ATTENTION", "PAD_LOGIT", "Embed", "KVCache", "LayerNorm", "Layout", "Linear", "LocalBlock", "QUERY_TILE", "RMSNorm",
    "ShardWithReplica", "StepContext", "attention", "attention_implementation", "balanced_order",
    "cached_attention", "check_context_length", "compute_dtype", "context_attention", "context_axes", "cross_entropy",
    "current_step", "gathered_kv_attention", "gathered_layout", "gathers_weights", "gelu", "holds_replicas",
    "in_step", "input_layout", "laid_out_input", "layout", "manual_axes", "matmul", "padded_vocab", "param", "positions",
    "query_tile", "recomputed", "relayout", "relayout_local", "remat_policy", "ring_attention", "scaled_losses",
    "split_input", "step_context", "swiglu", "with_loss_gradient", "without_padded_vocab", "xla_attention",
]
