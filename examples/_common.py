"""What the MLP examples share: the lecture's flags and data, and the single-device reference.

Not an example itself. The lecture (CS336 lecture 8) runs a deep MLP, x <- gelu(x @ W) per
layer, loss = mean(x²), on `generate_sample_data()`: a batch of 128 rows of 1024 features.
"""

from __future__ import annotations

import argparse
import collections

import jax
import numpy as np
import optax
from flax import nnx

from jshard import hlo
from jshard.models import DeepMLP, MLPConfig, mlp_loss


def parser(doc: str) -> argparse.ArgumentParser:
    """The lecture's sizes as flags: tests pass tiny ones."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--dim", type=int, default=1024, help="num_dim: features per layer (lecture: 1024)")
    p.add_argument("--layers", type=int, default=4, help="num_layers (lecture: 4)")
    p.add_argument("--batch-size", type=int, default=128, help="rows of sample data (lecture: 128)")
    p.add_argument("--seed", type=int, default=0)
    return p


def sample_data(args) -> np.ndarray:
    """The lecture's generate_sample_data(): standard-normal (batch, dim)."""
    return np.random.default_rng(args.seed).standard_normal((args.batch_size, args.dim), dtype=np.float32)


def make_mlp(args) -> DeepMLP:
    """The lecture's params, randn(D, D) / sqrt(D) per layer, the same on every rank."""
    return DeepMLP(MLPConfig(dim=args.dim, layers=args.layers), rngs=nnx.Rngs(args.seed))


def summarize(x) -> str:
    """The lecture's summarize_tensor: shape and first value, e.g. 32x1024[0.01234...]."""
    x = np.asarray(x)
    return "x".join(map(str, x.shape)) + f"[{x.reshape(-1)[0]:.4g}...]"


def relative_error(actual, expected) -> float:
    """Worst per-leaf relative error (Frobenius norm) between two trees of arrays or Variables."""
    errors = [
        float(np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64)) / max(np.linalg.norm(b), 1e-30))
        for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected))
    ]
    return max(errors)


def reference_grads(args, batch):
    """One device, whole batch: the loss and its gradients."""
    return nnx.value_and_grad(mlp_loss)(make_mlp(args), batch)


def reference_steps(args, tx: optax.GradientTransformation, batch, steps: int):
    """One device, whole batch: the loss of each of `steps` optimizer steps, and the params after."""
    model = make_mlp(args)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    losses = []
    for _ in range(steps):
        loss, grads = nnx.value_and_grad(mlp_loss)(model, batch)
        optimizer.update(model, grads)
        losses.append(float(loss))
    return losses, nnx.state(model)


def parity_line(what: str, loss, expected_loss, grads_or_params, expected) -> str:
    """`parity vs one device: loss rel err X, <what> rel err Y` (the line the tests read)."""
    loss_err = abs(float(loss) - float(expected_loss)) / abs(float(expected_loss))
    err = relative_error(grads_or_params, expected)
    return f"parity vs one device: loss rel err {loss_err:.1e}, {what} rel err {err:.1e}"


def collectives(compiled) -> collections.Counter:
    """{(kind, bytes per device): how many run per step} of a compiled step, from its HLO; the
    scalar loss left out."""
    counts = collections.Counter()
    for c in hlo.collectives(compiled.as_text()):
        if c.bytes > 4:
            counts[c.kind, c.bytes] += c.count
    return counts
