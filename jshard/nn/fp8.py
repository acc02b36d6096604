"""FP8 matmuls (the `fp8` precision policy): a projection's product computed on its operands
cast to FP8, e4m3 forward (3 mantissa bits, up to 448) and e5m2 for the output's gradient
(2 mantissa bits, up to 57344: gradients span more range than they need precision), each
operand with one scale per tensor.

Current scaling: an operand's scale comes from the operand itself just before the cast
(its largest magnitude over the format's), not from an amax history of earlier steps (delayed
scaling: Flax's `linen.fp8_ops`, Transformer Engine's first recipe). No state to carry, shard,
checkpoint and restore, no step whose outliers overflow a stale scale; its cost is one more
read of each operand (a max, which XLA fuses before the cast). Megatron Bridge's Llama-3-8B
on H100 (744 TFLOP/s per GPU) uses current scaling.

Per tensor as each device holds it: an activation's or a gradient's scale is its block's on
this device (no collective on the critical path; each block's product is scaled before blocks
meet in a sum, so a scale per block is as valid as one per tensor, and FP8's rounding on N
devices differs from one device's only as one rounding differs from another). A weight that
ZeRO-3 gathers is cast with one scale for all its shards (the max of its shards' amaxes: a
scalar's all-reduce), and its e4m3 shards are gathered: half of bf16's bytes. The cast and
gather are not differentiated (the product's VJP hands the weight its gradient, reduce-scattered
in the param dtype), so ZeRO-3's remat policy drops the gathered e4m3 weight and backward
gathers it again, as it does a bf16 one.

The product is a plain `dot_general` on the operands cast to FP8 and back (convert × scale):
XLA:GPU's GEMM rewriter on Hopper turns that into one cuBLASLt FP8 GEMM with the scales as
its factors (`__cublas$lt$matmul$f8`, forward and both gradients; `Plan.xla_options` keeps
out of such programs XLA's Triton GEMMs, which compute these in bf16, and its dot merger, which
joins products at different scales into one bf16 GEMM). Elsewhere (a CPU) the
same program computes in bf16 on FP8-rounded values: the tests on fake CPU devices see FP8's
rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jshard import vma
from jshard.nn.layouts import Layout, relayout_local

FORWARD, GRADIENT = jnp.float8_e4m3fn, jnp.float8_e5m2


def scale(x: jax.Array, dtype, axes: tuple[str, ...] = ()) -> jax.Array:
    """x's current scale for `dtype`: its largest magnitude (over `axes` too) over the format's
    largest value, in float32; 1 for a zero tensor."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    if axes:
        amax = lax.pmax(amax, axes)
    return jnp.where(amax > 0, amax / float(jnp.finfo(dtype).max), 1.0)


def quantize(x: jax.Array, s: jax.Array, dtype) -> jax.Array:
    """x / s in `dtype`, saturated at the format's largest value (e4m3 has no infinity)."""
    limit = float(jnp.finfo(dtype).max)
    x, s = vma.match(x, s)
    return jnp.clip(x.astype(jnp.float32) / s, -limit, limit).astype(dtype)


def dequantize(q: jax.Array, s: jax.Array, dtype) -> jax.Array:
    """q × s in `dtype`: the form XLA's GEMM rewriter folds into an FP8 GEMM's operand."""
    q, s = vma.match(q, s)
    return q.astype(dtype) * s.astype(dtype)


def _gathered_axes(held: Layout | None, gathered: Layout | None) -> tuple[str, ...]:
    if held is None or held == gathered:
        return ()
    return tuple(sorted({a for axes in held for a in axes} - {a for axes in gathered for a in axes}))


def _gathered(w: jax.Array, s: jax.Array, held: Layout | None, gathered: Layout | None) -> jax.Array:
    """The weight in e4m3 at scale `s`, gathered from `held` to `gathered` (ZeRO-3) in e4m3."""
    q = from_bytes(as_bytes(quantize(w, s, FORWARD)))  # what a remat policy keeps: its bytes
    return relayout_local(q, held, gathered) if _gathered_axes(held, gathered) else q


def dot(x: jax.Array, w: jax.Array, dims, held: Layout | None = None, gathered: Layout | None = None) -> jax.Array:
    """`dot_general(x, w, dims)` in FP8, in x's dtype. Inside a step, `w` is the weight as this
    device holds it (`held`) and is gathered to `gathered` in e4m3 (ZeRO-3); None: used as is."""
    # The cast and the gather are not differentiated (the product's VJP hands `w` its gradient):
    # so ZeRO-3's remat policy sees the e4m3 gather, and backward gathers again, as it does a
    # bf16 weight.
    fixed = lax.stop_gradient(w)
    sw = scale(fixed, FORWARD, _gathered_axes(held, gathered))
    return _product(x, w, _gathered(fixed, sw, held, gathered), sw, dims, held, gathered)


def as_bytes(q: jax.Array) -> jax.Array:
    """An FP8 value as its bytes (uint8), to be kept for backward: `jax.checkpoint` rounds each
    float it saves to its format with `reduce_precision`, whose IEEE rules give e4m3fn (which has
    no infinities) a largest value of 240, not 448: the values above it came back NaN (seen
    under ZeRO-3's remat policy). `params.remat_policy` keeps the bytes, not the cast back."""
    return lax.bitcast_convert_type(q, jnp.uint8)


def from_bytes(b: jax.Array, dtype=FORWARD) -> jax.Array:
    return lax.bitcast_convert_type(b, dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _product(x, w, qw, sw, dims, held, gathered):
    return _forward(x, w, qw, sw, dims, held, gathered)[0]


def _forward(x, w, qw, sw, dims, held, gathered):
    sx = scale(x, FORWARD)
    qx = quantize(x, sx, FORWARD)
    y = lax.dot_general(*vma.match(dequantize(qx, sx, x.dtype), dequantize(qw, sw, x.dtype)), dims)
    # The barrier keeps XLA:GPU from fusing what follows (GPT's GELU) into the FP8 GEMM as an
    # epilogue with an auxiliary output, which its GPU backend cannot emit for FP8 (a RET_CHECK,
    # `!has_aux_output`, in the one-GPU GPT program; jax 0.12.0.1).
    y = lax.optimization_barrier(y)
    # Backward keeps x in e4m3 (half of bf16), as its bytes (`as_bytes`; a bitcast costs nothing).
    # A gathered weight is kept (ZeRO-3's remat policy drops it: backward gathers again); one
    # not gathered is cast again from the param, not kept as a second copy of every layer's.
    kept_qw = qw if _gathered_axes(held, gathered) else None
    return y, (as_bytes(qx), sx, w, kept_qw, sw)


def _backward(dims, held, gathered, kept, dy):
    qx, sx, w, qw, sw = kept
    qx = from_bytes(qx)
    qw = quantize(w, sw, FORWARD) if qw is None else qw
    sdy = scale(dy, GRADIENT)
    dtype = dy.dtype
    _, transpose = jax.vjp(lambda a, b: lax.dot_general(a, b, dims),
                           *vma.match(dequantize(qx, sx, dtype), dequantize(qw, sw, dtype)))
    dx, dw = transpose(dequantize(quantize(dy, sdy, GRADIENT), sdy, dtype))
    if _gathered_axes(held, gathered):  # the gather's transpose: the gradient reduce-scattered, in w's dtype
        dw = jax.vjp(lambda v: relayout_local(v, held, gathered), w)[1](dw.astype(w.dtype))[0]
    return dx, dw.astype(w.dtype), None, None


_product.defvjp(_forward, _backward)
