"""A GPT-style decoder whose every param and activation carries logical axis names.

    tokens (batch, seq)
      -> token + position embeddings                      (batch, seq, embed)
      -> L × [x += attention(norm(x)); x += mlp(norm(x))]  blocks stacked on `layers`
      -> norm -> head (tied to the token embedding, or its own)  (batch, seq, vocab)

`decode` is the same forward for new tokens at later positions, reading the keys and values
of the earlier ones from a KV cache (`init_cache`) and writing theirs: generation runs the
prompt through it once, then one token per call (`jshard.app.generation`).

The layers are `jshard.nn`'s: each is told the names of its input and knows those of its
weights, so the same code runs on one device, under the compiler's sharding, and in a
jshard step whose collectives follow from the rules. Linears have no bias (as in most
current LLMs) unless `bias` (GPT-2's, for its checkpoints: `jshard.app.hf`); the blocks are stacked on a leading `layers` axis (see `stack.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jshard import nn
from jshard.nn.attn import ATTENTION
from jshard.models.stack import StagedLoss, scan_layers, scan_stack, stack_layers

RESIDUAL = ("batch", "seq", "embed")
QKV = ("batch", "seq", None, "heads", "kv")  # None: the query / key / value dim
PER_HEAD = ("batch", "seq", "heads", "kv")
HIDDEN = ("batch", "seq", "mlp")
LOGITS = ("batch", "seq", "vocab")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256  # bytes
    vocab_multiple: int = 1  # the token table's rows, a multiple of this; the pad is never a token (`vocab_rows`)
    seq_len: int = 128  # longest sequence (position embeddings)
    embed: int = 128
    heads: int = 4
    mlp: int = 512
    layers: int = 4
    tied_head: bool = True
    dtype: jnp.dtype | None = None  # compute dtype; None: the step's precision policy's (`nn.compute_dtype`)
    remat: str = "none"  # activation checkpointing of each block: none, full or selective (see stack.py)
    attention: str = "auto"  # the kernel: auto, xla or cudnn (`jshard.nn.attn.attention_implementation`)
    bias: bool = False  # biases on every Linear (GPT-2's)
    norm_epsilon: float = 1e-6  # the LayerNorms' (GPT-2: 1e-5)

    @property
    def vocab_rows(self) -> int:
        return nn.padded_vocab(self.vocab, self.vocab_multiple)

    @property
    def head_dim(self) -> int:
        return self.embed // self.heads

    family = "GPT"  # what reports call the model
    blocks_per_layer = 1  # blocks in one layer of the scanned stack (a MoE Llama's may hold more)

    @property
    def matmul_weights(self) -> int:
        """N of the 6·N FLOPs per token: attention and MLP matrices, and the head (tied or not)."""
        h = self.embed
        return self.layers * (4 * h * h + 2 * h * self.mlp) + self.vocab * h

    def __post_init__(self):
        if isinstance(self.vocab_multiple, bool) or not isinstance(self.vocab_multiple, int) or self.vocab_multiple < 1:
            raise ValueError(f"GPTConfig: vocab_multiple={self.vocab_multiple!r} must be an integer >= 1")
        if self.embed % self.heads:
            raise ValueError(f"GPTConfig: embed={self.embed} must divide by heads={self.heads}")
        if self.attention not in ATTENTION:
            raise ValueError(f"GPTConfig: attention={self.attention!r}; choose one of {', '.join(ATTENTION)}")


# Named sizes, for every command's --model (with the Llamas: `models.SIZES`). `seq_len` is
# the longest sequence (position embeddings). gpt-1b: ~1 B params (18 layers of 50.3 M + a
# 103 M tied embedding), head dim 128 as fused attention kernels like it.
GPT_SIZES = {
    "tiny": GPTConfig(seq_len=64, embed=64, heads=4, mlp=256, layers=2),
    "small": GPTConfig(seq_len=128, embed=128, heads=4, mlp=512, layers=4),
    "base": GPTConfig(seq_len=1024, embed=768, heads=12, mlp=3072, layers=12),  # GPT-2 small's shape
    "gpt-125m": GPTConfig(vocab=50304, seq_len=1024, embed=768, heads=12, mlp=3072, layers=12),
    "gpt-1b": GPTConfig(vocab=50304, seq_len=2048, embed=2048, heads=16, mlp=8192, layers=18),
}


def _init(config: GPTConfig, residual_out: bool = False):
    # GPT-2: normal(0.02); projections into the residual stream scaled by 1/sqrt(2·layers).
    return nnx.initializers.normal(0.02 / (2 * config.layers) ** 0.5 if residual_out else 0.02)


class Attention(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        heads, self.choice = (config.heads, config.head_dim), config.attention
        self.qkv = nn.Linear(
            config.embed, (3, *heads), in_names="embed", out_names=(None, "heads", "kv"),
            kernel_init=_init(config), bias=config.bias, dtype=config.dtype, rngs=rngs,
        )
        self.out = nn.Linear(
            heads, config.embed, in_names=("heads", "kv"), out_names="embed",
            kernel_init=_init(config, residual_out=True), bias=config.bias, dtype=config.dtype, rngs=rngs,
        )

    def __call__(self, x):
        qkv = self.qkv(x, RESIDUAL)
        y = nn.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], self.choice)
        return self.out(y, PER_HEAD)

    def decode(self, x, cache: nn.KVCache, position):
        qkv = self.qkv(x, RESIDUAL)
        cache = cache.write(qkv[:, :, 1], qkv[:, :, 2], position)
        return self.out(nn.cached_attention(qkv[:, :, 0], cache, position), PER_HEAD), cache


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.up = nn.Linear(
            config.embed, config.mlp, in_names="embed", out_names="mlp",
            kernel_init=_init(config), bias=config.bias, dtype=config.dtype, rngs=rngs,
        )
        self.down = nn.Linear(
            config.mlp, config.embed, in_names="mlp", out_names="embed",
            kernel_init=_init(config, residual_out=True), bias=config.bias, dtype=config.dtype, rngs=rngs,
        )

    def __call__(self, x):
        return self.down(nn.gelu(self.up(x, RESIDUAL)), HIDDEN)


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        norm = dict(epsilon=config.norm_epsilon, dtype=config.dtype)
        self.attn_norm, self.attn = nn.LayerNorm(config.embed, **norm), Attention(config, rngs=rngs)
        self.mlp_norm, self.mlp = nn.LayerNorm(config.embed, **norm), MLP(config, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))

    def decode(self, x, cache: nn.KVCache, position):
        y, cache = self.attn.decode(self.attn_norm(x), cache, position)
        x = x + y
        return x + self.mlp(self.mlp_norm(x)), cache


class GPT(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.config = config
        embed = dict(embedding_init=_init(config), dtype=config.dtype, rngs=rngs)
        self.token_embed = nn.Embed(config.vocab_rows, config.embed, names=("vocab", "embed"), tied=config.tied_head,
                                    **embed)
        self.pos_embed = nn.Embed(config.seq_len, config.embed, names=("seq", "embed"), **embed)
        self.blocks = stack_layers(lambda rngs: Block(config, rngs=rngs), config.layers, rngs, config.remat)
        self.final_norm = nn.LayerNorm(config.embed, epsilon=config.norm_epsilon, dtype=config.dtype)
        if not config.tied_head:
            self.head = nn.Linear(
                config.embed, config.vocab_rows, in_names="embed", out_names="vocab",
                kernel_init=_init(config), dtype=config.dtype, rngs=rngs, fp8=False,
            )

    def embed(self, tokens: jax.Array) -> jax.Array:
        """Token + position embeddings (batch, seq, embed) of int tokens (batch, seq)."""
        length = tokens.shape[1]
        if length > self.config.seq_len:
            raise ValueError(f"sequence of {length} tokens is longer than seq_len={self.config.seq_len}")
        x = self.token_embed(tokens, ("batch", "seq"), RESIDUAL)
        return x + self.pos_embed(jnp.arange(length), ("seq",), RESIDUAL[1:])

    def logits(self, x: jax.Array) -> jax.Array:
        """(batch, seq, vocab) logits of the last block's output."""
        x = self.final_norm(x)
        logits = self.token_embed.attend(x, RESIDUAL) if self.config.tied_head else self.head(x, RESIDUAL)
        return nn.without_padded_vocab(logits, self.config.vocab, LOGITS)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits (batch, seq, vocab) for int tokens (batch, seq)."""
        return self.logits(scan_layers(self.blocks, self.embed(tokens)))

    def init_cache(self, batch: int, length: int | None = None) -> nn.KVCache:
        """An empty KV cache for `batch` sequences of up to `length` tokens (default: seq_len).
        Each token attends over the whole cache, masked: a cache no longer than the text reads less."""
        c = self.config
        return nn.KVCache.zeros(c.layers, batch, length or c.seq_len, c.heads, c.head_dim, PER_HEAD, nn.compute_dtype(c.dtype))

    def decode(self, tokens: jax.Array, cache: nn.KVCache, position) -> tuple[jax.Array, nn.KVCache]:
        """Logits (batch, new, vocab) of int tokens (batch, new) at positions position, ...,
        given the cache of every earlier position; and the cache with theirs added. The
        caller keeps position + new <= seq_len (`position` may be traced: no check here)."""
        x = self.token_embed(tokens, ("batch", "seq"), RESIDUAL)
        x = x + self.pos_embed(position + jnp.arange(tokens.shape[1]), ("seq",), RESIDUAL[1:])
        x, cache = scan_stack(self.blocks, x, lambda x, block, cache: block.decode(x, cache, position), cache)
        return self.logits(x), cache


# Next-token cross-entropy on (batch, seq+1) tokens, in float32; staged for pipelines.
gpt_loss = StagedLoss(
    first=lambda model, tokens: model.embed(tokens[:, :-1]),
    layers=lambda model: model.blocks,
    last=lambda model, x, tokens: nn.cross_entropy(model.logits(x), tokens[:, 1:], LOGITS),
)
