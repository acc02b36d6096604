"""A Llama-family decoder whose every param and activation carries logical axis names.

    tokens (batch, seq)
      -> token embedding                                       (batch, seq, embed)
      -> L × [x += attention(rmsnorm(x)); x += swiglu(rmsnorm(x))]  blocks stacked on `layers`
      -> rmsnorm -> head (its own, or tied to the embedding)   (batch, seq, vocab)

What makes it Llama rather than GPT-2: RMSNorm without bias, rotary position embeddings on
queries and keys (no position table), a gated MLP of three matrices (SwiGLU), and grouped-
query attention: `kv_heads` key / value heads, each shared by heads / kv_heads query heads.
KV heads have their own logical name, `kv_heads`, so the rules can split them over `tensor`
as they split `heads`; where they do not divide the axis, the placement says so and how to
fix it (as for any named dim). Query head h reads KV head h // (heads / kv_heads): a block
of query heads and its KV heads land on the same device, so no KV head moves.

The stages a pipeline cuts are the GPT's (`embed`, `blocks`, `logits`), so `gpt_loss`
trains it too; `decode` and `init_cache` generate with a KV cache as the GPT's do. The cache
holds keys already rotated, and only the KV heads: grouped-query attention's saving in memory.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jshard import moe, nn
from jshard.nn.attn import ATTENTION
from jshard.moe import MoE
from jshard.models.gpt import HIDDEN, LOGITS, PER_HEAD, RESIDUAL
from jshard.models.stack import scan_layers, scan_stack, stack_layers

KV = ("batch", "seq", None, "kv_heads", "kv")  # None: the key / value dim
CACHED = ("batch", "seq", "kv_heads", "kv")  # keys or values of one layer in a KV cache


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256  # bytes
    vocab_multiple: int = 1  # the token table's rows, a multiple of this; the pad is never a token (`vocab_rows`)
    seq_len: int = 128  # longest sequence (rotary needs no table; the data and planner read it)
    embed: int = 128
    heads: int = 4
    kv_heads: int = 2
    mlp: int = 384  # the gated MLP's width (three matrices)
    layers: int = 4
    rope_theta: float = 10000.0
    # Llama 3's long-context rotary frequencies: (factor, low_freq_factor, high_freq_factor,
    # original context length); None: plain rotary. See `rotary_frequencies`.
    rope_scaling: tuple[float, float, float, int] | None = None
    tied_head: bool = False
    head_size: int | None = None  # the per-head dim, where not embed // heads (Qwen3)
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen2)
    qk_norm: bool = False  # an RMSNorm over each head's queries and keys before rotary (Qwen3)
    dtype: jnp.dtype | None = None  # compute dtype; None: the step's precision policy's (`nn.compute_dtype`)
    remat: str = "none"  # see stack.py
    attention: str = "auto"  # the kernel: auto, xla or cudnn (`jshard.nn.attn.attention_implementation`)
    norm_epsilon: float = 1e-5
    # A mixture of experts in place of each block's MLP (`jshard.moe`): `experts` SwiGLUs of
    # width `mlp`, each token routed to `top_k`; 0 experts: the dense MLP.
    experts: int = 0
    top_k: int = 2
    capacity_factor: float | None = 1.25  # slots per expert per row, over k·seq/experts; None: dropless
    balance_loss: float = 0.01  # weight of the router's load-balancing loss (its gradient)
    moe_every: int = 1  # every n-th block has the experts, the others a dense MLP (stacked n at a time)

    @property
    def vocab_rows(self) -> int:
        return nn.padded_vocab(self.vocab, self.vocab_multiple)

    @property
    def moe_layers(self) -> int:
        """Blocks with a mixture of experts."""
        return self.layers // self.moe_every if self.experts else 0

    @property
    def blocks_per_layer(self) -> int:
        """Blocks in one layer of the scanned stack: `moe_every` with experts (`Blocks`), else 1."""
        return self.moe_every if self.experts else 1

    @property
    def head_dim(self) -> int:
        return self.head_size or self.embed // self.heads

    family = "Llama"  # what reports and checkpoint records call the model

    @property
    def matmul_weights(self) -> int:
        """N of the 6·N FLOPs per token: q and out (h × heads·head_dim), k and v (h ×
        kv_heads·head_dim), the three MLP matrices (of each of the top_k experts a token goes
        to, and the router), and the head (tied or not)."""
        h = self.embed
        experts = self.moe_layers * (3 * h * self.mlp * self.top_k + h * self.experts)
        dense = (self.layers - self.moe_layers) * 3 * h * self.mlp
        attention = 2 * h * (self.heads + self.kv_heads) * self.head_dim
        return self.layers * attention + experts + dense + self.vocab * h

    def __post_init__(self):
        if isinstance(self.vocab_multiple, bool) or not isinstance(self.vocab_multiple, int) or self.vocab_multiple < 1:
            raise ValueError(f"LlamaConfig: vocab_multiple={self.vocab_multiple!r} must be an integer >= 1")
        if self.rope_scaling is not None:  # (a JSON record gives a list)
            object.__setattr__(self, "rope_scaling", tuple(self.rope_scaling))
        if self.embed % self.heads and not self.head_size:
            raise ValueError(f"LlamaConfig: embed={self.embed} must divide by heads={self.heads} (or give head_size)")
        if self.heads % self.kv_heads:
            raise ValueError(f"LlamaConfig: heads={self.heads} must divide by kv_heads={self.kv_heads}")
        if self.attention not in ATTENTION:
            raise ValueError(f"LlamaConfig: attention={self.attention!r}; choose one of {', '.join(ATTENTION)}")
        if self.experts:
            moe.check(self.experts, self.top_k, self.capacity_factor, "LlamaConfig")
        if self.moe_every < 1 or self.layers % self.moe_every:
            raise ValueError(f"LlamaConfig: layers={self.layers} must divide by moe_every={self.moe_every}")


# The published shapes (Meta's model cards and config.json), and small ones for CPUs.
LLAMA_SIZES = {
    "llama-tiny": LlamaConfig(seq_len=64, embed=64, heads=4, kv_heads=2, mlp=192, layers=2),
    "llama-small": LlamaConfig(seq_len=128, embed=128, heads=4, kv_heads=2, mlp=384, layers=4),
    "llama-3.2-1b": LlamaConfig(vocab=128256, seq_len=8192, embed=2048, heads=32, kv_heads=8, mlp=8192, layers=16,
                                rope_theta=500000.0, tied_head=True),
    "llama-3.1-8b": LlamaConfig(vocab=128256, seq_len=8192, embed=4096, heads=32, kv_heads=8, mlp=14336, layers=32,
                                rope_theta=500000.0),
    "llama-3.1-70b": LlamaConfig(vocab=128256, seq_len=8192, embed=8192, heads=64, kv_heads=8, mlp=28672, layers=80,
                                 rope_theta=500000.0),
    "llama-3.1-405b": LlamaConfig(vocab=128256, seq_len=8192, embed=16384, heads=128, kv_heads=8, mlp=53248,
                                  layers=126, rope_theta=500000.0),
    # Mixtures of experts: every block's MLP is `experts` SwiGLUs, each token routed to 2.
    "moe-tiny": LlamaConfig(seq_len=64, embed=64, heads=4, kv_heads=2, mlp=128, layers=2, experts=8),
    "mixtral-8x7b": LlamaConfig(vocab=32000, seq_len=32768, embed=4096, heads=32, kv_heads=8, mlp=14336, layers=32,
                                rope_theta=1e6, experts=8, top_k=2),
}


INIT = nnx.initializers.normal(0.02)


def rotary_frequencies(head_dim: int, theta: float, scaling: tuple | None = None) -> jax.Array:
    """theta^(-2i/head_dim) for each pair i; with Llama 3's `scaling` (factor, low, high,
    original context): wavelengths longer than original/low slowed by the factor, shorter than
    original/high kept, those between interpolated (Meta's `apply_scaling`)."""
    half = head_dim // 2
    frequencies = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None:
        return frequencies
    factor, low, high, original = scaling
    wavelength = 2 * jnp.pi / frequencies
    smooth = (original / wavelength - low) / (high - low)
    slowed = jnp.where(wavelength > original / low, frequencies / factor, frequencies)
    medium = (wavelength <= original / low) & (wavelength >= original / high)
    return jnp.where(medium, (1 - smooth) * slowed / factor + smooth * slowed, slowed)


def rotary(x: jax.Array, theta: float, first=0, positions: jax.Array | None = None,
           scaling: tuple | None = None) -> jax.Array:
    """Rotary position embedding of (batch, seq, heads, head_dim) queries or keys at `positions`
    (default first..first+seq-1), in float32: each pair (i, i + head_dim/2) turned by position ·
    `rotary_frequencies`."""
    half = x.shape[-1] // 2
    frequencies = rotary_frequencies(x.shape[-1], theta, scaling)
    positions = (first + jnp.arange(x.shape[1])) if positions is None else positions
    angles = positions.astype(jnp.float32)[:, None] * frequencies  # (seq, half)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.theta, self.scaling, self.choice = config.rope_theta, config.rope_scaling, config.attention
        linear = dict(kernel_init=INIT, dtype=config.dtype, rngs=rngs)
        self.q = nn.Linear(config.embed, (config.heads, config.head_dim), in_names="embed",
                           out_names=("heads", "kv"), bias=config.qkv_bias, **linear)
        self.kv = nn.Linear(config.embed, (2, config.kv_heads, config.head_dim), in_names="embed",
                            out_names=(None, "kv_heads", "kv"), bias=config.qkv_bias, **linear)
        self.out = nn.Linear((config.heads, config.head_dim), config.embed, in_names=("heads", "kv"),
                             out_names="embed", **linear)
        if config.qk_norm:
            norm = dict(name="kv", epsilon=config.norm_epsilon, dtype=config.dtype)
            self.q_norm, self.k_norm = nn.RMSNorm(config.head_dim, **norm), nn.RMSNorm(config.head_dim, **norm)
        else:
            self.q_norm = self.k_norm = None

    def queries_keys_values(self, x, first=None):
        """Rotated queries and keys, and values, of the normed input x: at positions first, ...
        (decoding), else at this device's share of the sequence."""
        q, kv = self.q(x, RESIDUAL), self.kv(x, RESIDUAL)
        k, v = kv[:, :, 0], kv[:, :, 1]
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        # q's positions, not x's: sequence parallelism gathers the sequence in the projection
        positions = nn.positions(q, PER_HEAD) if first is None else None
        turn = functools.partial(rotary, theta=self.theta, first=0 if first is None else first, positions=positions,
                                 scaling=self.scaling)
        return turn(q), turn(k), v

    def __call__(self, x):
        q, k, v = self.queries_keys_values(x)
        return self.out(nn.attention(q, k, v, self.choice), PER_HEAD)

    def decode(self, x, cache: nn.KVCache, position):
        q, k, v = self.queries_keys_values(x, first=position)
        cache = cache.write(k, v, position)
        return self.out(nn.cached_attention(q, cache, position), PER_HEAD), cache


class SwiGLU(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        linear = dict(kernel_init=INIT, dtype=config.dtype, rngs=rngs)
        # gate and up as one matmul: one input gradient to reduce under TP, not two
        self.gate_up = nn.Linear(config.embed, (2, config.mlp), in_names="embed", out_names=(None, "mlp"), **linear)
        self.down = nn.Linear(config.mlp, config.embed, in_names="mlp", out_names="embed", **linear)

    def __call__(self, x):
        gate_up = self.gate_up(x, RESIDUAL)
        return self.down(nn.swiglu(gate_up[:, :, 0], gate_up[:, :, 1]), HIDDEN)


def mixture(config: LlamaConfig, rngs: nnx.Rngs) -> MoE:
    return MoE(config.embed, config.mlp, config.experts, config.top_k, config.capacity_factor, config.balance_loss,
               rngs=rngs, kernel_init=INIT, dtype=config.dtype)


class Block(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        norm = dict(epsilon=config.norm_epsilon, dtype=config.dtype)
        self.attn_norm, self.attn = nn.RMSNorm(config.embed, **norm), Attention(config, rngs=rngs)
        self.mlp_norm = nn.RMSNorm(config.embed, **norm)
        self.mlp = mixture(config, rngs) if config.experts else SwiGLU(config, rngs=rngs)

    def __call__(self, x):
        return self.forward(x)[0]

    def forward(self, x):
        """(the block's output, its router statistics: None for a dense MLP)."""
        x = x + self.attn(self.attn_norm(x))
        if isinstance(self.mlp, MoE):
            y, stats = self.mlp.forward(self.mlp_norm(x), RESIDUAL)
            return x + y, stats
        return x + self.mlp(self.mlp_norm(x)), None

    def decode(self, x, cache: nn.KVCache, position):
        y, cache = self.attn.decode(self.attn_norm(x), cache, position)
        x = x + y
        # Generation routes without dropping (each token to all its k experts), as inference does.
        mlp = functools.partial(self.mlp, dropless=True) if isinstance(self.mlp, MoE) else self.mlp
        return x + mlp(self.mlp_norm(x)), cache


class Blocks(nnx.Module):
    """`moe_every` blocks stacked as one layer of the stack: a dense MLP in all but the last,
    which has the mixture of experts (at 2: every other block, as GShard's and Switch's)."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        dense = dataclasses.replace(config, experts=0)
        self.dense = nnx.List([Block(dense, rngs=rngs) for _ in range(config.moe_every - 1)])
        self.moe = Block(config, rngs=rngs)

    def __call__(self, x):
        return self.forward(x)[0]

    def forward(self, x):
        for block in self.dense:
            x = block(x)
        return self.moe.forward(x)

    def decode(self, x, cache: nn.KVCache, position):
        """`cache` holds one layer of KV cache per block, on a leading dim."""
        written = []
        for i, block in enumerate([*self.dense, self.moe]):
            x, layer = block.decode(x, jax.tree.map(lambda a: a[i], cache), position)
            written.append(layer)
        return x, jax.tree.map(lambda *layers: jnp.stack(layers), *written)


class Llama(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.token_embed = nn.Embed(config.vocab_rows, config.embed, names=("vocab", "embed"),
                                    embedding_init=INIT, dtype=config.dtype, rngs=rngs, tied=config.tied_head)
        per_layer = config.blocks_per_layer
        layer = Blocks if per_layer > 1 else Block
        self.blocks = stack_layers(lambda rngs: layer(config, rngs=rngs), config.layers // per_layer, rngs, config.remat)
        self.final_norm = nn.RMSNorm(config.embed, epsilon=config.norm_epsilon, dtype=config.dtype)
        if not config.tied_head:
            self.head = nn.Linear(config.embed, config.vocab_rows, in_names="embed", out_names="vocab",
                                  kernel_init=INIT, dtype=config.dtype, rngs=rngs, fp8=False)

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token embeddings (batch, seq, embed) of int tokens (batch, seq); positions are rotary."""
        if tokens.shape[1] > self.config.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than seq_len={self.config.seq_len}")
        return self.token_embed(tokens, ("batch", "seq"), RESIDUAL)

    def logits(self, x: jax.Array) -> jax.Array:
        """(batch, seq, vocab) logits of the last block's output."""
        x = self.final_norm(x)
        logits = self.token_embed.attend(x, RESIDUAL) if self.config.tied_head else self.head(x, RESIDUAL)
        return nn.without_padded_vocab(logits, self.config.vocab, LOGITS)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits (batch, seq, vocab) for int tokens (batch, seq)."""
        return self.logits(scan_layers(self.blocks, self.embed(tokens)))

    def router_stats(self, tokens: jax.Array) -> dict:
        """Each MoE layer's router statistics on int tokens (batch, seq), stacked on a leading
        layers dim: `balance` (the load-balancing loss), `load` (layers, experts: the fraction
        of token choices each expert got) and `dropped` (the fraction past capacity)."""
        if not self.config.experts:
            raise ValueError("router_stats: this Llama has no mixture of experts (experts=0)")
        return scan_stack(self.blocks, self.embed(tokens), lambda x, block: block.forward(x))[1]

    def init_cache(self, batch: int, length: int | None = None) -> nn.KVCache:
        """As the GPT's: an empty KV cache for `batch` sequences of up to `length` tokens, of the KV heads only."""
        c = self.config
        return nn.KVCache.zeros(c.layers, batch, length or c.seq_len, c.kv_heads, c.head_dim, CACHED, nn.compute_dtype(c.dtype))

    def decode(self, tokens: jax.Array, cache: nn.KVCache, position) -> tuple[jax.Array, nn.KVCache]:
        """As the GPT's `decode`: logits of new tokens at positions position, ..., and the cache
        with their (rotated) keys and values added."""
        x = self.token_embed(tokens, ("batch", "seq"), RESIDUAL)
        per_layer = self.config.blocks_per_layer
        stacked = jax.tree.map(lambda a: a.reshape(a.shape[0] // per_layer, per_layer, *a.shape[1:]), cache)
        x, stacked = scan_stack(self.blocks, x, lambda x, block, cache: block.decode(x, cache, position),
                                stacked if per_layer > 1 else cache)
        cache = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stacked) if per_layer > 1 else stacked
        return self.logits(x), cache
