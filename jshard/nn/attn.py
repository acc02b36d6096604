"""Attention's kernel: which one runs (`attention_implementation`), causal attention over a
whole or context-split sequence (`attention`), and decoding over a KV cache (`KVCache`,
`cached_attention`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jshard.nn.context_parallel import context_attention, context_axes
from jshard.nn.flash import causal_flash_attention, check_pallas
from jshard.nn.softmax import probabilities
from jshard.nn.step_context import compiled_for
from jshard.rules import constrain


ATTENTION = ("auto", "xla", "cudnn", "pallas")


def attention_implementation(choice: str, dtype, head_dim: int, platform: str | None = None) -> str:
    """Which kernel `attention` runs: "xla" (XLA's: keeps the seq × seq scores for backward),
    "cudnn" (cuDNN's fused flash kernel: no scores kept) or "pallas" (jshard's own flash kernel,
    `nn.flash`: no scores kept; a GPU's, through Triton). cuDNN
    needs a GPU, bf16 or fp16, and a head dim <= 128 and a multiple of 8; "auto" takes it where
    those hold (JAX's own default is XLA everywhere). `platform`: given (the planner gives its
    hardware profile's), or the one the step in force is compiled for (a deviceless GPU
    compile's on a CPU host), or this host's default backend."""
    platform = platform or compiled_for()
    fits = platform == "gpu" and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim <= 128 and head_dim % 8 == 0
    if choice not in ATTENTION:
        raise ValueError(f"attention {choice!r}: choose one of {', '.join(ATTENTION)}")
    if choice == "cudnn" and not fits:
        raise ValueError(
            f"attention 'cudnn' needs a GPU, bf16 or fp16 and a head dim <= 128 and a multiple of 8; here: "
            f"{platform}, {jnp.dtype(dtype).name}, head dim {head_dim}. Fix: attention 'auto' or 'xla'.")
    if choice == "pallas":
        check_pallas(head_dim, platform)
    return "cudnn" if choice == "auto" and fits else "xla" if choice == "auto" else choice


def attention(q: jax.Array, k: jax.Array, v: jax.Array, choice: str = "auto") -> jax.Array:
    """Causal attention of (batch, seq, heads, head_dim) queries over (batch, seq, kv_heads,
    head_dim) keys and values (kv_heads dividing heads: grouped-query), by `choice`'s kernel.

    Inside a step whose rules split attention's `seq` (context parallelism), each device holds
    chunks of the sequence and attends over every device's keys and values: `context_attention`
    (which runs this kernel over the whole sequence under all-to-all CP, and `choice`'s block
    kernel, `context_parallel.block_kernel`, under the ring and all-gathered keys)."""
    if context_axes():
        return context_attention(q, k, v, lambda q, k, v: whole_sequence_attention(q, k, v, choice), choice)
    return whole_sequence_attention(q, k, v, choice)


def whole_sequence_attention(q: jax.Array, k: jax.Array, v: jax.Array, choice: str) -> jax.Array:
    """Causal attention over every position of the sequence, by `choice`'s kernel."""
    kernel = attention_implementation(choice, q.dtype, q.shape[-1])
    if kernel == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    if kernel == "pallas":
        return causal_flash_attention(q, k, v)
    return xla_attention(q, k, v)


# -- XLA's kernel, keeping one score-sized array for backward ---------------------------------


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """`jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")`: the same
    forward (float32 scores, mask and softmax; to the bit where heads are not grouped, whose
    products are summed in another order here), but backward keeps only the probabilities, in
    the compute dtype (`nn.softmax.probabilities`): XLA:GPU keeps 1.9 bytes a score in bf16
    where JAX's kernel keeps 5.6. Grouped-query heads are one grouped einsum (JAX vmaps its
    core over the group)."""
    # Not cp's `context._scores`: JAX's order (scale, then a finite mask) keeps this bit-exact to
    # JAX's kernel; cp's mask varies over devices (`vma.where`) and masks with -inf.
    b, t, heads, d = q.shape
    kv_heads = k.shape[2]
    grouped = q.reshape(b, t, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, k, preferred_element_type=jnp.float32)
    scores = scores * jnp.array(1.0 / np.sqrt(d), scores.dtype)
    causal = jnp.tril(jnp.ones((t, k.shape[1]), bool))
    scores = jnp.where(causal, scores, jnp.array(-0.7 * np.finfo(np.float32).max, scores.dtype))
    out = jnp.einsum("bkgts,bskd->btkgd", probabilities(scores, v.dtype), v)
    return out.reshape(b, t, heads, d)


# -- decoding with a KV cache -------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """The keys and values of the positions a decoder has seen, so that each new token costs
    one token's work: (batch, length, kv heads, head_dim) each for one attention layer, with
    a leading `layers` dim for a stack of them (scanned with the layers). Laid out by the
    rules as `names` say (one layer's names: batch, seq, the heads' name, kv), so a tensor-
    parallel model keeps each device's heads' keys and values on that device. Positions not
    yet written hold zeros; `cached_attention` masks them."""

    k: jax.Array
    v: jax.Array
    names: tuple = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def zeros(cls, layers: int, batch: int, length: int, heads: int, head_dim: int, names, dtype) -> KVCache:
        def empty():
            return constrain(jnp.zeros((layers, batch, length, heads, head_dim), dtype), ("layers", *names))

        return cls(empty(), empty(), tuple(names))

    def write(self, k: jax.Array, v: jax.Array, position: jax.Array) -> KVCache:
        """With the keys and values (batch, new, heads, head_dim) of new tokens stored at
        positions position, position + 1, ... (one layer's cache)."""

        def put(cache, new):
            cache = lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), position, axis=1)
            return constrain(cache, self.names)

        return KVCache(put(self.k, k), put(self.v, v), self.names)


def cached_attention(q: jax.Array, cache: KVCache, position: jax.Array) -> jax.Array:
    """Causal attention of new queries (batch, new, heads, head_dim) at positions position, ...
    over a cache that holds their own keys and values and those of every earlier position;
    each query sees the positions up to its own (grouped-query as `attention`). XLA's kernel:
    the mask over the cache's fixed length keeps one compiled program for every position."""
    seen = (position + jnp.arange(q.shape[1]))[:, None] >= jnp.arange(cache.k.shape[1])
    return jax.nn.dot_product_attention(q, cache.k, cache.v, mask=seen[None, None], implementation="xla")
