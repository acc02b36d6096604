"""A model's Variables other than Params inside a step: batch statistics, RNG streams, any other.

The step carries them whole on every device, next to the params, and hands back what the
model wrote to them, so they survive steps and checkpoints like the params do:

- **batch statistics** (`nnx.BatchNorm`): each device sees only its share of the batch, so
  the step sets every BatchNorm's `axis_name` to the batch axes and Flax averages the
  statistics over them (synchronised BatchNorm): the mean and variance of the global batch,
  as on one device.
- **RNG streams** (`nnx.Dropout`'s `nnx.Rngs`): batch shard `i` draws from
  `fold_in(key, i)`, so no two shards drop the same positions, and the draws are the same
  on every run, mesh and strategy with the same batch shards. The key stays the one the
  model was built with; the count advances as on one device. A train state holds keys as
  their key data (`uint32`), which any checkpoint stores.
- **anything else** the model writes must come out alike on every device; a value computed
  from one device's share of the batch would not be, and the step refuses it when traced.
- **arrays that are not Variables** (`nnx.data(jnp.array(...))`, an array attribute in the
  graph): carried the same way, as non-trainable state.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax import lax

from jshard import vma
from jshard.placement import value_of
from jshard.rules import ShardingError


def _path(path) -> str:
    return "/".join(map(str, path))


def _is_key(value) -> bool:
    return jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key)


def _replace(leaf, value):
    return leaf.replace(value) if isinstance(leaf, nnx.Variable) else value


class ModelState:
    """How one model's non-Param Variables travel through a step (built from their State)."""

    def __init__(self, state: nnx.State):
        flat = nnx.to_flat_state(state)
        self.paths = [_path(path) for path, _ in flat]
        # The PRNG implementation of each key leaf (None for other leaves), to rebuild keys from data.
        self.key_impls = [jax.random.key_impl(value_of(v)) if _is_key(value_of(v)) else None for _, v in flat]
        self.specs = self._map(lambda x, impl: jax.P(), state)  # whole on every device

    def __bool__(self) -> bool:
        return bool(self.paths)

    def _map(self, fn, state: nnx.State) -> nnx.State:
        """`fn(value, key impl or None)` on each Variable's value."""
        return nnx.from_flat_state([(path, _replace(v, fn(value_of(v), impl)))
                                    for (path, v), impl in zip(nnx.to_flat_state(state), self.key_impls)])

    def stored(self, state: nnx.State) -> nnx.State:
        """As a train state holds it: keys as their key data."""
        return self._map(lambda x, impl: jax.random.key_data(x) if impl else x, state)

    def loaded(self, state: nnx.State) -> nnx.State:
        """As the model holds it: keys rebuilt from their key data."""
        return self._map(lambda x, impl: jax.random.wrap_key_data(x, impl=impl) if impl else x, state)

    def for_batch_shard(self, stored: nnx.State, batch_axes: tuple[str, ...]) -> nnx.State:
        """The model's state on this device: each key folded with this device's batch shard."""
        if not batch_axes:
            return self.loaded(stored)
        shard = lax.axis_index(batch_axes)

        def fold(x, impl):
            return jax.random.fold_in(*vma.match(jax.random.wrap_key_data(x, impl=impl), shard)) if impl else x

        return self._map(fold, stored)

    def written(self, stored: nnx.State, new: nnx.State) -> nnx.State:
        """What the model wrote, as the train state holds it: keys unchanged (only counts
        advance), every other value checked to be alike on every device."""
        old = [value_of(v) for _, v in nnx.to_flat_state(stored)]
        leaves = []
        for (path, v), impl, before in zip(nnx.to_flat_state(new), self.key_impls, old):
            spread = vma.varying_axes(value_of(v))
            if spread and not impl:
                raise ShardingError(
                    f"model Variable {_path(path)!r} ({type(v).__name__}) came out of the step different on "
                    f"each device of {'+'.join(sorted(spread))}: the model wrote it from this device's share "
                    "of the batch (or of a split param), and the step keeps one value. jshard syncs "
                    "nnx.BatchNorm's statistics itself. Fix: average the value over the batch in the model "
                    "(jax.lax.pmean over the axes a BatchNorm's axis_name gets), or keep it out of the model."
                )
            leaves.append((path, _replace(v, before if impl else value_of(v))))
        return nnx.from_flat_state(leaves)


def sync_batch_norms(model: nnx.Module, batch_axes: tuple[str, ...]) -> None:
    """Make every nnx.BatchNorm average its statistics over the batch axes (a step's model only)."""
    if not batch_axes:
        return
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.BatchNorm):
            module.axis_name = batch_axes


def check_no_pipeline(others: nnx.State, stages) -> None:
    """A pipeline carries params only: refuse a model with other Variables (`others`, abstract or not)."""
    paths = [_path(path) for path, _ in nnx.to_flat_state(others)]
    if paths and stages:
        raise ShardingError(
            f"build_step: the model holds Variables other than Params ({', '.join(paths)}), and the "
            f"rules pipeline its layers over {stages[0]}; a pipeline carries params only. Fix: pick a preset "
            "without a stage axis, or keep batch statistics and RNG streams out of the stacked layers."
        )
