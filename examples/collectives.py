"""The lecture's `collective_operations_main`, with jshard.collectives on 4 ranks.

    .venv/bin/python examples/collectives.py

In the lecture `spawn` starts one process per rank and each process prints its own lines,
with a `dist.barrier()` before each section so the prints do not interleave. Here one
program runs on 4 devices (fake CPU devices unless JAX_PLATFORMS names a platform, e.g.
JAX_PLATFORMS=cuda on a machine with 4 GPUs), `run` returns every rank's values once all
ranks are done, and the lines are printed from those, rank by rank.
"""

import os

import jax.numpy as jnp

import jshard
from jshard.collectives import all_gather, all_reduce, reduce_scatter, run


def collective_operations_main(rank, world_size):
    """Runs on every rank at once; `rank` is that rank's index on the mesh axis "ranks"."""
    # All-reduce: every rank holds [0, 1, 2, 3] + rank and ends with the sum over ranks.
    tensor = jnp.array([0.0, 1, 2, 3]) + rank
    all_reduced = all_reduce(tensor, "ranks", op="sum")

    # Reduce-scatter: sum over ranks, then rank r keeps element r of the sum.
    scatter_input = jnp.arange(world_size, dtype=jnp.float32) + rank
    scatter_output = reduce_scatter(scatter_input, "ranks", op="sum")

    # All-gather the reduce-scatter's pieces back into a whole.
    gathered = all_gather(scatter_output, "ranks")
    return tensor, all_reduced, scatter_input, scatter_output, gathered


def main(world_size: int = 4) -> None:
    tensor, all_reduced, scatter_input, scatter_output, gathered = run(collective_operations_main, world_size)
    for rank in range(world_size):
        print(f"Rank {rank} [before all-reduce]: {tensor[rank]}")
    for rank in range(world_size):
        print(f"Rank {rank} [after all-reduce]: {all_reduced[rank]}")
    for rank in range(world_size):
        print(f"Rank {rank} [after reduce-scatter]: input = {scatter_input[rank]}, output = {scatter_output[rank]}")
    for rank in range(world_size):
        print(f"Rank {rank} [after all-gather]: input = {scatter_output[rank]}, output = {gathered[rank]}")
    # Indeed, all-reduce = reduce-scatter + all-gather!
    print("all-reduce == reduce-scatter + all-gather:", bool((all_reduced == gathered).all()))


if __name__ == "__main__":
    if "JAX_PLATFORMS" not in os.environ:
        jshard.use_fake_cpu_devices(4)
    main()
