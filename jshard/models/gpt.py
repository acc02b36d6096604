"""A GPT-style decoder whose every param and activation carries logical axis names.

    tokens (batch, seq)
      -> token + position embeddings                      (batch, seq, embed)
      -> L × [x += attention(norm(x)); x += mlp(norm(x))]  blocks stacked on `layers`
      -> norm -> head (tied to the token embedding, or its own)  (batch, seq, vocab)

Linears have no bias (as in most current LLMs), so every param has a dim the rules can
shard. The blocks are stacked on a leading `layers` axis (see `stack.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jshard.models.stack import scan_layers, stack_layers
from jshard.rules import constrain, named

RESIDUAL = ("batch", "seq", "embed")
PER_HEAD = ("batch", "seq", "heads", "kv")


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab: int = 256  # bytes
    seq_len: int = 128  # longest sequence (position embeddings)
    embed: int = 128
    heads: int = 4
    mlp: int = 512
    layers: int = 4
    tied_head: bool = True
    dtype: jnp.dtype = jnp.float32  # compute dtype; params stay float32

    @property
    def head_dim(self) -> int:
        return self.embed // self.heads

    def __post_init__(self):
        if self.embed % self.heads:
            raise ValueError(f"GPTConfig: embed={self.embed} must divide by heads={self.heads}")


def _init(config: GPTConfig, residual_out: bool = False):
    # GPT-2: normal(0.02); projections into the residual stream scaled by 1/sqrt(2·layers).
    return nnx.initializers.normal(0.02 / (2 * config.layers) ** 0.5 if residual_out else 0.02)


class Attention(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        def project_in():
            return nnx.LinearGeneral(
                config.embed, (config.heads, config.head_dim), use_bias=False, dtype=config.dtype,
                kernel_init=_init(config), kernel_metadata=named("embed", "heads", "kv"), rngs=rngs,
            )

        self.query, self.key, self.value = project_in(), project_in(), project_in()
        self.out = nnx.LinearGeneral(
            (config.heads, config.head_dim), config.embed, axis=(-2, -1), use_bias=False,
            dtype=config.dtype, kernel_init=_init(config, residual_out=True),
            kernel_metadata=named("heads", "kv", "embed"), rngs=rngs,
        )

    def __call__(self, x):
        q, k, v = (constrain(proj(x), PER_HEAD) for proj in (self.query, self.key, self.value))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return constrain(self.out(constrain(y, PER_HEAD)), RESIDUAL)


class MLP(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.up = nnx.Linear(
            config.embed, config.mlp, use_bias=False, dtype=config.dtype, kernel_init=_init(config),
            kernel_metadata=named("embed", "mlp"), rngs=rngs,
        )
        self.down = nnx.Linear(
            config.mlp, config.embed, use_bias=False, dtype=config.dtype,
            kernel_init=_init(config, residual_out=True), kernel_metadata=named("mlp", "embed"), rngs=rngs,
        )

    def __call__(self, x):
        h = constrain(jax.nn.gelu(self.up(x)), ("batch", "seq", "mlp"))
        return constrain(self.down(h), RESIDUAL)


def _norm(config: GPTConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(
        config.embed, dtype=config.dtype, scale_metadata=named("embed"), bias_metadata=named("embed"), rngs=rngs
    )


class Block(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.attn_norm, self.attn = _norm(config, rngs), Attention(config, rngs=rngs)
        self.mlp_norm, self.mlp = _norm(config, rngs), MLP(config, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nnx.Module):
    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        self.config = config
        embed = dict(dtype=config.dtype, embedding_init=_init(config), rngs=rngs)
        self.token_embed = nnx.Embed(config.vocab, config.embed, embedding_metadata=named("vocab", "embed"), **embed)
        self.pos_embed = nnx.Embed(config.seq_len, config.embed, embedding_metadata=named("seq", "embed"), **embed)

        self.blocks = stack_layers(lambda rngs: Block(config, rngs=rngs), config.layers, rngs)
        self.final_norm = _norm(config, rngs)
        if not config.tied_head:
            self.head = nnx.Linear(
                config.embed, config.vocab, use_bias=False, dtype=config.dtype, kernel_init=_init(config),
                kernel_metadata=named("embed", "vocab"), rngs=rngs,
            )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Logits (batch, seq, vocab) for int tokens (batch, seq)."""
        if tokens.shape[1] > self.config.seq_len:
            raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than seq_len={self.config.seq_len}")
        x = self.token_embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1]))
        x = constrain(x, RESIDUAL)
        x = self.final_norm(scan_layers(self.blocks, x))
        logits = self.token_embed.attend(x) if self.config.tied_head else self.head(x)
        return constrain(logits, ("batch", "seq", "vocab"))


def gpt_loss(model: GPT, tokens: jax.Array) -> jax.Array:
    """Next-token cross-entropy on (batch, seq+1) tokens, in float32."""
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
