"""`backward.keep`: a call's backward from what its forward kept, split into B and W."""

import jax
import jax.numpy as jnp
import numpy as np

from jshard.parallel import backward


def layer(params, inputs):
    x, = inputs
    causal = jnp.tril(jnp.ones((x.shape[0], x.shape[0]), bool))  # depends on no input
    h = jnp.tanh(jnp.where(causal, x @ x.T, 0.0) @ x @ params["w1"])
    return x + h @ params["w2"]


def test_split_backward_equals_the_whole():
    rng = np.random.default_rng(0)
    params = {"w1": jnp.asarray(rng.standard_normal((8, 16)), jnp.float32),
              "w2": jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)}
    x = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    g = jnp.asarray(rng.standard_normal((4, 8)), jnp.float32)
    found = {}

    @jax.jit
    def split(params, x, g):
        out, saved, found["backward"] = backward.keep(layer, params, (x,))
        known = jax.tree.leaves(params)
        (gx,), crossover = found["backward"].b(known, saved, g)
        return out, gx, found["backward"].w(known, saved, crossover)

    out, gx, gw = split(params, x, g)
    @jax.jit
    def whole(params, x, g):
        out, pull = jax.vjp(layer, params, (x,))
        return out, *pull(g)

    expected, expected_gw, (expected_gx,) = whole(params, x, g)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gx, expected_gx, rtol=1e-4, atol=1e-4)
    for got, want in zip(gw, jax.tree.leaves(expected_gw)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    kept = found["backward"]
    # Neither a weight nor the mask is buffered: the weights are known, the mask recomputed.
    assert all(s.shape not in ((8, 16), (16, 8), (4, 4)) or s.dtype != jnp.bool_ for s in kept.saved)
    assert not any(s.shape in ((8, 16), (16, 8)) for s in kept.saved)
    assert any(kind == "constant" for kind, _ in kept.sources)
    # W reads from B what a weight gradient needs, and B computes no weight gradient.
    assert kept.crossover and not any(
        v in kept.b_jaxpr.outvars for v in kept.jaxpr.outvars[:2])
