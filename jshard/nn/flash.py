"""Flash attention as jshard's own Pallas kernel, with the statistics a ring needs.

cuDNN's fused kernel (`jax.nn.dot_product_attention`) returns no usable log-sum-exp and its
backward cannot be given merged statistics (docs/strategies.md), so attention split over
blocks (context parallelism's ring and all-gathered keys) runs this one instead on a GPU:

- `flash_forward`: a block's output and each query's log-sum-exp, the keys taken a tile at a
  time with the online softmax, the scores never written to HBM;
- `flash_backward`: dq, dk, dv of a block under *given* statistics (the log-sum-exp and
  delta = rowsum(dO · O) of the rows over every block), FlashAttention-2's backward;
- `flash_attention`: the two as one differentiable causal attention (`--attention pallas`).

Masking is by position: query i sees key j where `q_pos[i] >= k_pos[j]` (`positions`; None:
every key), so one kernel serves causal attention, a ring's blocks and the all-gathered keys
of a load-balanced order; a tile of keys no query of the tile sees is skipped. Every query
must see at least one key. Grouped-query heads read their KV head in place (index maps).

Pallas lowers the kernels through Triton on a GPU (a deviceless GPU compile included); on a
CPU they run in Pallas's interpreter, slowly: for checking them against XLA's attention.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jshard import vma
from jshard.nn.step_context import compiled_for

# Tiles (queries, keys): the forward keeps a 128-query tile's accumulator in registers while
# 64 keys at a time stream past; the backward's dq and dk/dv kernels use 64 x 64 tiles. As the
# Triton tutorial's and Pallas's GPU kernel's defaults for head dims up to 128 (not tuned here:
# no GPU lent).
FORWARD_TILES = (128, 64)
BACKWARD_TILES = (64, 64)
# Masked scores: finite, so a tile whose rows are all masked so far gives exp(0), wiped out by
# the correction when the row's first visible key arrives (exp(MASKED - real) = 0).
MASKED = -0.7 * float(np.finfo(np.float32).max)
HEAD_DIMS = (16, 32, 64, 128, 256)


def check_pallas(head_dim: int, platform: str) -> None:
    """Where a step may run the kernel: on a GPU (a deviceless GPU compile's included), with a
    power-of-two head dim of 16-256 (Triton's dots). Pallas's interpreter, which runs the
    kernels on a CPU, loses their outputs' types inside a step's shard_map (JAX 0.10-0.12: its
    loops mix varying and invariant values), so a CPU step cannot."""
    if platform != "gpu":
        raise ValueError(f"attention 'pallas' is jshard's Triton kernel, for a GPU; here: {platform}. "
                         "Fix: attention 'auto' or 'xla' (or compile for a GPU target).")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"attention 'pallas' needs a head dim of {', '.join(map(str, HEAD_DIMS))}; here {head_dim}. "
                         "Fix: attention 'auto' or 'xla'.")


def untiled(*lengths: int) -> tuple[int, int] | None:
    """The first (length, tile) where a tile of the kernel's does not divide a sequence length
    longer than it (shorter: one tile), or None where every length is tiled."""
    for length in lengths:
        for tile in sorted(set(FORWARD_TILES + BACKWARD_TILES), reverse=True):
            if length > tile and length % tile:
                return length, tile
    return None


def check_flash(head_dim: int, *lengths: int) -> None:
    """The shapes the kernel takes: sequences (queries', keys') that its tiles divide, and on a
    GPU a head dim that `check_pallas` allows (Pallas's interpreter takes any)."""
    if compiled_for() == "gpu":
        check_pallas(head_dim, "gpu")
    if bad := untiled(*lengths):
        raise ValueError(f"attention 'pallas' cuts {bad[0]} tokens into tiles of {bad[1]}. Fix: a sequence (per "
                         f"device under context parallelism, each of its 2 chunks) that is a multiple of {bad[1]}.")


def _params(head_dim: int):
    return dict(compiler_params=plgpu.CompilerParams(num_warps=4 if head_dim <= 64 else 8, num_stages=2),
                interpret=compiled_for() != "gpu")


def _visible(q_pos, k_pos):
    """A tile's mask (queries' positions over keys'), and whether any query sees any key."""
    return q_pos[:, None] >= k_pos[None, :], jnp.max(q_pos) >= jnp.min(k_pos)


def _over_tiles(count: int, body, carry, masked: bool, tile_pos):
    """`body(j, carry, mask)` for each of `count` tiles j; where `masked`, `tile_pos(j)` gives
    (mask, any visible) and a tile nothing sees is skipped."""
    def step(j, c):
        if not masked:
            return body(j, c, None)
        mask, any_visible = tile_pos(j)
        return lax.cond(any_visible, lambda c: body(j, c, mask), lambda c: c, c)

    return lax.fori_loop(0, count, step, carry)


def _forward_kernel(q_ref, k_ref, v_ref, *refs, scale, block_k, masked):
    q_pos_ref, k_pos_ref, out_ref, lse_ref = refs if masked else (None, None, *refs)
    q = q_ref[...]
    rows, d = q.shape
    q_pos = q_pos_ref[...] if masked else None

    def body(j, carry, mask):
        acc, m, l = carry
        keys = pl.ds(j * block_k, block_k)
        s = plgpu.dot(q, k_ref[keys, :], trans_b=True) * scale
        if mask is not None:
            s = jnp.where(mask, s, MASKED)
        m_next = jnp.maximum(m, jnp.max(s, axis=1))
        p = jnp.exp(s - m_next[:, None])
        correction = jnp.exp(m - m_next)
        v = v_ref[keys, :]
        acc = acc * correction[:, None] + plgpu.dot(p.astype(v.dtype), v)
        return acc, m_next, l * correction + jnp.sum(p, axis=1)

    carry = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32))
    acc, m, l = _over_tiles(k_ref.shape[0] // block_k, body, carry, masked,
                            lambda j: _visible(q_pos, k_pos_ref[pl.ds(j * block_k, block_k)]))
    out_ref[...] = (acc / l[:, None]).astype(out_ref.dtype)
    lse_ref[...] = m + jnp.log(l)


def _specs(q, k, block_q):
    """BlockSpecs for a grid (tile, batch, head): (batch, seq, heads, d) queries tiled by
    `block_q`, and keys whole, where grouped-query heads find their KV head (head // group)."""
    group, d = q.shape[2] // k.shape[2], q.shape[3]
    rows = pl.BlockSpec((None, block_q, None, d), lambda i, b, h: (b, i, h, 0))
    return rows, pl.BlockSpec((None, k.shape[1], None, d), lambda i, b, h: (b, 0, h // group, 0))


def _like(x, shape, dtype):
    """An output's type: `shape` and `dtype` with x's sharding and vma (inside shard_map, Pallas
    asks each output how it varies over the mesh)."""
    return jax.typeof(x).update(shape=tuple(shape), dtype=jnp.dtype(dtype))


def _varying_as(outputs, x):
    """`outputs` typed as varying as x (JAX 0.10's Pallas types them invariant, 0.12's as `_like` says)."""
    return [vma.vary(o, vma.varying_axes(x)) for o in outputs]


def _position_args(positions, q_block: int, k_block: int):
    """The positions (int32) as a call's inputs, and their specs for a grid whose first index
    tiles the queries (k_block whole) or the keys (q_block whole); none where `positions` is None."""
    if positions is None:
        return [], []
    q_pos, k_pos = (jnp.asarray(p, jnp.int32) for p in positions)
    tiles_queries = k_block == k_pos.shape[0]
    specs = [pl.BlockSpec((q_block,), lambda i, b, h: (i if tiles_queries else 0,)),
             pl.BlockSpec((k_block,), lambda i, b, h: (0 if tiles_queries else i,))]
    return [q_pos, k_pos], specs


def flash_forward(q: jax.Array, k: jax.Array, v: jax.Array, positions=None,
                  out_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
    """Attention of queries (batch, q, heads, d) over keys and values (batch, k, kv_heads, d)
    where `positions` = (q_pos, k_pos) allow (None: everywhere): the output (batch, q, heads, d)
    in `out_dtype` (float32 for a merge) and each query's log-sum-exp (batch, heads, q), float32."""
    b, sq, h, d = q.shape
    check_flash(d, sq, k.shape[1])
    q, k, v, *positions = vma.match(q, k, v, *(positions or ()))
    positions = positions or None
    block_q, block_k = min(FORWARD_TILES[0], sq), min(FORWARD_TILES[1], k.shape[1])
    rows, whole_kv = _specs(q, k, block_q)
    extra, extra_specs = _position_args(positions, block_q, k.shape[1])
    kernel = functools.partial(_forward_kernel, scale=1 / math.sqrt(d), block_k=block_k, masked=positions is not None)
    out, lse = pl.pallas_call(
        kernel, grid=(sq // block_q, b, h), in_specs=[rows, whole_kv, whole_kv, *extra_specs],
        out_specs=[rows, pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
        out_shape=[_like(q, q.shape, out_dtype), _like(q, (b, h, sq), jnp.float32)],
        name="jshard_flash_forward", **_params(d),
    )(q, k, v, *extra)
    return tuple(_varying_as((out, lse), q))


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, scale, block_k, masked):
    q_pos_ref, k_pos_ref, dq_ref = refs if masked else (None, None, *refs)
    q, do, lse, delta = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...]
    q_pos = q_pos_ref[...] if masked else None

    def body(j, dq, mask):
        keys = pl.ds(j * block_k, block_k)
        k, v = k_ref[keys, :], v_ref[keys, :]
        s = plgpu.dot(q, k, trans_b=True) * scale
        if mask is not None:
            s = jnp.where(mask, s, MASKED)
        p = jnp.exp(s - lse[:, None])
        ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None]) * scale
        return dq + plgpu.dot(ds.astype(k.dtype), k)

    dq = _over_tiles(k_ref.shape[0] // block_k, body, jnp.zeros(q.shape, jnp.float32), masked,
                     lambda j: _visible(q_pos, k_pos_ref[pl.ds(j * block_k, block_k)]))
    dq_ref[...] = dq


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *refs, scale, block_q, masked):
    """One tile of one KV head's keys: dk, dv summed over its group's query heads (q_ref and
    do_ref hold the group's heads, lse_ref and delta_ref their rows), a tile of queries at a time."""
    q_pos_ref, k_pos_ref, dk_ref, dv_ref = refs if masked else (None, None, *refs)
    k, v = k_ref[...], v_ref[...]
    k_pos = k_pos_ref[...] if masked else None

    def body(i, carry, mask, head):
        dk, dv = carry
        rows = pl.ds(i * block_q, block_q)
        q, do = q_ref[rows, head, :], do_ref[rows, head, :]
        lse, delta = lse_ref[head, rows], delta_ref[head, rows]
        s = plgpu.dot(q, k, trans_b=True) * scale
        if mask is not None:
            s = jnp.where(mask, s, MASKED)
        p = jnp.exp(s - lse[:, None])
        dv = dv + plgpu.dot(p.astype(do.dtype), do, trans_a=True)
        ds = p * (plgpu.dot(do, v, trans_b=True) - delta[:, None]) * scale
        return dk + plgpu.dot(ds.astype(q.dtype), q, trans_a=True), dv

    def tile_pos(i):
        return _visible(q_pos_ref[pl.ds(i * block_q, block_q)], k_pos)

    carry = (jnp.zeros(k.shape, jnp.float32),) * 2
    for head in range(q_ref.shape[1]):  # the group's query heads, unrolled
        carry = _over_tiles(q_ref.shape[0] // block_q, functools.partial(body, head=head), carry, masked, tile_pos)
    dk_ref[...], dv_ref[...] = carry


def flash_backward(q, k, v, d_out, lse, delta, positions=None):
    """dq (batch, q, heads, d), dk and dv (batch, k, kv_heads, d), float32, of `flash_forward`'s
    output under the given statistics: `lse` and `delta` (batch, heads, q), float32, the rows'
    log-sum-exp and rowsum(dO · O) over every block they attend (this one's alone for a whole
    attention). `d_out`: the output's gradient (batch, q, heads, d)."""
    b, sq, h, d = q.shape
    sk, kv_heads = k.shape[1], k.shape[2]
    check_flash(d, sq, sk)
    q, k, v, d_out, lse, delta, *positions = vma.match(q, k, v, d_out, lse, delta, *(positions or ()))
    positions = positions or None
    block_q, block_k = min(BACKWARD_TILES[0], sq), min(BACKWARD_TILES[1], sk)
    scale, masked = 1 / math.sqrt(d), positions is not None
    d_out = d_out.astype(q.dtype)
    stats_rows = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
    rows, whole_kv = _specs(q, k, block_q)
    extra, extra_specs = _position_args(positions, block_q, sk)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, block_k=block_k, masked=masked),
        grid=(sq // block_q, b, h), in_specs=[rows, whole_kv, whole_kv, rows, stats_rows, stats_rows, *extra_specs],
        out_specs=rows, out_shape=_like(q, q.shape, jnp.float32), name="jshard_flash_dq", **_params(d),
    )(q, k, v, d_out, lse, delta, *extra)

    # dk, dv: each program one key tile of one KV head, over its group of query heads
    group = h // kv_heads
    key_rows = pl.BlockSpec((None, block_k, None, d), lambda j, b, g: (b, j, g, 0))
    group_q = pl.BlockSpec((None, sq, group, d), lambda j, b, g: (b, 0, g, 0))
    group_stats = pl.BlockSpec((None, group, sq), lambda j, b, g: (b, g, 0))
    extra, extra_specs = _position_args(positions, sq, block_k)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, block_q=block_q, masked=masked),
        grid=(sk // block_k, b, kv_heads),
        in_specs=[group_q, key_rows, key_rows, group_q, group_stats, group_stats, *extra_specs],
        out_specs=[key_rows, key_rows], out_shape=[_like(q, k.shape, jnp.float32)] * 2,
        name="jshard_flash_dkv", **_params(d),
    )(q, k, v, d_out, lse, delta, *extra)
    return tuple(_varying_as((dq, dk, dv), q))


def _delta(d_out, out):
    """rowsum(dO · O) per query and head (batch, heads, q), float32."""
    return jnp.einsum("bqhd,bqhd->bhq", d_out.astype(jnp.float32), out.astype(jnp.float32))


@jax.custom_vjp
def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
    """Attention of queries over keys and values where q_pos >= k_pos (causal: both
    `arange(seq)`), in q's dtype, differentiable: the scores kept nowhere, backward from the
    output and its log-sum-exp."""
    return flash_forward(q, k, v, (q_pos, k_pos), q.dtype)[0]


def _flash_attention_fwd(q, k, v, q_pos, k_pos):
    out, lse = flash_forward(q, k, v, (q_pos, k_pos), q.dtype)
    return out, (q, k, v, q_pos, k_pos, out, lse)


def _flash_attention_bwd(residuals, d_out):
    q, k, v, q_pos, k_pos, out, lse = residuals
    dq, dk, dv = flash_backward(q, k, v, d_out, lse, _delta(d_out, out), (q_pos, k_pos))
    no_grad = (np.zeros(q_pos.shape, jax.dtypes.float0), np.zeros(k_pos.shape, jax.dtypes.float0))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *no_grad)


flash_attention.defvjp(_flash_attention_fwd, _flash_attention_bwd)


def causal_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention over a whole sequence by the Pallas kernel."""
    return flash_attention(q, k, v, jnp.arange(q.shape[1]), jnp.arange(k.shape[1]))
