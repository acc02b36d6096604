"""A model as the Flax NNX docs write it (their MNIST CNN, with BatchNorm and Dropout), trained
by jshard: the only change to the model is the logical names on its kernels.

    .venv/bin/python examples/train_flax_cnn.py                           # dp+fsdp on 8 devices
    .venv/bin/python examples/train_flax_cnn.py --preset dp+tp --mesh data=2,tensor=4

The data are made up (no download): 16×16 images of a bright 4×4 square on noise; the class
is where the square sits, one of 10 places.
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jshard

jshard.use_fake_cpu_devices(8, unless_accelerated=True)
parser = argparse.ArgumentParser(description="train the Flax docs' CNN under a sharding preset")
parser.add_argument("--mesh", default="data=2,fsdp=4")
parser.add_argument("--preset", default="dp+fsdp")
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--batch-size", type=int, default=64)


class CNN(nnx.Module):
    """The Flax docs' CNN, plus BatchNorm and Dropout. The names say which dims the rules may
    split: conv kernels are (height, width, in, out); 'mlp' and 'embed' are feature dims."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), use_bias=False, rngs=rngs,
                              kernel_metadata=jshard.named(None, None, None, "mlp"))
        self.bn1 = nnx.BatchNorm(32, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), use_bias=False, rngs=rngs,
                              kernel_metadata=jshard.named(None, None, "mlp", "embed"))
        self.bn2 = nnx.BatchNorm(64, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.linear1 = nnx.Linear(64 * 4 * 4, 256, kernel_metadata=jshard.named("embed", "mlp"), rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, kernel_metadata=jshard.named("mlp", None), rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(nnx.relu(self.bn1(self.conv1(x))), window_shape=(2, 2), strides=(2, 2))
        x = nnx.avg_pool(nnx.relu(self.bn2(self.conv2(x))), window_shape=(2, 2), strides=(2, 2))
        x = self.dropout(nnx.relu(self.linear1(x.reshape(x.shape[0], -1))))
        return self.linear2(x)


def loss_fn(model, batch):
    """The loss, and the batch's accuracy beside it (`build_step(..., has_aux=True)`)."""
    images, labels = batch
    logits = model(images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, {"accuracy": jnp.mean(jnp.argmax(logits, -1) == labels)}


def make_batch(rng, rows: int):
    labels = rng.integers(0, 10, rows)
    images = rng.normal(0, 0.5, (rows, 16, 16, 1)).astype(np.float32)
    for image, label in zip(images, labels):  # places on a 2 × 5 grid
        row, col = 2 + 8 * (label // 5), 1 + 3 * (label % 5)
        image[row:row + 4, col:col + 2] += 2.0
    return images, labels


def main(argv=None) -> None:
    args = parser.parse_args(argv)
    # The layout as one line, "dp+fsdp data=2,fsdp=4": the preset, and the mesh made over the devices.
    step = jshard.build_step(CNN(rngs=nnx.Rngs(0)), optax.adam(1e-3), loss_fn, f"{args.preset} {args.mesh}",
                             has_aux=True)
    rng = np.random.default_rng(0)
    print(step.describe(make_batch(rng, args.batch_size)))  # placements, and what each param gets
    state = step.state
    for i in range(args.steps):
        state, (loss, metrics) = step(state, step.shard_batch(make_batch(rng, args.batch_size)))
        if i % 10 == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {float(loss):.4f}  accuracy {float(metrics['accuracy']):.3f}")
    model = step.model(state)  # a plain Flax model again: its params, batch statistics and RNG state
    model.eval()  # running statistics, no dropout
    images, labels = make_batch(np.random.default_rng(1), 512)
    accuracy = float(jnp.mean(jnp.argmax(jax.jit(lambda m, x: m(x))(model, images), -1) == labels))
    print(f"held-out accuracy {accuracy:.3f} after {args.steps} steps of {args.preset} on {args.mesh}")


if __name__ == "__main__":
    main()
