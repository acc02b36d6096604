"""Layers stacked on a leading `layers` axis and run with `nnx.scan`.

One stacked module instead of a Python list of L modules: compile time stays flat as depth
grows, and the `layers` dim of every stacked param is what pipeline stages split.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jshard import nn

# Adds (and on use removes) `layers` as the first logical name of every stacked Variable.
_LAYERS_METADATA = {nnx.PARTITION_NAME: "layers"}


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs) -> nnx.Module:
    """`count` independently initialised copies of `make_layer(rngs)`, stacked on `layers`."""

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=_LAYERS_METADATA)
    def make(rngs):
        return make_layer(rngs)

    return make(rngs)


def scan_layers(layers: nnx.Module, x: jax.Array) -> jax.Array:
    """x <- layer(x) for each layer of a stack, in order.

    In a step that gathers weights (ZeRO-3) each layer is rematerialised without its
    gathered weights: backward gathers them again instead of keeping all layers' alive.
    """

    def apply(layer, x):
        return layer(x)

    if nn.gathers_weights():
        apply = nnx.remat(apply, policy=nn.remat_policy)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=_LAYERS_METADATA)
    def run(x, layer):
        return apply(layer, x)

    return run(_as_carry(apply, layers, x), layers)


def _as_carry(apply, layers, x: jax.Array) -> jax.Array:
    """x, typed as varying over every mesh axis a layer's output varies over.

    Inside shard_map a scan carry must keep its type; a layer whose output varies where
    its input did not (an all-gathered activation: varying, though equal on all devices)
    would break that. An abstract pass over the layers finds the output's type.
    """
    if not nn.manual_axes():
        return x

    @nnx.scan(in_axes=(None, 0), out_axes=0, transform_metadata=_LAYERS_METADATA)
    def each(x, layer):
        return apply(layer, x)

    missing = nn.varying_axes(nnx.eval_shape(each, x, layers)) - nn.varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x


@dataclasses.dataclass(frozen=True)
class StagedLoss:
    """A loss split around a model's stack of layers, so that a pipeline can cut it:

        loss(model, batch) = last(model, scan_layers(layers(model), first(model, batch)), batch)

    `first` runs on the first pipeline stage (embeddings), `last` on the last (head and
    loss); the stacked layers in between are split over the stages. Called directly it
    is the ordinary, unpipelined loss.
    """

    first: Callable[[nnx.Module, Any], jax.Array]
    layers: Callable[[nnx.Module], nnx.Module]
    last: Callable[[nnx.Module, jax.Array, Any], jax.Array]

    def __call__(self, model: nnx.Module, batch) -> jax.Array:
        return self.last(model, scan_layers(self.layers(model), self.first(model, batch)), batch)
