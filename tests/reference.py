"""The one-device reference that parity tests compare against: plain Flax NNX and optax."""

from flax import nnx


def train_on_one_device(model: nnx.Module, tx, loss_fn, batches) -> list[float]:
    """One optimizer step per batch on `model` (updated in place); the losses."""
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return loss

    return [float(train_step(model, optimizer, batch)) for batch in batches]
