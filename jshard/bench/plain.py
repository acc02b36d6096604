"""The plain Flax NNX models `jshard bench step` times jshard against: jshard's GPT and Llama
as a Flax user would write them, with Flax's own layers (no jshard layer, rule or step),
layers stacked with `nnx.vmap` and run with `nnx.scan` (Flax's pattern for deep models, as
jshard's are). Attribute names and kernel shapes are jshard's, so `plain_from` loads a
jshard model's weights and the two compute the same function.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jshard.models import GPTConfig, LlamaConfig
from jshard.models.llama import rotary
from jshard.nn.attn import attention_implementation

INIT = nnx.initializers.normal(0.02)


class GPTBlock(nnx.Module):
    """jshard's GPT block: pre-LayerNorm, fused qkv, GELU MLP."""

    def __init__(self, config: GPTConfig, *, rngs: nnx.Rngs):
        heads, dtype = (config.heads, config.head_dim), config.dtype
        self.implementation = attention_implementation(config.attention, dtype, config.head_dim)  # jshard's kernel
        self.attn_norm = nnx.LayerNorm(config.embed, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.qkv = nnx.LinearGeneral(config.embed, (3, *heads), use_bias=False, kernel_init=INIT, dtype=dtype, rngs=rngs)
        self.out = nnx.LinearGeneral(heads, config.embed, axis=(-2, -1), use_bias=False, kernel_init=INIT,
                                     dtype=dtype, rngs=rngs)
        self.mlp_norm = nnx.LayerNorm(config.embed, epsilon=1e-6, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(config.embed, config.mlp, use_bias=False, kernel_init=INIT, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(config.mlp, config.embed, use_bias=False, kernel_init=INIT, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        qkv = self.qkv(self.attn_norm(x))
        x = x + self.out(jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], is_causal=True,
                                                      implementation=self.implementation))
        return x + self.down(jax.nn.gelu(self.up(self.mlp_norm(x))))


class LlamaBlock(nnx.Module):
    """jshard's Llama block: pre-RMSNorm, rotary q and k, grouped KV heads, SwiGLU."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
        heads, dtype, self.theta = (config.heads, config.head_dim), config.dtype, config.rope_theta
        self.implementation = attention_implementation(config.attention, dtype, config.head_dim)  # jshard's kernel
        linear = dict(use_bias=False, kernel_init=INIT, dtype=dtype, rngs=rngs)
        self.attn_norm = nnx.RMSNorm(config.embed, epsilon=config.norm_epsilon, dtype=dtype, rngs=rngs)
        self.q = nnx.LinearGeneral(config.embed, heads, **linear)
        self.kv = nnx.LinearGeneral(config.embed, (2, config.kv_heads, config.head_dim), **linear)
        self.out = nnx.LinearGeneral(heads, config.embed, axis=(-2, -1), **linear)
        self.mlp_norm = nnx.RMSNorm(config.embed, epsilon=config.norm_epsilon, dtype=dtype, rngs=rngs)
        self.gate_up = nnx.LinearGeneral(config.embed, (2, config.mlp), **linear)
        self.down = nnx.Linear(config.mlp, config.embed, **linear)

    def __call__(self, x):
        h = self.attn_norm(x)
        kv = self.kv(h)
        q, k = rotary(self.q(h), self.theta), rotary(kv[:, :, 0], self.theta)
        x = x + self.out(jax.nn.dot_product_attention(q, k, kv[:, :, 1], is_causal=True,
                                                      implementation=self.implementation))
        gate_up = self.gate_up(self.mlp_norm(x))
        return x + self.down(jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1])


class PlainDecoder(nnx.Module):
    """Token embedding (+ a learned position table for the GPT), stacked blocks, final norm, head."""

    def __init__(self, config: GPTConfig | LlamaConfig, *, rngs: nnx.Rngs):
        gpt, dtype = isinstance(config, GPTConfig), config.dtype
        self.token_embed = nnx.Embed(config.vocab, config.embed, embedding_init=INIT, dtype=dtype, rngs=rngs)
        self.pos_embed = nnx.Embed(config.seq_len, config.embed, embedding_init=INIT, dtype=dtype,
                                   rngs=rngs) if gpt else None

        @nnx.split_rngs(splits=config.layers)
        @nnx.vmap(in_axes=0, out_axes=0)
        def make_blocks(rngs):
            return (GPTBlock if gpt else LlamaBlock)(config, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.final_norm = (nnx.LayerNorm(config.embed, epsilon=1e-6, dtype=dtype, rngs=rngs) if gpt
                           else nnx.RMSNorm(config.embed, epsilon=config.norm_epsilon, dtype=dtype, rngs=rngs))
        self.head = None if config.tied_head else nnx.Linear(config.embed, config.vocab, use_bias=False,
                                                              kernel_init=INIT, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        x = self.token_embed(tokens)
        if self.pos_embed is not None:
            x = x + self.pos_embed(jnp.arange(tokens.shape[1]))

        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run_blocks(x, block):
            return block(x)

        x = self.final_norm(run_blocks(x, self.blocks))
        return self.token_embed.attend(x) if self.head is None else self.head(x)


def plain_loss(model: PlainDecoder, tokens) -> jax.Array:
    """Next-token cross-entropy on (batch, seq+1) tokens, in float32 (as `gpt_loss`)."""
    logits = model(tokens[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def plain_from(model, compute) -> PlainDecoder:
    """A PlainDecoder holding a copy of jshard `model`'s weights, computing in `compute` (plain
    Flax layers have no step to take it from). jshard's blocks nest their linears one level
    deeper (`attn.qkv`, `mlp.up`); the plain block holds them directly."""
    plain = PlainDecoder(dataclasses.replace(model.config, dtype=compute), rngs=nnx.Rngs(0))
    # Copies: jshard's step donates the model's arrays.
    weights = jax.tree.map(jnp.copy, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    blocks = weights["blocks"]
    weights["blocks"] = {**{k: v for k, v in blocks.items() if k not in ("attn", "mlp")},
                         **blocks["attn"], **blocks["mlp"]}
    state = nnx.state(plain, nnx.Param)
    nnx.replace_by_pure_dict(state, weights)
    nnx.update(plain, state)
    return plain
