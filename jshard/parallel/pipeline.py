"""GPipe inside the step: the stacked layers split over a stage axis, the batch into micro-batches.

Inside `shard_map` every device runs the same program. Each tick, every stage runs its
own share of the layers (L/p of them) on the activation it holds, then passes the result
to the next stage with one `ppermute`; stage 0 takes a fresh micro-batch instead. After
m + p − 1 ticks the last stage has seen every micro-batch. Differentiating through the
ticks gives GPipe's backward: the transposed `ppermute`s carry gradients back stage by
stage, and every micro-batch's activations stay alive until then (m in flight).

The loss must be a `StagedLoss`, which says where the stack of layers begins and ends.
Its `first` part (embeddings) and `last` part (head and loss) have replicated params and
run on every stage; only stage 0's inputs and the last stage's losses are used. That keeps
one program for all devices, at the cost of computing `first` and `last` p times.
The other schedules (1F1B, interleaved, zero-bubble) are tick tables in `schedules.py`;
their executor is not built yet.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jshard.models.stack import StagedLoss, scan_layers


def gpipe_loss(loss: StagedLoss, model: nnx.Module, batch, stage_axis: str, microbatches: int) -> jax.Array:
    """Mean loss over this device's batch, pipelined over `stage_axis` in `microbatches`."""
    stages, stage = lax.axis_size(stage_axis), lax.axis_index(stage_axis)
    stacked = jax.tree.map(lambda a: a.reshape(microbatches, a.shape[0] // microbatches, *a.shape[1:]), batch)
    micro = [jax.tree.map(lambda a: a[i], stacked) for i in range(microbatches)]
    inputs = [loss.first(model, mb) for mb in micro]
    layers = loss.layers(model)
    forward = [(i, i + 1) for i in range(stages - 1)]  # stage i -> i + 1; stage 0 receives zeros

    held, outputs = jnp.zeros_like(inputs[0]), []
    for tick in range(microbatches + stages - 1):
        fresh = inputs[tick] if tick < microbatches else jnp.zeros_like(inputs[0])
        out = scan_layers(layers, jnp.where(stage == 0, fresh, held))
        if tick >= stages - 1:  # on the last stage: micro-batch tick - (p - 1)
            outputs.append(out)
        held = lax.ppermute(out, stage_axis, forward)
    losses = jnp.stack([loss.last(model, y, mb) for y, mb in zip(outputs, micro)])
    return lax.psum(jnp.where(stage == stages - 1, losses.mean(), 0.0), stage_axis)
