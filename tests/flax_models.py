"""Models written as the Flax NNX docs write them, nothing from jshard but logical names
(`kernel_metadata=jshard.named(...)`): what a new user brings to jshard's steps. The stacked
transformer also stacks its blocks with `jshard.models.stack_layers`, which a pipeline needs.

Each entry of `MODELS` gives the model, its loss and fresh random batches for a seed.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jshard
from jshard import nn
from jshard.models.stack import StagedLoss, stack_layers

BATCH = 16  # rows per batch: splits over every test mesh's batch axes


class MLP(nnx.Module):
    """Two nnx.Linear layers, kernels named, biases unnamed (replicated)."""

    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.0):
        self.up = nnx.Linear(16, 64, kernel_metadata=jshard.named("embed", "mlp"), rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.down = nnx.Linear(64, 16, kernel_metadata=jshard.named("mlp", "embed"), rngs=rngs)

    def __call__(self, x):
        return self.down(self.drop(jax.nn.relu(self.up(x))))


def mse_loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


def regression_batches(seed: int, count: int):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((BATCH, 16), dtype=np.float32), rng.standard_normal((BATCH, 16), dtype=np.float32))
            for _ in range(count)]


class CNN(nnx.Module):
    """The Flax NNX docs' MNIST CNN, smaller: conv, BatchNorm, dropout, pooling, a linear head."""

    def __init__(self, rngs: nnx.Rngs, dropout: float = 0.1):
        # Kernels are (height, width, in channels, out channels); no conv bias before a BatchNorm.
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), use_bias=False,
                              kernel_metadata=jshard.named(None, None, None, "mlp"), rngs=rngs)
        self.bn1 = nnx.BatchNorm(8, rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), use_bias=False,
                              kernel_metadata=jshard.named(None, None, "mlp", "embed"), rngs=rngs)
        self.bn2 = nnx.BatchNorm(16, rngs=rngs)
        self.dropout = nnx.Dropout(dropout, rngs=rngs)
        self.head = nnx.Linear(16 * 4 * 4, 10, kernel_metadata=jshard.named("embed", None), rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(jax.nn.relu(self.bn1(self.conv1(x))), window_shape=(2, 2), strides=(2, 2))
        x = nnx.avg_pool(jax.nn.relu(self.bn2(self.conv2(x))), window_shape=(2, 2), strides=(2, 2))
        return self.head(self.dropout(x.reshape(x.shape[0], -1)))


def classification_loss(model, batch):
    images, labels = batch
    logits = model(images)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1))


def image_batches(seed: int, count: int):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((BATCH, 16, 16, 1), dtype=np.float32), rng.integers(0, 10, BATCH))
            for _ in range(count)]


class Block(nnx.Module):
    """Pre-norm attention and MLP of plain Flax layers."""

    def __init__(self, embed: int, heads: int, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(embed, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(
            heads, embed, decode=False, use_bias=False, rngs=rngs,  # (a key bias would get zero gradients)
            kernel_metadata=jshard.named("embed", "heads", "kv"), out_kernel_metadata=jshard.named("heads", "kv", "embed"))
        self.norm2 = nnx.RMSNorm(embed, rngs=rngs)
        self.up = nnx.Linear(embed, 4 * embed, kernel_metadata=jshard.named("embed", "mlp"), rngs=rngs)
        self.down = nnx.Linear(4 * embed, embed, kernel_metadata=jshard.named("mlp", "embed"), rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attention(self.norm1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Transformer(nnx.Module):
    """A small causal language model of plain Flax layers (nnx.Embed, MultiHeadAttention, ...)."""

    def __init__(self, rngs: nnx.Rngs, vocab: int = 64, embed: int = 32, heads: int = 4, layers: int = 2):
        self.embed = nnx.Embed(vocab, embed, embedding_metadata=jshard.named("vocab", "embed"), rngs=rngs)
        self.blocks = nnx.List([Block(embed, heads, rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(embed, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.embed.attend(self.norm(x))  # a head tied to the embedding


class UnnamedCNN(nnx.Module):
    """The Flax docs' MNIST CNN as the docs write it, no logical names at all (smaller)."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
        self.linear1 = nnx.Linear(16 * 4 * 4, 32, rngs=rngs)
        self.linear2 = nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(jax.nn.relu(self.conv1(x)), window_shape=(2, 2), strides=(2, 2))
        x = nnx.avg_pool(jax.nn.relu(self.conv2(x)), window_shape=(2, 2), strides=(2, 2))
        return self.linear2(jax.nn.relu(self.linear1(x.reshape(x.shape[0], -1))))


class UnnamedTransformer(nnx.Module):
    """A language model of nnx.MultiHeadAttention and nnx.Linear with no logical names."""

    def __init__(self, rngs: nnx.Rngs, vocab: int = 64, embed: int = 32, heads: int = 4):
        self.embed = nnx.Embed(vocab, embed, rngs=rngs)
        self.attention = nnx.MultiHeadAttention(heads, embed, decode=False, use_bias=False, rngs=rngs)
        self.norm = nnx.LayerNorm(embed, rngs=rngs)
        self.up, self.down = nnx.Linear(embed, 4 * embed, rngs=rngs), nnx.Linear(4 * embed, embed, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.attention(x, mask=nnx.make_causal_mask(tokens))
        x = x + self.down(jax.nn.gelu(self.up(self.norm(x))))
        return self.embed.attend(x)


class ScannedLayer(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nn.Linear(16, 32, in_names="embed", out_names="mlp", rngs=rngs)
        self.down = nn.Linear(32, 16, in_names="mlp", out_names="embed", rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(x, ("batch", "embed"))), ("batch", "mlp"))


class UserScan(nnx.Module):
    """jshard.nn layers stacked on `layers`, run by the user's own `jax.lax.scan` (not scan_layers)."""

    def __init__(self, rngs: nnx.Rngs):
        self.blocks = stack_layers(ScannedLayer, 4, rngs)

    def __call__(self, x):
        graphdef, state = nnx.split(self.blocks)
        return jax.lax.scan(lambda x, layer: (nnx.merge(graphdef, layer)(x), None), x, state)[0]


class StackedTransformer(nnx.Module):
    """The same blocks stacked on a `layers` axis (`jshard.models.stack_layers`), so that
    a pipeline can split them over stages; `stacked_loss` says where the stack starts and ends."""

    def __init__(self, rngs: nnx.Rngs, vocab: int = 64, embed: int = 32, heads: int = 4, layers: int = 4):
        self.embed = nnx.Embed(vocab, embed, embedding_metadata=jshard.named("vocab", "embed"), rngs=rngs)
        self.blocks = stack_layers(lambda rngs: CausalBlock(embed, heads, rngs), layers, rngs)
        self.norm = nnx.LayerNorm(embed, rngs=rngs)


class CausalBlock(Block):
    def __call__(self, x):
        return super().__call__(x, nnx.make_causal_mask(jnp.ones(x.shape[:2])))


def causal_attention_mask(seq_len):
    return jnp.tril(jnp.ones((seq_len, seq_len)))


def _names(named: bool, *names):
    """Logical names where the model is `named` (the only change to the Flax tutorial's code)."""
    return dict(kernel_metadata=jshard.named(*names)) if named else {}


class MiniGPTBlock(nnx.Module):
    """The Flax / JAX AI Stack tutorial's TransformerBlock ("Train a miniGPT language model"):
    post-norm attention and ReLU MLP of plain Flax layers, biases everywhere, dropout; its
    `nnx.with_partitioning(..., NamedSharding(mesh, P(None, 'model')))` initializers replaced
    by logical names (`named`) or by nothing."""

    def __init__(self, embed_dim, num_heads, ff_dim, *, rngs, named: bool, rate=0.1):
        attention_names = dict(kernel_metadata=jshard.named("embed", "heads", "kv"),
                               out_kernel_metadata=jshard.named("heads", "kv", "embed"),
                               bias_metadata=jshard.named("heads", "kv"), out_bias_metadata=jshard.named("embed"),
                               ) if named else {}
        self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim,
                                          kernel_init=nnx.initializers.xavier_uniform(), rngs=rngs, **attention_names)
        self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
        self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)
        self.linear1 = nnx.Linear(embed_dim, ff_dim, kernel_init=nnx.initializers.xavier_uniform(), rngs=rngs,
                                  **_names(named, "embed", "mlp"))
        self.linear2 = nnx.Linear(ff_dim, embed_dim, kernel_init=nnx.initializers.xavier_uniform(), rngs=rngs,
                                  **_names(named, "mlp", "embed"))
        self.dropout2 = nnx.Dropout(rate=rate, rngs=rngs)
        self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)

    def __call__(self, inputs, training: bool = False):
        _, seq_len, _ = inputs.shape
        attention_output = self.mha(inputs_q=inputs, mask=causal_attention_mask(seq_len), decode=False)
        attention_output = self.dropout1(attention_output, deterministic=not training)
        out1 = self.layer_norm1(inputs + attention_output)
        ffn_output = self.linear2(nnx.relu(self.linear1(out1)))
        ffn_output = self.dropout2(ffn_output, deterministic=not training)
        return self.layer_norm2(out1 + ffn_output)


class MiniGPT(nnx.Module):
    """The tutorial's MiniGPT: token and position embeddings, a list of blocks, a linear head."""

    def __init__(self, rngs: nnx.Rngs, named: bool = True, maxlen=16, vocab_size=64, embed_dim=32, num_heads=4,
                 feed_forward_dim=64, num_transformer_blocks=2):
        embed_names = dict(embedding_metadata=jshard.named("vocab", "embed")) if named else {}
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs, **embed_names)
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs,
                                 **(dict(embedding_metadata=jshard.named(None, "embed")) if named else {}))
        self.transformer_blocks = nnx.List([MiniGPTBlock(embed_dim, num_heads, feed_forward_dim, rngs=rngs, named=named)
                                            for _ in range(num_transformer_blocks)])
        self.output_layer = nnx.Linear(embed_dim, vocab_size, kernel_init=nnx.initializers.xavier_uniform(), rngs=rngs,
                                       **_names(named, "embed", "vocab"))

    def __call__(self, inputs, training: bool = False):
        x = self.token_emb(inputs) + self.pos_emb(jnp.arange(0, inputs.shape[1])[None, :])
        for transformer_block in self.transformer_blocks:
            x = transformer_block(x, training=training)
        return self.output_layer(x)


def minigpt_loss(model, tokens):
    """The tutorial's: softmax cross-entropy of the next token (its loss returns the logits beside)."""
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=tokens[:, 1:]).mean()


stacked_loss = StagedLoss(
    first=lambda model, tokens: model.embed(tokens[:, :-1]),
    layers=lambda model: model.blocks,
    last=lambda model, x, tokens: next_token_loss_of(model.embed.attend(model.norm(x)), tokens),
)


def next_token_loss_of(logits, tokens):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[:, 1:, None], axis=-1))


def next_token_loss(model, tokens):
    return next_token_loss_of(model(tokens[:, :-1]), tokens)


def token_batches(seed: int, count: int):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 64, (BATCH, 17)) for _ in range(count)]


# name: (model factory, loss, batches(seed, count))
MODELS = {
    "mlp": (MLP, mse_loss, regression_batches),
    "cnn": (CNN, classification_loss, image_batches),
    "transformer": (Transformer, next_token_loss, token_batches),
    "stacked transformer": (StackedTransformer, stacked_loss, token_batches),
    "unnamed cnn": (UnnamedCNN, classification_loss, image_batches),
    "unnamed transformer": (UnnamedTransformer, next_token_loss, token_batches),
    "user scan": (UserScan, mse_loss, regression_batches),
    "minigpt": (MiniGPT, minigpt_loss, token_batches),
    "unnamed minigpt": (functools.partial(MiniGPT, named=False), minigpt_loss, token_batches),
}


# -- models in JAX's explicit-sharding style ------------------------------------------------------------
# Written as JAX's sharding-in-types examples write a decoder: the author's own mesh axes, a table of
# PartitionSpecs over them (`ShardConfig`), params laid out by initializers' `out_sharding=` or by
# Flax's sharding metadata, norm scales `P()`, and activations laid out in the forward by
# `out_sharding=`, `reshard` and `with_sharding_constraint`. jshard runs each with
# `rules.with_mesh_axes(<its author's axes -> jshard's>)`. The zoo (`ZOO`): a Llama (GQA, rotary,
# SwiGLU, untied head), a Qwen3 (the same with q/k norms, over other axis names, its forward asking
# for heads and hidden units split over its tensor axis) and a tied-embedding decoder holding its
# rotary frequencies as `nnx.data`.


@dataclasses.dataclass(frozen=True)
class ShardConfig:
    """One author's layout: PartitionSpecs over the author's mesh axes (`axes`), per param and per
    activation the forward lays out."""

    axes: tuple[str, ...]  # the author's mesh axes, as the author's mesh names them
    embedding: jax.P  # (vocab, embed)
    q: jax.P  # (embed, heads, head dim)
    k: jax.P  # (embed, kv heads, head dim); v's too
    kv: jax.P  # (k or v, embed, kv heads, head dim): both in one param
    out: jax.P  # (heads, head dim, embed)
    up: jax.P  # (embed, mlp); a SwiGLU's gate's too
    down: jax.P  # (mlp, embed)
    head: jax.P  # (embed, vocab): an untied head
    rows: jax.P  # the residual stream (batch, seq, embed): rows over the batch's axis, the rest whole
    heads: jax.P  # queries, keys and values (batch, seq, heads, head dim)
    hidden: jax.P  # the MLP's hidden units (batch, seq, mlp)
    scale: jax.P = jax.P()  # a norm's scale, (embed,) or (head dim,): replicated

    @classmethod
    def over(cls, fsdp: str, tp: str, split_activations: bool = False) -> "ShardConfig":
        """FSDP and Megatron columns/rows over axes the author calls `fsdp` and `tp`; with
        `split_activations` the forward asks for heads and hidden units split over `tp` too (else
        it restates the rows' layout)."""
        rows = jax.P(fsdp)
        return cls((fsdp, tp), embedding=jax.P(tp, fsdp), q=jax.P(fsdp, tp, None), k=jax.P(fsdp, tp, None),
                   kv=jax.P(None, fsdp, tp, None), out=jax.P(tp, None, fsdp), up=jax.P(fsdp, tp),
                   down=jax.P(tp, fsdp), head=jax.P(fsdp, tp), rows=rows,
                   heads=jax.P(fsdp, None, tp, None) if split_activations else rows,
                   hidden=jax.P(fsdp, None, tp) if split_activations else rows)


SHARDING = ShardConfig.over("fsdp", "tp")  # the Llama's and the tied decoder's
AUTHOR_AXES = {"tp": "tensor"}  # onto jshard's: the author's 'fsdp' is jshard's already
QWEN3_SHARDING = ShardConfig.over("data", "model", split_activations=True)  # Flax's guide's axis names
QWEN3_AXES = {"data": "fsdp", "model": "tensor"}  # (the author's 'data' splits weights too: jshard's fsdp)


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    vocab: int = 64
    embed: int = 32
    heads: int = 16  # query heads
    kv_heads: int = 8  # fewer than heads: grouped-query attention (a tensor axis of 8 splits both)
    head_dim: int = 8
    mlp: int = 64
    layers: int = 2


def author_mesh(sharding: ShardConfig = SHARDING):
    """The author's mesh, on one device: what the model is built and the reference run under."""
    return jax.make_mesh((1,) * len(sharding.axes), sharding.axes,
                         axis_types=(jax.sharding.AxisType.Explicit,) * len(sharding.axes), devices=jax.devices()[:1])


def _param(rngs: nnx.Rngs, spec, shape, fan_in: int, metadata: bool = False) -> nnx.Param:
    """A normal(0, 1/fan_in) param laid out by its initializer's `out_sharding=` (its array carries
    the layout) or, with `metadata`, by Flax's `out_sharding` metadata."""
    if metadata:
        return nnx.Param(jax.random.normal(rngs.params(), shape) / np.sqrt(fan_in), out_sharding=spec)
    return nnx.Param(jax.random.normal(rngs.params(), shape, out_sharding=spec) / np.sqrt(fan_in))


def _scale(sharding: ShardConfig, size: int) -> nnx.Param:
    return nnx.Param(jnp.ones((size,)), out_sharding=sharding.scale)


def rms_norm(x, scale):
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale


def rotary_frequencies(head_dim: int, theta: float = 10000.0):
    return 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)


def rotary(x, inv_freq):
    """Rotary positions on (batch, seq, heads, head dim)."""
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def causal_attention(q, k, v):
    """q (batch, seq, heads, head dim); k, v with kv heads <= heads, each serving a group of
    consecutive query heads (grouped-query attention; multi-head where they are as many)."""
    b, s, heads, d = q.shape
    groups = k.shape[2]
    q = q.reshape(b, s, groups, heads // groups, d)
    scores = jnp.einsum("bqgrd,bsgd->bgrqs", q, k) / np.sqrt(d)
    causal = jnp.tril(jnp.ones((s, s), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9))
    return jnp.einsum("bgrqs,bsgd->bqgrd", weights, v).reshape(b, s, heads, d)


def swiglu(x, gate, up, down, sharding: ShardConfig):
    hidden = jax.nn.silu(jnp.einsum("bsd,df->bsf", x, gate, out_sharding=sharding.hidden))
    hidden = hidden * jnp.einsum("bsd,df->bsf", x, up, out_sharding=sharding.hidden)
    return jnp.einsum("bsf,fd->bsd", hidden, down, out_sharding=sharding.rows)


class LlamaBlock(nnx.Module):
    """Pre-norm grouped-query attention with rotary positions, and a SwiGLU MLP."""

    def __init__(self, config: DecoderConfig, sharding: ShardConfig, rngs: nnx.Rngs, metadata: bool):
        c, s = config, sharding
        param = functools.partial(_param, rngs, metadata=metadata)
        self.attention_norm = _scale(s, c.embed)
        self.q = param(s.q, (c.embed, c.heads, c.head_dim), c.embed)
        self.k = param(s.k, (c.embed, c.kv_heads, c.head_dim), c.embed)
        self.v = param(s.k, (c.embed, c.kv_heads, c.head_dim), c.embed)
        self.out = param(s.out, (c.heads, c.head_dim, c.embed), c.heads * c.head_dim)
        self.mlp_norm = _scale(s, c.embed)
        self.gate = param(s.up, (c.embed, c.mlp), c.embed)
        self.up = param(s.up, (c.embed, c.mlp), c.embed)
        self.down = param(s.down, (c.mlp, c.embed), c.mlp)
        self.sharding = sharding

    def queries_and_keys(self, q, k):
        return q, k

    def __call__(self, x, inv_freq):
        s = self.sharding
        h = rms_norm(x, self.attention_norm[...])
        q, k, v = (jnp.einsum("bsd,dhk->bshk", h, w[...], out_sharding=s.heads) for w in (self.q, self.k, self.v))
        q, k = self.queries_and_keys(q, k)
        attention = causal_attention(rotary(q, inv_freq), rotary(k, inv_freq), v)
        x = jax.sharding.reshard(x + jnp.einsum("bqhk,hkd->bqd", attention, self.out[...], out_sharding=s.rows), s.rows)
        return x + swiglu(rms_norm(x, self.mlp_norm[...]), self.gate[...], self.up[...], self.down[...], s)


class Qwen3Block(LlamaBlock):
    """The same, each query and key head RMS-normalised before the rotation (scales `P()`)."""

    def __init__(self, config: DecoderConfig, sharding: ShardConfig, rngs: nnx.Rngs, metadata: bool):
        super().__init__(config, sharding, rngs, metadata)
        self.q_norm, self.k_norm = _scale(sharding, config.head_dim), _scale(sharding, config.head_dim)

    def queries_and_keys(self, q, k):
        return rms_norm(q, self.q_norm[...]), rms_norm(k, self.k_norm[...])


class LlamaLM(nnx.Module):
    """A Llama: a list of blocks, a final norm, an untied head. Its params laid out by their
    initializers (`metadata=False`), over the author's ('fsdp', 'tp')."""

    block = LlamaBlock

    def __init__(self, rngs: nnx.Rngs, config: DecoderConfig = DecoderConfig(), sharding: ShardConfig = SHARDING,
                 metadata: bool = False):
        c, s = config, sharding
        self.embedding = _param(rngs, s.embedding, (c.vocab, c.embed), 1, metadata)
        self.layers = nnx.List([self.block(c, s, rngs, metadata) for _ in range(c.layers)])
        self.norm = _scale(s, c.embed)
        self.head = _param(rngs, s.head, (c.embed, c.vocab), c.embed, metadata)
        self.head_dim, self.sharding = c.head_dim, s

    def embed(self, tokens):
        return self.embedding[...].at[tokens].get(out_sharding=self.sharding.rows)

    def __call__(self, tokens):
        x = self.embed(tokens)
        inv_freq = rotary_frequencies(self.head_dim)
        for layer in self.layers:
            x = layer(x, inv_freq)
        return jnp.einsum("bsd,dv->bsv", rms_norm(x, self.norm[...]), self.head[...], out_sharding=self.sharding.rows)


class Qwen3LM(LlamaLM):
    """A Qwen3: q/k norms; its params laid out by Flax metadata, over the author's ('data', 'model');
    its forward asks for heads and hidden units split over 'model', its embedding looked up in
    `auto_axes`."""

    block = Qwen3Block

    def __init__(self, rngs: nnx.Rngs, config: DecoderConfig = DecoderConfig(), sharding: ShardConfig = QWEN3_SHARDING,
                 metadata: bool = True):
        super().__init__(rngs, config, sharding, metadata)

    def embed(self, tokens):
        # JAX's way for an op whose layout it cannot infer: computed over Auto axes, then laid out.
        return jax.sharding.auto_axes(lambda table: table[tokens], out_sharding=self.sharding.rows)(self.embedding[...])


class ExplicitShardingLM(nnx.Module):
    """A one-block rotary decoder with a tied head, k and v in one param (4 KV heads for 8 query
    heads), a plain SiLU MLP, its rotary frequencies a constant held as `nnx.data`, its residual
    stream laid out by a NamedSharding on the author's mesh."""

    def __init__(self, rngs: nnx.Rngs, vocab=64, embed=32, heads=8, kv_heads=4, head_dim=8, mlp=64):
        s = SHARDING
        self.embedding = _param(rngs, s.embedding, (vocab, embed), embed)
        self.q = _param(rngs, s.q, (embed, heads, head_dim), embed)
        self.kv = _param(rngs, s.kv, (2, embed, kv_heads, head_dim), embed)
        self.out = _param(rngs, s.out, (heads, head_dim, embed), heads * head_dim, metadata=True)
        self.up = _param(rngs, s.up, (embed, mlp), embed, metadata=True)
        self.down = _param(rngs, s.down, (mlp, embed), mlp, metadata=True)
        self.scale = _scale(s, embed)
        self.inv_freq = nnx.data(rotary_frequencies(head_dim))
        self.rows = jax.NamedSharding(jax.sharding.get_abstract_mesh(), SHARDING.rows)  # on the author's mesh

    def lay_out(self, x):
        return jax.sharding.reshard(x, self.rows)

    def __call__(self, tokens):
        rows = SHARDING.rows
        x = self.embedding[...].at[tokens].get(out_sharding=rows)
        h = rms_norm(x, self.scale[...])
        q = rotary(jnp.einsum("bsd,dhk->bshk", h, self.q[...], out_sharding=rows), self.inv_freq)
        k, v = (jnp.einsum("bsd,dhk->bshk", h, w, out_sharding=rows) for w in self.kv[...])
        attention = causal_attention(q, rotary(k, self.inv_freq), v)
        x = jax.sharding.reshard(x + jnp.einsum("bqhk,hkd->bqd", attention, self.out[...], out_sharding=rows), rows)
        up = jnp.einsum("bsd,df->bsf", rms_norm(x, self.scale[...]), self.up[...], out_sharding=rows)
        x = self.lay_out(x + jnp.einsum("bsf,fd->bsd", jax.nn.silu(up), self.down[...], out_sharding=rows))
        return jnp.einsum("bsd,vd->bsv", rms_norm(x, self.scale[...]), self.embedding[...], out_sharding=rows)


class ConstrainedLM(ExplicitShardingLM):
    """The same, laying out its residual stream as a model for an Auto mesh does."""

    def lay_out(self, x):
        return jax.lax.with_sharding_constraint(x, self.rows)


def explicit_sharding_lm(rngs: nnx.Rngs, model=ExplicitShardingLM, sharding: ShardConfig = SHARDING, **kwargs):
    """The model built as its author builds it: under the author's mesh (initializers' `out_sharding=`)."""
    with jax.set_mesh(author_mesh(sharding)):
        return model(rngs, **kwargs)


# name: (the model as its author builds it, from an nnx.Rngs; its author's layout; its author's axes -> jshard's)
ZOO = {
    "llama": (functools.partial(explicit_sharding_lm, model=LlamaLM), SHARDING, AUTHOR_AXES),
    "qwen3": (functools.partial(explicit_sharding_lm, model=Qwen3LM, sharding=QWEN3_SHARDING), QWEN3_SHARDING,
              QWEN3_AXES),
    "tied": (explicit_sharding_lm, SHARDING, AUTHOR_AXES),
}
