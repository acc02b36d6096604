"""Layers stacked on a leading `layers` axis and run with `nnx.scan`.

One stacked module instead of a Python list of L modules: compile time stays flat as depth
grows, and the `layers` dim of every stacked param is what pipeline stages split.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

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
    """x <- layer(x) for each layer of a stack, in order."""

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata=_LAYERS_METADATA)
    def run(x, layer):
        return layer(x)

    return run(x, layers)
