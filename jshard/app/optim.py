"""The optimizer of `jshard train`: AdamW on a warm-up + cosine schedule, gradients clipped
by their global norm. (Gradient accumulation is the step's: `build_step(grad_accum=)`.)

It is a plain `optax.GradientTransformation`, built from optax's parts, with one change
for the explicit step: there the update runs on each device's shard of every gradient
(the ZeRO `opt` layout, or a tensor-parallel split), so `optax.clip_by_global_norm` would
see one shard's norm and clip each device by a different factor. `clip_by_global_norm`
here sums each gradient's squares over the mesh axes it is split on first.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax import lax

from jshard import vma


def global_norm(updates) -> jax.Array:
    """The L2 norm of a tree of gradients, each possibly split over manual mesh axes.

    Inside `shard_map` a gradient varies over exactly the axes it is split on (the step's
    out_specs check that), so a psum of its local sum of squares over those axes is its
    whole sum of squares; outside `shard_map` this is `optax.tree.norm`.
    """

    def squares(g):
        local = jnp.sum(jnp.square(g.astype(jnp.float32)))
        axes = tuple(sorted(vma.varying_axes(local)))
        return lax.psum(local, axes) if axes else local

    return jnp.sqrt(sum(squares(g) for g in jax.tree.leaves(updates)))


class ClipState(NamedTuple):
    norm: jax.Array  # the last update's gradients' global norm, before clipping: the run reports it


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """`optax.clip_by_global_norm`, with the norm taken over every shard (`global_norm`) and
    kept in its state, where `jshard train` reads it (`grad_norm`) with no computation of its own."""

    def init(params):
        del params
        return ClipState(jnp.zeros((), jnp.float32))

    def update(updates, state, params=None):
        del params, state
        norm = global_norm(updates)
        return optax.tree.scale(jnp.minimum(1.0, max_norm / norm), updates), ClipState(norm)

    return optax.GradientTransformation(init, update)


def grad_norm(opt_state) -> jax.Array | None:
    """The global gradient norm of the last optimizer step (`ClipState`), if the optimizer keeps it."""
    for state in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, ClipState)):
        if isinstance(state, ClipState):
            return state.norm
    return None


class SkipState(NamedTuple):
    inner: Any  # the wrapped optimizer's state, as the last applied update left it
    skipped: jax.Array  # updates not applied in a row, their gradients not finite (0 after one that was)


def skip_nonfinite(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """`inner`, but an update whose gradients are not finite is not applied: zero updates, the
    inner state unchanged, `SkipState.skipped` counting them in a row. The test is the global
    norm (`global_norm`, or the one a `clip_by_global_norm` in `inner` keeps), the same on every
    shard, so all devices skip alike (optax's `apply_if_finite` tests each shard alone); what to
    do about a skip, the caller decides (`jshard train`: stop, or go on for `--skip-nonfinite N`
    in a row, as Megatron does)."""

    def init(params):
        return SkipState(inner.init(params), jnp.zeros((), jnp.int32))

    def update(updates, state, params=None):
        applied, after = inner.update(updates, state.inner, params)
        norm = grad_norm(after)  # a clip inside `inner` took it already (derived once; XLA merged the two anyway)
        finite = jnp.isfinite(global_norm(updates) if norm is None else norm)
        kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old), after, state.inner)
        applied = jax.tree.map(lambda u: jnp.where(finite, u, jnp.zeros_like(u)), applied)
        return applied, SkipState(kept, jnp.where(finite, 0, state.skipped + 1))

    return optax.GradientTransformation(init, update)


def skipped(opt_state) -> jax.Array | None:
    """Updates not applied in a row, their gradients not finite (`SkipState`), if the optimizer counts them."""
    return opt_state.skipped if isinstance(opt_state, SkipState) else None


def _decayed(params):
    """Weight decay on matrices only (kernels, embedding tables), not on norms' vectors.

    A stacked vector is still a vector: the `layers` dim does not count.
    """

    def is_matrix(v):
        names = v.get_metadata().get("out_sharding") if isinstance(v, nnx.Variable) else None
        dims = [n for n in names if n != "layers"] if names is not None else jnp.shape(v)
        return len(dims) >= 2

    return jax.tree.map(is_matrix, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def schedule(lr: float, steps: int, warmup: int) -> optax.Schedule:
    """Linear warm-up from 0 over `warmup` steps, then cosine decay to lr/10 at `steps`."""
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), lr / 10)


def adamw(learning_rate: optax.Schedule, *, weight_decay: float = 0.1, clip: float = 1.0,
          b2: float = 0.95) -> optax.GradientTransformation:
    """Clip, then AdamW on `learning_rate` (`schedule`: the same one `jshard train` logs), an
    update of non-finite gradients not applied (`skip_nonfinite`)."""
    return skip_nonfinite(optax.chain(
        clip_by_global_norm(clip),
        optax.adamw(learning_rate, b2=b2, weight_decay=weight_decay, mask=_decayed),
    ))
