"""Layout algebra: where the rules put each dim of a tensor, and moving a local block from
one layout to another with the fewest collectives.

Layouts are specs as tuples, one tuple of mesh axes per dim: `((data, fsdp), (), (tensor,))`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax import lax

from jshard import vma
from jshard.nn.step_context import in_step
from jshard.rules import ShardingError, active_rules, constrain, layout_of

Layout = tuple[tuple[str, ...], ...]


def layout(names: Sequence[str | None], kind: str = "activation") -> Layout:
    """Where the active rules put each dim of a tensor called `names`, inside a step."""
    spec = active_rules().spec(tuple(names), None, jax.sharding.get_abstract_mesh(), kind)
    return layout_of(spec)


def relayout_local(x: jax.Array, src: Layout, dst: Layout, partial: Sequence[str] = (), invariant: bool = False) -> jax.Array:
    """Move a local block from layout `src` to `dst` with the fewest collectives.

    `partial` are mesh axes over which `x` is a partial sum: each is reduced with
    `psum_scatter` onto the dim where `dst` wants it, or with `psum` if `dst` wants it
    nowhere. A dim whose axes change is all-gathered (axes `src` has, `dst` lacks) and
    then sliced locally (axes `dst` has, `src` lacks; slicing moves nothing).

    A gathered block is typed varying over the gathered axes, so that its transpose is
    a reduce-scatter; `invariant=True` types it replicated instead, for values that are
    not differentiated (updated params).
    """
    src = [tuple(a) for a in src]
    summed = []
    for axis in partial:  # reduce-scatters first: the all-reduces then move smaller blocks
        dims = [d for d, axes in enumerate(dst) if axis in axes and axis not in src[d]]
        if dims and src[dims[0]] + (axis,) == tuple(dst[dims[0]]):
            _check_splits(x, dims[0], (axis,))
            x = lax.psum_scatter(x, axis, scatter_dimension=dims[0], tiled=True)
            src[dims[0]] = src[dims[0]] + (axis,)
        else:
            summed.append(axis)
    if summed:
        x = lax.psum(x, tuple(summed))
    for a, b in _moves(src, dst):  # an axis leaving dim a for dim b: each device sends the others their parts
        axis = src[a][-1]
        x = lax.all_to_all(vma.vary(x, (axis,)), axis, split_axis=b, concat_axis=a, tiled=True)
        src[a], src[b] = src[a][:-1], src[b] + (axis,)
    for dim, (have, want) in enumerate(zip(src, dst)):
        want = tuple(want)
        if have == want:
            continue
        keep = 0  # the leading axes both share stay split; the rest is gathered
        while keep < min(len(have), len(want)) and have[keep] == want[keep]:
            keep += 1
        if have[keep:]:
            x = lax.all_gather(x, have[keep:], axis=dim, tiled=True, to="invarying" if invariant else "varying")
        if want[keep:]:
            _check_splits(x, dim, want[keep:])
            n = lax.axis_size(want[keep:])
            size = x.shape[dim] // n
            # Each device keeps its own slice: varying over those axes, even if x was alike.
            x = vma.vary(x, want[keep:])
            x = lax.dynamic_slice_in_dim(x, lax.axis_index(want[keep:]) * size, size, axis=dim)
    return x


def _check_splits(x: jax.Array, dim: int, axes: tuple[str, ...]) -> None:
    """One error, not XLA's (or, for a slice, tokens silently dropped), where a dim is to be split
    over mesh axes whose size does not divide it."""
    n = lax.axis_size(axes)
    if x.shape[dim] % n:
        raise ShardingError(
            f"an activation of shape {tuple(x.shape)} splits its dim {dim} (size {x.shape[dim]}) over {'×'.join(axes)} = "
            f"{n}, which does not divide it. Fix: make that dim a multiple of {n} (under sequence parallelism dim 1 is "
            f"the sequence: a sequence length that is a multiple of {n}), or change the mesh.")


def _moves(src, dst) -> list[tuple[int, int]]:
    """(a, b) for each axis that is the innermost split of dim a in `src` and should be that of
    dim b in `dst`, all else on both dims equal: an all-to-all moves it ((n-1)/n of the block
    leaves each device) where a gather and a slice would move n-1 times the block."""
    return [(a, b) for a, have in enumerate(src) if have for b, want in enumerate(dst)
            if b != a and tuple(dst[a]) == have[:-1] and tuple(want) == tuple(src[b]) + (have[-1],)]


def relayout(x: jax.Array, src_names, dst_names, partial: Sequence[str] = ()) -> jax.Array:
    """x, laid out as the rules place `src_names`, laid out as they place `dst_names`.

    Inside a step this is explicit collectives (`relayout_local`); outside, a sharding
    constraint to `dst_names` for the compiler.
    """
    if not in_step():
        return constrain(x, dst_names)
    return relayout_local(x, layout(src_names), layout(dst_names), partial)
