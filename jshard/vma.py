"""Over which mesh axes a value may differ between devices, and the casts that make types agree.

Inside `jax.shard_map(..., check_vma=True)` every value's type carries its *vma*: the manual
mesh axes over which it may differ from device to device (a batch shard varies over `data`;
a replicated weight varies over nothing). An operation on values of different vma, or a
collective over an axis its input does not vary over, needs the invariant side cast to
varying first (`lax.pcast(x, axes, to="varying")`, no communication). JAX inserts those casts
itself while `jax_auto_pcast` is on, its default through 0.12, which JAX plans to turn off;
jshard casts explicitly, with these, so that it computes the same under either setting
(the suite runs with it off: docs/versions.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes over which `x` may differ between devices (its vma)."""
    return aval_axes(jax.typeof(x))


def aval_axes(aval) -> frozenset[str]:
    """The vma of an abstract value (a jaxpr variable's `aval`, `jax.typeof(x)`)."""
    manual = getattr(aval, "manual_axis_type", None)  # JAX >= 0.10; earlier: aval.vma
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def vary(x, axes):
    """`x` typed as varying over `axes` too (those it does not vary over already are cast)."""
    missing = tuple(sorted(set(axes) - varying_axes(x)))
    return lax.pcast(x, missing, to="varying") if missing else x


def match(*xs):
    """Each of `xs` typed as varying over every axis any of them varies over."""
    axes = frozenset().union(*map(varying_axes, xs))
    return tuple(vary(x, axes) for x in xs)


def where(condition, x, y):
    """`jnp.where` on operands whose vma may differ (a per-rank mask over a shared value)."""
    return jnp.where(*match(jnp.asarray(condition), jnp.asarray(x), jnp.asarray(y)))


def zeros_like(x):
    """Zeros of x's shape, dtype and vma (`jnp.zeros_like` types them invariant)."""
    return vary(jnp.zeros_like(x), varying_axes(x))
