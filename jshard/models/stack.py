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

from jshard import vma
from jshard.nn.params import gathers_weights, holds_replicas, remat_policy
from jshard.rules import manual_axes

# Adds (and on use removes) `layers` as the first logical name of every stacked Variable.
_LAYERS_METADATA = {nnx.PARTITION_NAME: "layers"}

# Activation checkpointing: what each layer keeps for backward (the rest is recomputed).
#   none       everything (under ZeRO-3: everything but gathered weights, see scan_layers)
#   full       only the layer's input: backward reruns the whole layer
#   selective  the outputs of matmuls without batch dims, i.e. of the linear layers; the
#              attention core (scores, softmax: batched matmuls) is recomputed, as in
#              Megatron's selective recomputation
# Neither `full` nor `selective` saves all-gather outputs, so both include ZeRO-3's
# policy of gathering weights again in backward.
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "selective": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def stack_layers(make_layer: Callable[[nnx.Rngs], nnx.Module], count: int, rngs: nnx.Rngs,
                 remat: str = "none") -> nnx.Module:
    """`count` independently initialised copies of `make_layer(rngs)`, stacked on `layers`.

    `remat` (a key of `REMAT_POLICIES`) is how `scan_layers` checkpoints each layer's
    activations. The stack carries it, so every caller of `scan_layers` (the model, a
    pipeline stage) runs the layers the same way.
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"remat={remat!r}; choose one of {', '.join(REMAT_POLICIES)}")

    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata=_LAYERS_METADATA)
    def make(rngs):
        return make_layer(rngs)

    layers = make(rngs)
    # An unnamed Variable of a layer (a bias, a norm scale) still has the stacked `layers`
    # dim, which pipeline stages split; name that one and leave the rest whole.
    for _, variable in nnx.to_flat_state(nnx.state(layers)):
        if variable.get_metadata().get("out_sharding") is None:
            variable.set_metadata(out_sharding=("layers",) + (None,) * (variable.get_value().ndim - 1))
    layers.remat = remat  # static: part of the graphdef, so it survives nnx.split / merge
    return layers


def stack_remat(model: nnx.Module) -> str | None:
    """The `remat` policy `model`'s layer stack runs with (`stack_layers`); None: it runs no stack
    (`scan_layers`)."""
    return next((node.remat for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)
                 and hasattr(node, "remat")), None)


def layer_call(layers: nnx.Module) -> Callable[[nnx.Module, jax.Array], jax.Array]:
    """What `scan_layers` applies to each layer: its call, rematerialised as the stack's
    `remat` policy says (`stack_layers`); in a step that gathers weights (ZeRO-3) at least
    without its gathered weights: backward gathers them again instead of keeping all
    layers' alive."""

    def apply(layer, x):
        return layer(x)

    policy = REMAT_POLICIES[getattr(layers, "remat", "none")]
    if policy is None and (gathers_weights() or holds_replicas()):
        policy = remat_policy
    if policy is None:
        return apply
    # Run by a scan over the layers, whose loop keeps XLA from merging the recompute with the
    # forward; `prevent_cse`'s barrier would also hide from XLA:GPU's collective pipeliner that
    # a backward trip gathers a slice of the stacked weights (it would not start the gather a
    # trip early, as in the forward loop). A one-layer scan, whose loop XLA removes, keeps it.
    single = jax.tree.leaves(nnx.state(layers))[0].shape[0] == 1
    return nnx.remat(apply, policy=policy, prevent_cse=single)


def scan_stack(layers: nnx.Module, x: jax.Array, body: Callable[..., tuple], *per_layer) -> tuple:
    """`nnx.scan` of `body(x, layer, *slices) -> (x, y)` over the layers of a stack, in order: the
    final x and the ys stacked on a leading dim. Each of `per_layer` (pytrees of arrays with a
    leading layers dim, such as a KV cache) is scanned with the layers, `body` getting its
    slice. The carry is typed as a layer's output."""

    @nnx.scan(in_axes=(nnx.Carry, 0) + (0,) * len(per_layer), out_axes=(nnx.Carry, 0),
              transform_metadata=_LAYERS_METADATA)
    def run(x, layer, *slices):
        return body(x, layer, *slices)

    return run(_as_carry(layer_call(layers), layers, x), layers, *per_layer)


def scan_layers(layers: nnx.Module, x: jax.Array) -> jax.Array:
    """x <- layer(x) for each layer of a stack, in order (`layer_call`)."""
    apply = layer_call(layers)
    return scan_stack(layers, x, lambda x, layer: (apply(layer, x), None))[0]


def _as_carry(apply, layers, x: jax.Array) -> jax.Array:
    """x, typed as varying over every mesh axis a layer's output varies over.

    Inside shard_map a scan carry must keep its type; a layer whose output varies where
    its input did not (an all-gathered activation: varying, though equal on all devices)
    would break that. An abstract pass over the layers finds the output's type.
    """
    if not manual_axes():
        return x

    @nnx.scan(in_axes=(None, 0), out_axes=0, transform_metadata=_LAYERS_METADATA)
    def each(x, layer):
        return apply(layer, x)

    return vma.vary(x, vma.varying_axes(nnx.eval_shape(each, x, layers)))


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
