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
this device (no collective on the critical path; the blocks' products are summed after their
scales are applied, so any scale per block is exact arithmetic). A weight that ZeRO-3 gathers
is cast with one scale for all its shards (the max of its shards' amaxes: a scalar's
all-reduce), and its e4m3 shards are gathered: half of bf16's bytes, in forward and in
backward's re-gather (the gradient's reduce-scatter stays in the param dtype).

The product is a plain `dot_general` on the operands cast to FP8 and back (convert × scale):
XLA:GPU's GEMM rewriter on Hopper turns that into one cuBLASLt FP8 GEMM with the scales as
its factors (`__cublas$lt$matmul$f8`, forward and both gradients; `Plan.xla_options` keeps
XLA's Triton GEMMs out of such programs, which compute these in bf16). Elsewhere (a CPU) the
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
    q = quantize(w, s, FORWARD)
    return relayout_local(q, held, gathered) if _gathered_axes(held, gathered) else q


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def dot(x: jax.Array, w: jax.Array, dims, held: Layout | None = None, gathered: Layout | None = None) -> jax.Array:
    """`dot_general(x, w, dims)` in FP8, in x's dtype. Inside a step, `w` is the weight as this
    device holds it (`held`) and is gathered to `gathered` in e4m3 (ZeRO-3); None: used as is."""
    return _forward(x, w, dims, held, gathered)[0]


def _forward(x, w, dims, held, gathered):
    sx = scale(x, FORWARD)
    qx = quantize(x, sx, FORWARD)
    sw = scale(w, FORWARD, _gathered_axes(held, gathered))
    qw = _gathered(w, sw, held, gathered)
    y = lax.dot_general(*vma.match(dequantize(qx, sx, x.dtype), dequantize(qw, sw, x.dtype)), dims)
    # The barrier keeps XLA:GPU from fusing what follows (GPT's GELU) into the FP8 GEMM as an
    # epilogue with an auxiliary output, which its GPU backend cannot emit for FP8 (a RET_CHECK,
    # `!has_aux_output`, in the one-GPU GPT program; jax 0.12.0.1).
    y = lax.optimization_barrier(y)
    # Backward keeps x in e4m3 (half of bf16), as its bytes: XLA:CPU widens an e4m3 value that
    # a layer scan stacks through f16 with IEEE e4m3's range (240, not e4m3fn's 448), and the
    # values above it come back NaN (seen in the CPU program); a bitcast costs nothing on a GPU.
    # The weight is kept as held, with its scale: backward casts and gathers it again, as
    # ZeRO-3's remat policy has every gathered weight.
    return y, (lax.bitcast_convert_type(qx, jnp.uint8), sx, w, sw)


def _backward(dims, held, gathered, kept, dy):
    qx, sx, w, sw = kept
    qx = lax.bitcast_convert_type(qx, FORWARD)
    qw = _gathered(w, sw, held, gathered)
    sdy = scale(dy, GRADIENT)
    dtype = dy.dtype
    _, transpose = jax.vjp(lambda a, b: lax.dot_general(a, b, dims),
                           *vma.match(dequantize(qx, sx, dtype), dequantize(qw, sw, dtype)))
    dx, dw = transpose(dequantize(quantize(dy, sdy, GRADIENT), sdy, dtype))
    if _gathered_axes(held, gathered):  # the gather's transpose: the gradient reduce-scattered, in w's dtype
        dw = jax.vjp(lambda v: relayout_local(v, held, gathered), w)[1](dw.astype(w.dtype))[0]
    return dx, dw.astype(w.dtype)


dot.defvjp(_forward, _backward)
