"""Models written as the Flax NNX docs write them, nothing from jshard but logical names
(`kernel_metadata=jshard.named(...)`): what a new user brings to jshard's steps. The stacked
transformer also stacks its blocks with `jshard.models.stack_layers`, which a pipeline needs.

Each entry of `MODELS` gives the model, its loss and fresh random batches for a seed.
"""

import jax
import jax.numpy as jnp
import numpy as np
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
}
