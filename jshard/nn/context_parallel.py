"""Context parallelism: each sequence split over the mesh axes the rules give attention's `seq`.

Rules that put attention's `seq` on mesh axes (the `cp` presets: `context`) split every
sequence over them. Inside a step a sequence is held in one order throughout (`held_order`):
it is applied where the step's inputs (token ids, labels) are split (`split_input`, recorded
in the step context's `context_splits`) and read back where positions matter (`positions`),
and nothing between (the residual stream, the MLP, the loss) cares about the order of the
tokens. Attention over the split sequence is `context_attention`, as the rules choose:

- a ring (`ring_attention`) or all-gathered keys and values (`gathered_kv_attention`): each
  device's queries over every device's keys. Causal attention gives later tokens more work, so
  the split is load-balanced, as Megatron's CP: over n devices the sequence is cut into 2n
  chunks and device i holds chunks i and 2n-1-i, one early and one late (`balanced_order`).
  Their blocks run jshard's Pallas flash kernel (`nn.flash`, "pallas": no scores in HBM) or
  XLA's ops a tile of queries at a time ("xla"), as `block_kernel` chooses;
- all-to-all (`all_to_all_attention`, DeepSpeed-Ulysses): the split traded for one of the
  heads around attention, which runs over the whole sequence by the model's own kernel
  (cuDNN's flash kernel on a GPU). Every device then does the same work whatever the order, so
  device i holds chunk i of n, in order.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from jshard import vma
from jshard.nn.flash import HEAD_DIMS, check_flash, check_pallas, flash_attention, flash_backward, flash_forward, untiled
from jshard.nn.layouts import Layout, layout, relayout_local
from jshard.nn.softmax import probabilities
from jshard.nn.step_context import compiled_for, current_step, in_step
from jshard.rules import ShardingError, active_rules


def context_axes() -> tuple[str, ...]:
    """Inside a step: the mesh axes (of size > 1) the rules split attention's `seq` over, context
    parallelism's (`Rules.context_axes`). () elsewhere, and where only the residual stream's seq
    is split (sequence parallelism gathers it before attention)."""
    if not in_step():
        return ()
    return active_rules().context_axes(jax.sharding.get_abstract_mesh())


def check_context_length(length: int, n: int, chunks: int | None = None) -> None:
    """Context parallelism over n devices cuts each sequence into `chunks` equal chunks (2n,
    load-balanced, unless given)."""
    chunks = chunks or 2 * n
    if n > 1 and length % chunks:
        raise ShardingError(f"context parallelism over {n} devices cuts a sequence into {chunks} equal chunks; "
                            f"{length} tokens do not divide by {chunks}. Fix: a seq-len that is a multiple of {chunks}.")


def held_order(length: int, n: int) -> jax.Array:
    """The positions of a `length`-token sequence in the order a step holds it over n context
    devices, device i's block the i-th of n: load-balanced (`balanced_order`), or in order
    under all-to-all attention."""
    if active_rules().context_attention != "a2a":
        return balanced_order(length, n)
    check_context_length(length, n, chunks=n)
    return jnp.arange(length)


def balanced_order(length: int, n: int) -> jax.Array:
    """The positions of a `length`-token sequence in the load-balanced order over n devices:
    device i's block (the i-th of n) holds chunks i and 2n-1-i of 2n."""
    check_context_length(length, n)
    chunks = jnp.arange(length).reshape(2 * n, length // (2 * n))
    return jnp.stack([chunks[:n], chunks[::-1][:n]], axis=1).reshape(length)


def input_layout(names) -> Layout:
    """A step input (token ids, labels) once split: over the batch axes, and its seq over the context axes."""
    context = set(context_axes())
    return tuple(axes if name == "batch" else tuple(a for a in axes if a in context)
                 for name, axes in zip(names, layout(names)))


def split_input(x: jax.Array, names) -> jax.Array:
    """A step input, which arrives split over the batch axes only, as this device's share under
    context parallelism: each seq dim's chunks (`input_layout`, `held_order`). The identity
    outside a step and without context parallelism."""
    if not in_step():
        return x
    for dim, axes in enumerate(input_layout(names)):
        if axes and names[dim] != "batch":
            splits = current_step().context_splits
            if splits is not None:
                splits.append(tuple(names))
            n = lax.axis_size(axes)
            mine = held_order(x.shape[dim], n).reshape(n, -1)[lax.axis_index(axes)]
            x = jnp.take(vma.vary(x, axes), mine, axis=dim)
    return x


def laid_out_input(x: jax.Array, names, dst: Layout) -> jax.Array:
    """A step input (split over the batch axes only) as layout `dst`: its context chunks taken
    (`split_input`), then moved like any block (sequence parallelism's slice, say)."""
    return relayout_local(split_input(x, names), input_layout(names), dst)


def positions(x: jax.Array, names, dim: int = 1) -> jax.Array:
    """The sequence positions of dim `dim` of activation `x` (named `names`) on this device: in
    a step, of its share of the sequence (context parallelism's chunks, sequence parallelism's
    slice), else 0, 1, ...; int32."""
    if not in_step():
        return jnp.arange(x.shape[dim])
    have = layout(names)[dim]
    whole = x.shape[dim] * math.prod(lax.axis_size(a) for a in have)
    return laid_out_input(jnp.arange(whole), ("seq",), (have,))  # positions as a step input would be


def block_kernel(choice: str, head_dim: int, chunk: int, n: int, platform: str | None = None) -> str:
    """The kernel of the ring's and the gathered keys' blocks for attention `choice` ("auto",
    "xla", "cudnn", "pallas"), over n devices holding 2 chunks of `chunk` tokens each: "pallas"
    (`nn.flash`, fused, no scores in HBM) where asked, and by "auto" on a GPU for the head dims
    and lengths it takes; else "xla". cuDNN's kernel cannot be merged across blocks (its
    statistics: docs/strategies.md) and is refused. `platform` as `attn.attention_implementation`'s."""
    lengths = (chunk, 2 * chunk, 2 * chunk * n)  # a ring's half and whole blocks, the gathered keys
    if choice == "cudnn":
        raise ValueError("attention 'cudnn' cannot run a ring's or gathered keys' blocks (its log-sum-exp is cast to "
                         "the output's dtype and its backward takes no merged statistics). Fix: attention 'auto' or "
                         "'pallas' (jshard's flash kernel), or context attention 'a2a' (strategy cp-a2a), which runs cuDNN's.")
    platform = platform or compiled_for()
    if choice == "pallas":
        check_pallas(head_dim, platform)
        check_flash(head_dim, *lengths)
        return "pallas"
    fits = platform == "gpu" and head_dim in HEAD_DIMS and not untiled(*lengths)
    return "pallas" if choice == "auto" and fits else "xla"


def context_attention(q: jax.Array, k: jax.Array, v: jax.Array, kernel, choice: str = "auto") -> jax.Array:
    """Causal attention under context parallelism, as the active rules choose (`Rules.context_attention`):
    "ring" passes each device's keys and values round the context axes (`ring_attention`);
    "gather" all-gathers them (Llama 3's choice: one collective, the whole K/V held at once);
    both run their blocks by `block_kernel(choice)`. "a2a" runs `kernel(q, k, v)`, causal
    attention over a whole sequence, on a share of the heads (`all_to_all_attention`)."""
    axes = context_axes()
    context = active_rules().context_attention
    if context == "a2a":
        return all_to_all_attention(q, k, v, axes, kernel)
    blocks = block_kernel(choice, q.shape[-1], q.shape[1] // 2, lax.axis_size(axes))
    if context == "gather":
        return gathered_kv_attention(q, k, v, axes, blocks)
    return ring_attention(q, k, v, axes, blocks)


def check_all_to_all_heads(heads: int, n: int, axes) -> None:
    """All-to-all CP gives each of its n devices 1/n of a device's `heads`."""
    if heads % n:
        raise ShardingError(
            f"all-to-all context parallelism over {'+'.join(axes)}={n} splits attention's heads {n} ways; "
            f"{heads} heads a device (the model's over any tensor axes) do not divide by {n}. Fix: a context size that "
            f"divides {heads}, or the ring (preset 'cp') or all-gathered keys and values ('cp-gather').")


def all_to_all_attention(q, k, v, axes, kernel):
    """DeepSpeed-Ulysses: queries, keys and values all-to-all'd from this device's chunk of the
    sequence with all its heads to the whole sequence with 1/n of them, `kernel` over those,
    and its output all-to-all'd back (backward: the same all-to-alls, reversed). Grouped KV
    heads that n does not divide are repeated first, each as often as makes their count a
    multiple of n, so that every device's query heads find their KV head beside them."""
    n, heads, kv_heads = lax.axis_size(axes), q.shape[2], k.shape[2]
    check_all_to_all_heads(heads, n, axes)
    repeats = n // math.gcd(kv_heads, n)
    if repeats > 1:
        k, v = (jnp.repeat(t, repeats, axis=2) for t in (k, v))
    to_heads = functools.partial(lax.all_to_all, axis_name=axes, split_axis=2, concat_axis=1, tiled=True)
    out = kernel(to_heads(q), to_heads(k), to_heads(v))
    return lax.all_to_all(out, axes, split_axis=1, concat_axis=2, tiled=True)


def _scores(q, k, mask):
    """fp32 scores (batch, kv_heads, group, q_len, k_len) of grouped queries over keys; -inf
    where the (q_len, k_len) `mask` is False (None: nowhere)."""
    b, sq, h, d = q.shape
    g = h // k.shape[2]
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q.reshape(b, sq, h // g, g, d), k,
                   preferred_element_type=jnp.float32) / math.sqrt(d)
    return s if mask is None else vma.where(mask, s, -jnp.inf)


def _ungroup(x):
    """(batch, kv_heads, group, q, ...) -> (batch, q, heads, ...)."""
    b, hk, g, sq = x.shape[:4]
    return jnp.moveaxis(x.reshape(b, hk * g, sq, *x.shape[4:]), 2, 1)


def gathered_kv_attention(q, k, v, axes, kernel: str = "xla"):
    """Queries of this device's chunks over every device's keys and values, all-gathered (their
    transpose in backward: a reduce-scatter of dK, dV), masked by the positions both hold; by
    `kernel` ("pallas": the flash kernel, each tile of keys no query sees skipped; "xla": the
    scores of every local query over the sequence, kept for backward)."""
    # Named, so that ZeRO's remat policy (`params.remat_policy`, which gathers again whatever was
    # gathered over ZeRO axes: the context axes are ZeRO's too under zero+cp) keeps them, as the
    # activations they are; a remat of the layer gathers them again.
    k, v = (checkpoint_name(lax.all_gather(t, axes, axis=1, tiled=True), "context_kv") for t in (k, v))
    n = lax.axis_size(axes)
    whole = balanced_order(k.shape[1], n)
    mine = whole.reshape(n, -1)[lax.axis_index(axes)]
    if kernel == "pallas":
        return flash_attention(q, k, v, mine, whole)
    s = _scores(q, k, mine[:, None] >= whole[None, :])
    out = jnp.einsum("bhgqk,bkhd->bhgqd", probabilities(s, v.dtype), v, preferred_element_type=jnp.float32)
    return _ungroup(out).astype(q.dtype)


# Ring attention. Device i holds queries Q_i and keys / values (K_i, V_i) of chunks (i, 2n-1-i).
# In ring step t it attends with the block of device j = i - t (mod n), then passes the block on
# (`ppermute` to i + 1). Over the chunk order, causality is a pattern of halves: j = i is
# causal within the block; j < i, both query chunks see key chunk j whole and chunk 2n-1-j not
# at all; j > i, only query chunk 2n-1-i sees anything, the block whole. So each step after the
# first costs every device half a block's work, the same on all: no device idles. Each block's
# softmax is merged into the running one by its log-sum-exp (the online softmax); backward is a
# second ring in which the keys and values travel with their gradients and arrive home with
# every device's contribution.


def _grouped(x, kv_heads):
    """(batch, q, heads, d) -> (batch, q, kv_heads, group, d)."""
    b, sq, h, d = x.shape
    return x.reshape(b, sq, kv_heads, h // kv_heads, d)


# Queries per tile within a block: a block's attention runs tile by tile (a loop), so its working
# set is one tile's scores over the block's keys, not all its queries' (a flash kernel's idea,
# at the granularity of XLA ops).
QUERY_TILE = 512


def query_tile(length: int) -> int:
    """Queries per tile for a block of `length`: the largest divisor of it up to QUERY_TILE."""
    return max(d for d in range(1, min(length, QUERY_TILE) + 1) if length % d == 0)


def _split_rows(x, dim: int, tile: int):
    """x with dim `dim` cut into tiles, the tiles leading: (..., n·tile, ...) -> (n, ..., tile, ...)."""
    x = jnp.moveaxis(x, dim, 0)
    return jnp.moveaxis(x.reshape(x.shape[0] // tile, tile, *x.shape[1:]), 1, dim + 1)


def _join_rows(x, dim: int):
    """The inverse of `_split_rows`."""
    x = jnp.moveaxis(x, dim + 1, 1)
    return jnp.moveaxis(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), 0, dim)


def _causal(q, k, causal: bool):
    """The mask of a block: causal (q, k) (a device's own chunks, whose order makes it so), or None."""
    return jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)) if causal else None


def _causal_positions(q, k, causal: bool):
    """The flash kernel's form of `_causal`: (query positions, key positions), or None."""
    return (jnp.arange(q.shape[1]), jnp.arange(k.shape[1])) if causal else None


def _block_forward(q, k, v, causal: bool, kernel: str):
    """One block: output (batch, q, heads, d) in fp32, and log-sum-exp (batch, kv_heads, group, q),
    of queries over keys, causal or whole; by the flash kernel, or XLA's a tile of queries at a time."""
    b, sq, h, _ = q.shape
    if kernel == "pallas":
        out, lse = flash_forward(q, k, v, _causal_positions(q, k, causal))
        return out, lse.reshape(b, k.shape[2], h // k.shape[2], sq)
    mask, tile = _causal(q, k, causal), query_tile(sq)

    def one_tile(tiles):
        q, mask = tiles
        s = _scores(q, k, mask)
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.exp(s - lse[..., None])
        return _ungroup(jnp.einsum("bhgqk,bkhd->bhgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)), lse

    masks = None if mask is None else _split_rows(mask, 0, tile)
    out, lse = lax.map(one_tile, (_split_rows(q, 1, tile), masks))
    return _join_rows(out, 1), _join_rows(lse, 3)


def _block_backward(q, k, v, d_out, lse, delta, causal: bool, kernel: str):
    """One block's dq (batch, q, heads, d), dk, dv (batch, k, kv_heads, d), fp32, from the
    output's gradient, the rows' log-sum-exp over every block and delta = rowsum(dO · O); by the
    flash kernel, or XLA's a tile of queries at a time (dk and dv summed over the tiles)."""
    b, sq, h, _ = q.shape
    if kernel == "pallas":
        return flash_backward(q, k, v, d_out, lse.reshape(b, h, sq), delta.reshape(b, h, sq), _causal_positions(q, k, causal))
    hk, tile, mask = k.shape[2], query_tile(sq), _causal(q, k, causal)
    k32, v32 = k.astype(jnp.float32), v.astype(jnp.float32)

    def one_tile(dkv, tiles):
        q, d_out, lse, delta, mask = tiles
        p = jnp.exp(_scores(q, k, mask) - lse[..., None])  # the softmax's share of this block
        do = _grouped(d_out, hk).astype(jnp.float32)
        dp = jnp.einsum("bqhgd,bkhd->bhgqk", do, v32)
        ds = p * (dp - delta[..., None]) / math.sqrt(q.shape[-1])
        dq = jnp.einsum("bhgqk,bkhd->bqhgd", ds, k32).reshape(q.shape)
        dk = jnp.einsum("bhgqk,bqhgd->bkhd", ds, _grouped(q, hk).astype(jnp.float32))
        return (dkv[0] + dk, dkv[1] + jnp.einsum("bhgqk,bqhgd->bkhd", p, do)), dq

    tiles = (_split_rows(q, 1, tile), _split_rows(d_out, 1, tile), _split_rows(lse, 3, tile),
             _split_rows(delta, 3, tile), None if mask is None else _split_rows(mask, 0, tile))
    varying = frozenset().union(*map(vma.varying_axes, (q, k, v, d_out)))
    zero = vma.vary(jnp.zeros(k.shape, jnp.float32), varying)
    (dk, dv), dq = lax.scan(one_tile, (zero, zero), tiles)
    return _join_rows(dq, 1), dk, dv


def _from_earlier(axes, t):
    """Whether ring step t's block comes from a device j < i (else j > i; t = 0: j = i)."""
    i = lax.axis_index(axes)
    return (i - t) % lax.axis_size(axes) < i


def _half(x, dim, second: bool, empty: float):
    """x (the length of one chunk along `dim`) placed in the first or second half of a
    twice-as-long value whose other half is `empty`."""
    fill = vma.zeros_like(x) + empty
    return jnp.concatenate([fill, x] if second else [x, fill], axis=dim)


def _ring_forward_step(q, k, v, t, axes, kernel):
    c = q.shape[1] // 2
    if t == 0:  # its own chunks (i, 2n-1-i): each causal over itself, the late one seeing the early one
        return _block_forward(q, k, v, True, kernel)  # whole: causal over the two as one

    def earlier(q, k, v):  # both query chunks over key chunk j
        return _block_forward(q, k[:, :c], v[:, :c], False, kernel)

    def later(q, k, v):  # query chunk 2n-1-i over both of j's
        out, lse = _block_forward(q[:, c:], k, v, False, kernel)
        return _half(out, 1, True, 0.0), _half(lse, 3, True, -jnp.inf)

    return lax.cond(_from_earlier(axes, t), earlier, later, q, k, v)


def _ring_backward_step(q, k, v, d_out, lse, delta, t, axes, kernel):
    c = q.shape[1] // 2
    if t == 0:
        return _block_backward(q, k, v, d_out, lse, delta, True, kernel)

    def earlier(q, k, v, d_out, lse, delta):
        dq, dk, dv = _block_backward(q, k[:, :c], v[:, :c], d_out, lse, delta, False, kernel)
        return dq, _half(dk, 1, False, 0.0), _half(dv, 1, False, 0.0)

    def later(q, k, v, d_out, lse, delta):
        dq, dk, dv = _block_backward(q[:, c:], k, v, d_out[:, c:], lse[..., c:], delta[..., c:], False, kernel)
        return _half(dq, 1, True, 0.0), dk, dv

    return lax.cond(_from_earlier(axes, t), earlier, later, q, k, v, d_out, lse, delta)


def _pass_on(x, axes):
    """x sent one step round the ring of `axes`: device i's to device i + 1."""
    n = lax.axis_size(axes)
    return lax.ppermute(x, axes, [(i, (i + 1) % n) for i in range(n)])


def _ring_attention_fwd(q, k, v, axes, kernel):
    n = lax.axis_size(axes)
    # Sends ordered after the blocks where they run asynchronously, beside compute (a GPU's);
    # XLA:CPU's wait for their peers anyway, and there the recomputed forward's ring (remat)
    # stays one computation with the backward's, which XLA merges
    ordered = compiled_for() == "gpu"
    kv, out, lse = (k, v), None, None
    for t in range(n):
        following = _pass_on(kv, axes) if t < n - 1 else None  # the next block travels while this one computes
        block_out, block_lse = _ring_forward_step(q, *kv, t, axes, kernel)
        if out is None:
            out, lse = block_out, block_lse
        else:  # the online softmax: both weighted by their share of the merged normaliser
            merged = jnp.logaddexp(lse, block_lse)
            scale_old, scale_new = (_ungroup(jnp.exp(x - merged)[..., None]) for x in (lse, block_lse))
            out, lse = out * scale_old + block_out * scale_new, merged
        if following is not None and ordered:
            # The next send waits for this block's result: without the barrier the sends, a chain
            # that needs no compute, all ran first, back to back, and the blocks then found none
            # to overlap (XLA:GPU; in the 8B's layer loop at 32k: 58% of the permuted bytes hidden).
            following, out, lse = lax.optimization_barrier((following, out, lse))
        kv = following
    out = out.astype(q.dtype)
    return out, (q, k, v, out, lse)


def _ring_attention_bwd(axes, kernel, residuals, d_out):
    q, k, v, out, lse = residuals
    n = lax.axis_size(axes)
    hk = k.shape[2]
    grouped = [_grouped(x, hk).astype(jnp.float32) for x in (d_out, out)]
    delta = jnp.einsum("bqhgd,bqhgd->bhgq", *grouped)  # rowsum(dO · O): the softmax's backward term
    kv, dq, dkv = (k, v), None, None
    for t in range(n):
        following = _pass_on(kv, axes) if t < n - 1 else None
        block_dq, dk, dv = _ring_backward_step(q, *kv, d_out, lse, delta, t, axes, kernel)
        dq = block_dq if dq is None else dq + block_dq
        dkv = (dk, dv) if dkv is None else (dkv[0] + dk, dkv[1] + dv)
        dkv = _pass_on(dkv, axes)  # with its block: after n steps, home with every device's share
        kv = following
    return dq.astype(q.dtype), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, axes: tuple[str, ...], kernel: str = "xla") -> jax.Array:
    """Causal attention of this device's load-balanced chunks of queries over every device's
    keys and values, passed round the ring of mesh `axes` (see above), each block by `kernel`
    ("pallas" or "xla", `block_kernel`); inside a step."""
    return _ring_attention_fwd(q, k, v, axes, kernel)[0]


ring_attention.defvjp(_ring_attention_fwd, _ring_attention_bwd)
