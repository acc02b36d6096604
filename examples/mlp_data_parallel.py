"""The lecture's data_parallelism_main: the batch split over ranks, gradients averaged.

    .venv/bin/python examples/mlp_data_parallel.py              # 8 fake CPU devices, or the GPUs
    .venv/bin/python examples/mlp_data_parallel.py --ranks 4 --steps 2

In the lecture each rank (a process) takes its slice of the batch, runs forward and
backward, all-reduces (AVG) every gradient and steps its own AdamW. It prints each rank's
loss and params: the losses differ (different data), the params are the same.

Here one program does it on every device: `jshard.preset("dp")` puts `batch` on the mesh
axis `data`, and `build_step` compiles the step with its one all-reduce written out. The
per-rank losses are each rank's loss on its own slice (the step itself returns their mean).
What the lecture only asserts is measured: the largest difference between the ranks' copies
of every param after the step (each device holds its own buffer), and the same step on one
device with the whole batch, whose loss and params the sharded step must reproduce.
"""

import jax
import numpy as np
import optax
from flax import nnx

import _common
import jshard
from jshard.models import mlp_loss

jshard.use_fake_cpu_devices(8, unless_accelerated=True)


def per_rank_losses(step, state, batch) -> np.ndarray:
    """Each rank's loss on its own slice of the batch: the lecture's `loss.item()` per rank."""
    def rank_loss(params, x):
        return mlp_loss(nnx.merge(step.graphdef, params), x)[None]

    losses = jax.shard_map(rank_loss, mesh=step.mesh, in_specs=(jax.P(), jax.P("data")), out_specs=jax.P("data"),
                           check_vma=True)
    return np.asarray(jax.jit(losses)(state.params, batch))


def rank_copies(state, rank: int) -> list[np.ndarray]:
    """The params as device `rank` holds them (under DP every device holds all of them)."""
    return [np.asarray(leaf.addressable_shards[rank].data) for leaf in jax.tree.leaves(state.params)]


def per_layer(params: list[np.ndarray]) -> list[str]:
    """The lecture's `[summarize_tensor(params[i]) for i in range(num_layers)]`: layers are stacked here."""
    return [_common.summarize(layer) for stacked in params for layer in stacked]


def main(argv=None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--ranks", type=int, default=None, help="world_size (default: every device)")
    p.add_argument("--steps", type=int, default=1, help="num_steps (lecture: 1)")
    args = p.parse_args(argv)
    ranks = args.ranks or jax.device_count()
    mesh = jshard.make_mesh(devices=jax.devices()[:ranks], data=ranks)
    tx = optax.adamw(1e-3)  # the lecture's AdamW(lr=1e-3); each device steps its own copy
    step = jshard.build_step(_common.make_mlp(args), tx, mlp_loss, jshard.Layout.of("dp", mesh), mesh)
    data = _common.sample_data(args)
    print(f"{ranks} ranks, batch {args.batch_size} -> {args.batch_size // ranks} rows per rank, "
          f"{args.layers} layers of {args.dim}x{args.dim}")

    state, losses = step.state, []
    for i in range(args.steps):
        batch = step.shard_batch(data)
        rank_losses = per_rank_losses(step, state, batch)  # with the params this step starts from
        state, loss = step(state, batch)
        losses.append(float(loss))
        for rank in range(ranks):
            params = per_layer(rank_copies(state, rank))
            print(f"[data_parallelism] Rank {rank}: step = {i}, loss = {rank_losses[rank]:.6f}, params = {params}")
        print(f"step {i}: rank losses differ (spread {np.ptp(rank_losses):.2e}); "
              f"their mean {rank_losses.mean():.6f} is the step's loss {loss:.6f}")

    first = rank_copies(state, 0)
    spread = max(float(np.abs(a - b).max()) for r in range(1, ranks) for a, b in zip(rank_copies(state, r), first))
    print(f"params after {args.steps} step(s): max |difference| between ranks' copies = {spread:.1e}")
    expected_losses, expected_params = _common.reference_steps(args, tx, data, args.steps)
    print(_common.parity_line("params", losses[-1], expected_losses[-1], state.params, expected_params))


if __name__ == "__main__":
    main()
