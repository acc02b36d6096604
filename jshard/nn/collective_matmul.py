"""Collective matmuls: sequence parallelism's gather before a column-parallel matmul and its
reduce-scatter after a row-parallel one, each as n - 1 `ppermute` steps round the axis with a
partial matmul beside every step (Wang et al. 2023, "Overlap communication with dependent
computation via decomposition"; the collective matmul of JAX's shard_map docs).

They move the bytes of the collective they replace ((n - 1) / n of the gathered block, as
permutes); what changes is that no matmul waits for the whole block: each step's transfer can
run beside a block's matmul. Each is a custom VJP whose backward is the other ring: a
gather-matmul reduces its input gradient round the ring (and computes its weight gradient from
the blocks it kept), a matmul-scatter gathers its output gradient round it. `matmul` (layers.py)
takes them where the rules ask (`Rules.collective_matmul`) and the layouts are a gather, or a
reduce-scatter, of one axis along one leading dim.

In a reduce ring an optimization barrier ties each step's transfer to its matmul and orders the
matmuls, which XLA:GPU would otherwise merge, all of one weight, into one matmul that waits for
every transfer (its dot merger; seen in the compiled H100 program; `Plan.xla_options` also turns
that pass off for such programs). A forward gather ring has none, so that the linears reading
one input (q, k and v) share one ring: XLA merges identical permutes, not ones behind barriers.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jshard import vma
from jshard.nn.layouts import Layout


def ring_step(src: Layout, dst: Layout, dims: range) -> tuple[int, str] | None:
    """(dim, axis) where `dst` is `src` with one more axis, `axis`, splitting one of `dims`
    and every other dim alike: `src` -> `dst` is a scatter of that dim over `axis`, and
    `dst` -> `src` a gather. None if the layouts differ in any other way."""
    changed = [d for d, (a, b) in enumerate(zip(src, dst)) if tuple(a) != tuple(b)]
    if len(changed) != 1 or changed[0] not in dims:
        return None
    d = changed[0]
    a, b = tuple(src[d]), tuple(dst[d])
    return (d, b[-1]) if b[:-1] == a else None


def _ring(axis: str) -> tuple[int, jax.Array, list[tuple[int, int]]]:
    n = lax.axis_size(axis)
    return n, lax.axis_index(axis), [(i, (i + 1) % n) for i in range(n)]


def _gather_ring(block: jax.Array, axis: str, matmul, ordered: bool) -> list[tuple[jax.Array, jax.Array]]:
    """[(where, matmul(b, where)) for each block b of the ring]: at step s this device holds the
    block of device i - s (`where`: that index) and passes it on to device i + 1. `ordered`: each
    transfer tied to this step's matmul by a barrier (see the module docstring)."""
    n, i, perm = _ring(axis)
    parts = []
    for s in range(n):
        part = matmul(block, (i - s) % n)
        if s < n - 1:
            sent = lax.ppermute(block, axis, perm)
            part, block = lax.optimization_barrier((part, sent)) if ordered else (part, sent)
        parts.append(((i - s) % n, part))
    return parts


def _reduce_ring(x: jax.Array, dim: int, axis: str, matmul) -> jax.Array:
    """The sum over the ring's devices of `matmul(this device's x's block i)`, block i along
    `dim`: the partial sum of block c starts on device c + 1 and gathers each device's share on
    its way round, ending on device c; at step s this device adds its share of block i - s - 1."""
    n, i, perm = _ring(axis)
    size = x.shape[dim] // n
    total = None
    for s in range(n):
        part = matmul(lax.dynamic_slice_in_dim(x, ((i - s - 1) % n) * size, size, axis=dim))
        if total is None:
            total = part
        else:  # the sum so far in transfer beside this share's matmul; the next matmul after both
            received, part, x = lax.optimization_barrier((lax.ppermute(total, axis, perm), part, x))
            total = received + part
    return total


def _placed(parts, dim: int) -> jax.Array:
    """The ring's parts, each at its block's place along `dim`."""
    first = parts[0][1]
    size = first.shape[dim]
    out = vma.match(jnp.zeros(first.shape[:dim] + (len(parts) * size,) + first.shape[dim + 1:], first.dtype), first)[0]
    for where, part in parts:
        out = lax.dynamic_update_slice_in_dim(out, part, where * size, axis=dim)
    return out


def _dot(dims):
    return lambda a, b: lax.dot_general(a, b, dims)


def _transposes(dims, like_x, w):
    """The matmul's input gradient for an output gradient's block (linear in it; `like_x` gives
    its shape), and its weight gradient for an (input block, output gradient block) pair."""
    to_x = lambda dy: jax.vjp(lambda b: _dot(dims)(b, w), like_x)[1](dy)[0]  # noqa: E731
    to_w = lambda xb, dy: jax.vjp(lambda v: _dot(dims)(xb, v), w)[1](dy)[0]  # noqa: E731
    return to_x, to_w


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def gather_matmul(x: jax.Array, w: jax.Array, dims, dim: int, axis: str) -> jax.Array:
    """`dot_general(all_gather(x, axis, axis=dim, tiled=True), w, dims)`, with `dim` a leading
    (free) dim of x that keeps its place in the result: the gather ring, a block's matmul beside
    each transfer."""
    return _placed(_gather_ring(x, axis, lambda b, _: _dot(dims)(b, w), ordered=False), dim)


def _gather_matmul_fwd(x, w, dims, dim, axis):
    blocks = _gather_ring(x, axis, lambda b, _: (b, _dot(dims)(b, w)), ordered=False)
    return _placed([(where, y) for where, (_, y) in blocks], dim), ([(where, b) for where, (b, _) in blocks], w)


def _gather_matmul_bwd(dims, dim, axis, kept, dy):
    blocks, w = kept
    to_x, to_w = _transposes(dims, blocks[0][1], w)
    size = blocks[0][1].shape[dim]
    dw = sum(to_w(b, lax.dynamic_slice_in_dim(dy, where * size, size, axis=dim)) for where, b in blocks)
    return _reduce_ring(dy, dim, axis, to_x), dw


gather_matmul.defvjp(_gather_matmul_fwd, _gather_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def matmul_scatter(x: jax.Array, w: jax.Array, dims, dim: int, axis: str) -> jax.Array:
    """`psum_scatter(dot_general(x, w, dims), axis, scatter_dimension=dim, tiled=True)`, with
    `dim` a leading (free) dim of x that keeps its place in the result: the reduce ring, a share's
    matmul beside each transfer."""
    return _reduce_ring(x, dim, axis, lambda chunk: _dot(dims)(chunk, w))


def _matmul_scatter_fwd(x, w, dims, dim, axis):
    return _reduce_ring(x, dim, axis, lambda chunk: _dot(dims)(chunk, w)), (x, w)


def _matmul_scatter_bwd(dims, dim, axis, kept, dy):
    x, w = kept
    size = dy.shape[dim]
    to_x, to_w = _transposes(dims, lax.slice_in_dim(x, 0, size, axis=dim), w)
    parts = _gather_ring(dy, axis, lambda b, where: (to_x(b), to_w(lax.dynamic_slice_in_dim(
        x, where * size, size, axis=dim), b)), ordered=True)
    return _placed([(where, dxb) for where, (dxb, _) in parts], dim), sum(dwb for _, (_, dwb) in parts)


matmul_scatter.defvjp(_matmul_scatter_fwd, _matmul_scatter_bwd)
