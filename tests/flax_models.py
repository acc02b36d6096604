"""Models written as the Flax NNX docs write them, nothing from jshard but logical names
(`kernel_metadata=jshard.named(...)`): what a new user brings to jshard's steps. The stacked
transformer also stacks its blocks with `jshard.models.stack_layers`, which a pipeline needs.

Each entry of `MODELS` gives the model, its loss and fresh random batches for a seed.
"""

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


# -- a model in JAX's explicit-sharding style ---------------------------------------------------------
# Written as JAX's sharding-in-types examples write a decoder: the author's own mesh axes ('fsdp',
# 'tp'), a table of PartitionSpecs over them, params laid out by initializers' `out_sharding=` or by
# Flax's sharding metadata, a norm scale `P()`, a constant held as `nnx.data`, and activations laid
# out in the forward by `out_sharding=`, `reshard` and `with_sharding_constraint`. jshard runs it
# with `rules.with_mesh_axes(AUTHOR_AXES)`.

AUTHOR_AXES = {"tp": "tensor"}  # the author's 'fsdp' is jshard's already

SHARDING = dict(
    embedding=jax.P("tp", "fsdp"),  # (vocab, embed)
    q=jax.P("fsdp", "tp", None),  # (embed, heads, head dim)
    kv=jax.P(None, "fsdp", "tp", None),  # (k or v, embed, heads, head dim)
    out=jax.P("tp", None, "fsdp"),  # (heads, head dim, embed)
    up=jax.P("fsdp", "tp"),  # (embed, mlp)
    down=jax.P("tp", "fsdp"),  # (mlp, embed)
    scale=jax.P(),  # (embed,): replicated
    rows=jax.P("fsdp"),  # an activation: its rows over fsdp, the rest whole
)


def author_mesh():
    """The author's mesh, on one device: what the model is built and the reference run under."""
    return jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Explicit,) * 2,
                         devices=jax.devices()[:1])


def _rotary(x, inv_freq):
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class ExplicitShardingLM(nnx.Module):
    """A one-block rotary decoder with a tied head; `hidden`: the layout its MLP asks for (the
    default restates the rows' layout; P('fsdp', None, 'tp') splits the hidden units)."""

    def __init__(self, rngs: nnx.Rngs, vocab=64, embed=32, heads=4, head_dim=8, mlp=64, hidden=SHARDING["rows"]):
        def normal(spec, *shape):  # an initializer laying its array out itself
            return jax.random.normal(rngs.params(), shape, out_sharding=spec) / np.sqrt(shape[-2])

        self.embedding = nnx.Param(normal(SHARDING["embedding"], vocab, embed))
        self.q = nnx.Param(normal(SHARDING["q"], embed, heads, head_dim))
        self.kv = nnx.Param(normal(SHARDING["kv"], 2, embed, heads, head_dim))
        self.out = nnx.Param(jax.random.normal(rngs.params(), (heads, head_dim, embed)) / 8, out_sharding=SHARDING["out"])
        self.up = nnx.Param(jax.random.normal(rngs.params(), (embed, mlp)) / 6, out_sharding=SHARDING["up"])
        self.down = nnx.Param(jax.random.normal(rngs.params(), (mlp, embed)) / 8, out_sharding=SHARDING["down"])
        self.scale = nnx.Param(jnp.ones((embed,)), out_sharding=SHARDING["scale"])
        self.inv_freq = nnx.data(1.0 / 10000 ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
        self.hidden = hidden

    def lay_out(self, x, spec):
        return jax.sharding.reshard(x, spec)

    def norm(self, x):
        return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * self.scale[...]

    def __call__(self, tokens):
        rows = SHARDING["rows"]
        x = self.embedding[...].at[tokens].get(out_sharding=rows)
        h = self.norm(x)
        q = _rotary(jnp.einsum("bsd,dhk->bshk", h, self.q[...], out_sharding=rows), self.inv_freq)
        k, v = (jnp.einsum("bsd,dhk->bshk", h, w, out_sharding=rows) for w in self.kv[...])
        scores = jnp.einsum("bqhk,bshk->bhqs", q, _rotary(k, self.inv_freq)) / np.sqrt(q.shape[-1])
        causal = jnp.tril(jnp.ones((tokens.shape[1],) * 2, bool))
        attention = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(jnp.where(causal, scores, -1e9)), v)
        x = jax.sharding.reshard(x + jnp.einsum("bqhk,hkd->bqd", attention, self.out[...], out_sharding=rows), rows)
        up = jnp.einsum("bsd,df->bsf", self.norm(x), self.up[...], out_sharding=self.hidden)
        x = self.lay_out(x + jnp.einsum("bsf,fd->bsd", jax.nn.silu(up), self.down[...], out_sharding=rows), rows)
        return jnp.einsum("bsd,vd->bsv", self.norm(x), self.embedding[...], out_sharding=rows)


class ConstrainedLM(ExplicitShardingLM):
    """The same, laying out its residual stream as a model for an Auto mesh does."""

    def lay_out(self, x, spec):
        return jax.lax.with_sharding_constraint(x, spec)


def explicit_sharding_lm(rngs: nnx.Rngs, model=ExplicitShardingLM, **kwargs):
    """The model built as its author builds it: under the author's mesh (initializers' `out_sharding=`)."""
    with jax.set_mesh(author_mesh()):
        return model(rngs, **kwargs)
