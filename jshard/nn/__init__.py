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

- `model_shardings.py`: a model's own sharding requests in JAX's API, met inside a step;
- `step_context.py`: what a step's trace carries for the layers (`StepContext`, `step_context`,
  `in_step`, `compute_dtype`);
- `layouts.py`: layout algebra (`Layout`, `layout`, `relayout_local`, `relayout`): a spec as a
  tuple of mesh axes per dim, `((data, fsdp), (), (tensor,))`;
- `params.py`: the step's split-param protocol (`LocalBlock`, `ShardWithReplica`, `param`,
  `remat_policy`, `gathers_weights`, `holds_replicas`);
- `softmax.py`, `collective_matmul.py`, `fp8.py`: attention's softmax, the overlapped
  gather/scatter matmuls, FP8 projections;
- `context_parallel.py`: context parallelism (`split_input`, `positions`, `ring_attention`,
  `gathered_kv_attention`, `balanced_order`, `block_kernel`, `QUERY_TILE`);
- `flash.py`: jshard's flash-attention kernel in Pallas (`flash_forward`, `flash_backward` under
  given statistics, `flash_attention`), Triton on a GPU, for the ring's and gathered keys' blocks;
- `layers.py`: `matmul`, `Linear`, `Embed`, `LayerNorm`, `RMSNorm`, `recomputed`, `gelu`, `swiglu`;
- `attn.py`: the kernel choice (`ATTENTION`, `attention_implementation`, `attention`,
  `xla_attention`) and the KV cache (`KVCache`, `cached_attention`);
- `losses.py`: `cross_entropy`, a padded vocabulary (`padded_vocab`, `without_padded_vocab`,
  `PAD_LOGIT`), the losses a layer adds (`with_loss_gradient`, `scaled_losses`).

This package exports what a model's author writes (layers, and `param` + `matmul` for a layer of
one's own); the step's machinery and the kernel choice are imported from their modules
(`from jshard.nn.params import LocalBlock`, `from jshard.nn.attn import ATTENTION`).
"""

from jshard.nn.attn import KVCache, attention, cached_attention
from jshard.nn.context_parallel import positions
from jshard.nn.layers import Embed, LayerNorm, Linear, RMSNorm, gelu, matmul, recomputed, swiglu
from jshard.nn.layouts import relayout
from jshard.nn.losses import cross_entropy, padded_vocab, scaled_losses, with_loss_gradient, without_padded_vocab
from jshard.nn.params import param
from jshard.nn.step_context import compute_dtype

__all__ = [
    "Embed", "KVCache", "LayerNorm", "Linear", "RMSNorm", "attention", "cached_attention", "compute_dtype",
    "cross_entropy", "gelu", "matmul", "padded_vocab", "param", "positions", "recomputed", "relayout",
    "scaled_losses", "swiglu", "with_loss_gradient", "without_padded_vocab",
]
