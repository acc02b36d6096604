"""Attention's softmax, keeping only its output for backward.

jax.nn.softmax is differentiated (unless JAX's `jax_softmax_custom_jvp` is set) through its exp
and its division, so backward keeps float32 copies of both, each the size of the scores. The
softmax's derivative needs its output alone, dx = p · (dp - Σ p · dp), which is what
`probabilities` keeps, in the dtype the next matmul reads them in (Megatron's fused softmax
keeps its output so too): one array of the scores' size, 2 bytes a score in bf16, not 6 or more.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def probabilities(scores: jax.Array, dtype) -> jax.Array:
    """softmax(scores) over the last axis, in float32 as jax.nn.softmax computes it, cast to
    `dtype`; its backward reads these probabilities alone."""
    unnormalized = jnp.exp(scores - jnp.max(scores, -1, keepdims=True))
    return (unnormalized / jnp.sum(unnormalized, -1, keepdims=True)).astype(dtype)


def _forward(scores, dtype):
    p = probabilities(scores, dtype)
    return p, p


def _backward(dtype, p, dp):
    p, dp = p.astype(jnp.float32), dp.astype(jnp.float32)
    return (p * (dp - jnp.sum(p * dp, -1, keepdims=True)),)


probabilities.defvjp(_forward, _backward)
