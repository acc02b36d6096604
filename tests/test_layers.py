"""The elementwise work between matmuls (`nn.LayerNorm`, `nn.RMSNorm`, `nn.gelu`, `nn.swiglu`):
the plain formulas' values and gradients, keeping only their inputs for backward, with or
without an enclosing checkpoint whose policy saves everything (the stack's or ZeRO's); and
XLA's attention (`jshard.nn.attn.xla_attention`): JAX's forward to the bit, keeping its probabilities alone;
and `nn.params.released_together`, the identity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jshard import nn
from jshard.nn.attn import xla_attention
from jshard.nn.params import released_together
from seed import SEED

H = 64


def _layer_norm(x, scale, bias):  # the textbook formula, in float32
    x = x.astype(jnp.float32)
    y = (x - x.mean(-1, keepdims=True)) / jnp.sqrt(x.var(-1, keepdims=True) + 1e-6)
    return y * scale + bias


def _rms_norm(x, scale):
    x = x.astype(jnp.float32)
    return x / jnp.sqrt(jnp.square(x).mean(-1, keepdims=True) + 1e-6) * scale


def _case(name):
    """(jshard's function of the arrays, the plain one, its inputs)."""
    keys = jax.random.split(jax.random.key(SEED), 4)
    x = jax.random.normal(keys[0], (4, 8, H), jnp.float32)
    scale, bias = 1 + 0.1 * jax.random.normal(keys[1], (H,)), 0.1 * jax.random.normal(keys[2], (H,))
    if name == "layer_norm":
        norm = nn.LayerNorm(H)
        graphdef, _ = nnx.split(norm)
        return (lambda x, s, b: nnx.merge(graphdef, nnx.State({"scale": nnx.Param(s), "bias": nnx.Param(b)}))(x),
                _layer_norm, (x, scale, bias))
    if name == "rms_norm":
        graphdef, _ = nnx.split(nn.RMSNorm(H))
        return lambda x, s: nnx.merge(graphdef, nnx.State({"scale": nnx.Param(s)}))(x), _rms_norm, (x, scale)
    if name == "gelu":
        return nn.gelu, lambda x: jax.nn.gelu(x, approximate=True), (x,)
    up = jax.random.normal(keys[3], x.shape)
    return nn.swiglu, lambda g, u: jax.nn.silu(g) * u, (x, up)


NAMES = ["layer_norm", "rms_norm", "gelu", "swiglu"]


@pytest.mark.parametrize("name", NAMES)
def test_values_and_gradients_are_the_plain_formulas(name):
    jshard_fn, plain, args = _case(name)
    np.testing.assert_allclose(jshard_fn(*args), plain(*args), rtol=1e-5, atol=1e-6)
    argnums = tuple(range(len(args)))
    ours = jax.grad(lambda *a: jnp.sum(jnp.sin(jshard_fn(*a))), argnums)(*args)
    theirs = jax.grad(lambda *a: jnp.sum(jnp.sin(plain(*a))), argnums)(*args)
    for a, b in zip(ours, theirs):  # a scale's gradient sums 32 rows' terms of ~1: f32's order of summation
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)  # (XLA's vector width, per CPU) moves it ~1e-6


def _kept_bytes(f, *args) -> int:
    """The bytes `jax.vjp` keeps for `f`'s backward: the leaves of its VJP function."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(jax.vjp(f, *args)[1]))


@pytest.mark.parametrize("policy", [None, jax.checkpoint_policies.everything_saveable], ids=["no remat", "save all"])
@pytest.mark.parametrize("name", NAMES)
def test_backward_keeps_only_the_inputs(name, policy):
    """In bf16, as on a GPU: the plain formulas keep float32 intermediates of x's shape (several
    times x's bytes); jshard's keep the inputs, even where an enclosing policy would save all."""
    jshard_fn, plain, args = _case(name)
    args = tuple(a.astype(jnp.bfloat16) if a.ndim == 3 else a for a in args)
    if policy is not None:
        jshard_fn, plain = (jax.checkpoint(f, policy=policy) for f in (jshard_fn, plain))
    inputs = sum(a.nbytes for a in args)
    assert _kept_bytes(jshard_fn, *args) <= inputs
    assert _kept_bytes(plain, *args) > 2 * inputs


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_xla_attention_is_jaxs_forward_and_keeps_its_probabilities_alone(kv_heads, dtype):
    """`jax.nn.dot_product_attention(..., implementation="xla")`'s output (to the bit where heads
    are not grouped) and its gradients (to float32 round-off; in bf16 the softmax's backward reads the bf16 probabilities,
    as Megatron's fused softmax does); backward keeps, beyond the inputs and what depends on
    nothing (the causal mask), one score-sized array in the compute dtype, where JAX's keeps
    float32 copies of the softmax's exp and quotient beside it."""
    b, t, heads, d = 2, 32, 4, 16
    keys = jax.random.split(jax.random.key(SEED), 3)
    q = jax.random.normal(keys[0], (b, t, heads, d), dtype)
    k, v = (jax.random.normal(key, (b, t, kv_heads, d), dtype) for key in keys[1:])

    def jaxs(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")

    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    ours, theirs = (np.asarray(jax.jit(f)(q, k, v), np.float64) for f in (xla_attention, jaxs))
    if kv_heads == heads:  # (grouped heads: one einsum here, JAX's vmapped core there, summed in another order)
        np.testing.assert_array_equal(ours, theirs)
    assert np.linalg.norm(ours - theirs) <= 1e-6 * np.linalg.norm(theirs)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a).astype(jnp.float32)))  # noqa: E731
    for ours, theirs in zip(jax.jit(jax.grad(loss(xla_attention), (0, 1, 2)))(q, k, v),
                            jax.jit(jax.grad(loss(jaxs), (0, 1, 2)))(q, k, v)):
        ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
        assert np.linalg.norm(ours - theirs) <= tolerance * np.linalg.norm(theirs)
    scores = b * heads * t * t
    inputs = sum(a.nbytes for a in (q, k, v))
    constants = scores * (1 + 4)  # the causal mask and the float32 it selects from: recomputed, or XLA's constants
    kept = _kept_bytes(xla_attention, q, k, v)
    assert kept <= inputs + constants + scores * jnp.dtype(dtype).itemsize + 4  # (+ the scale, a float32 scalar)
    assert _kept_bytes(jaxs, q, k, v) >= kept + scores * 4


def test_released_together_is_the_identity_forward_and_backward():
    """`nn.params.released_together`, which an output head's input and weight pass through where
    the step orders its weight gradient first (`Plan.head_backward_first`, XLA:GPU only): its
    values and both gradients those of the identity, to the bit."""
    keys = jax.random.split(jax.random.key(SEED), 2)
    x, w = jax.random.normal(keys[0], (4, 8)), jax.random.normal(keys[1], (8, 16))

    def loss(x, w):
        return jnp.sum(jnp.tanh(x @ w) ** 2)

    def released(x, w):
        return loss(*released_together(x, w))

    assert released(x, w) == loss(x, w)
    for got, want in zip(jax.grad(released, (0, 1))(x, w), jax.grad(loss, (0, 1))(x, w)):
        np.testing.assert_array_equal(got, want)
