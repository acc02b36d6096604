"""The lectures' deep MLP: L layers of x <- gelu(x @ W), each W of D×D; loss = mean(x²).

The layers are stacked into one (layers, embed, mlp) param (see `stack.py`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jshard import nn
from jshard.models.stack import StagedLoss, scan_layers, stack_layers
from jshard.rules import constrain


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    dim: int = 1024
    layers: int = 4
    dtype: jnp.dtype | None = None  # compute dtype; None: the step's precision policy's (`nn.compute_dtype`)


class Layer(nnx.Module):
    def __init__(self, config: MLPConfig, *, rngs: nnx.Rngs):
        # Lecture init: randn(D, D) / sqrt(D).
        init = nnx.initializers.normal(stddev=config.dim**-0.5)
        self.linear = nn.Linear(
            config.dim, config.dim, in_names="embed", out_names="mlp", kernel_init=init, dtype=config.dtype, rngs=rngs
        )

    def __call__(self, x):
        y = jax.nn.gelu(self.linear(x, ("batch", "embed")))
        # The output's features are the next layer's input features (under TP: an all-gather).
        return nn.relayout(y, ("batch", "mlp"), ("batch", "embed"))


class DeepMLP(nnx.Module):
    def __init__(self, config: MLPConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.layers = stack_layers(lambda rngs: Layer(config, rngs=rngs), config.layers, rngs)

    def __call__(self, x):
        return scan_layers(self.layers, constrain(x.astype(nn.compute_dtype(self.config.dtype)), ("batch", "embed")))


# The lectures' loss: the mean squared magnitude of the output, in float32; staged for pipelines.
mlp_loss = StagedLoss(
    first=lambda model, x: constrain(x.astype(nn.compute_dtype(model.config.dtype)), ("batch", "embed")),
    layers=lambda model: model.layers,
    last=lambda model, y, x: jnp.mean(jnp.square(y.astype(jnp.float32))),
)
