"""The lecture's pipeline_parallelism_main, forward *and backward*: layers split by depth.

    .venv/bin/python examples/mlp_pipeline_parallel.py          # 2 stages of 8 fake CPU devices, or the GPUs
    .venv/bin/python examples/mlp_pipeline_parallel.py --stages 4 --microbatches 8 --layers 8 --schedule 1f1b

In the lecture each of 2 ranks holds 2 of the 4 layers. Rank 0 chunks the batch into 4
micro-batches; for each, a rank receives the activation from the rank before
(`dist.recv`), runs its layers and sends the result on (`dist.send`), printing what it
sends. The backward pass is homework, and so is the order in which a rank interleaves
forwards and backwards: the schedule.

Here, first the lecture's forward as written, with `jshard.collectives`: every rank runs in
lockstep, and one `send_recv` per tick is every rank's send and receive at once. Then a
schedule (`--schedule gpipe|1f1b|interleaved|zb-h1`) as a grid, which rank does what at
each tick, with its bubble and how many micro-batches each rank keeps in flight; and the
whole step, forward and backward, run by that schedule in `build_step` under
`jshard.preset("pp")`. Its loss and gradients must equal one device's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import _common
import jshard
from jshard.collectives import run, send_recv
from jshard.models import mlp_loss
from jshard.parallel.schedules import SCHEDULES, make_schedule
from jshard.cli.show import render

jshard.use_fake_cpu_devices(8, unless_accelerated=True)


def pipeline_forward(rank, world_size, kernels, data, num_micro_batches):
    """The lecture's forward on every rank at once; returns what each rank sends at each tick."""
    local_num_layers = kernels.shape[0] // world_size
    local_params = lax.dynamic_slice_in_dim(kernels, rank * local_num_layers, local_num_layers)  # this rank's layers
    micro_batches = data.reshape(num_micro_batches, -1, data.shape[1])
    x, sent = jnp.zeros_like(micro_batches[0]), []
    for tick in range(num_micro_batches + world_size - 1):
        if tick < num_micro_batches:  # rank 0 takes the next micro-batch; the others keep what they received
            x = jnp.where(rank == 0, micro_batches[tick], x)
        for param in local_params:
            x = jax.nn.gelu(x @ param)
        sent.append(x)
        x = send_recv(x, "ranks")  # every rank sends to rank + 1 and receives from rank - 1
    return jnp.stack(sent)


def main(argv=None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--stages", type=int, default=2, help="world_size: pipeline stages (lecture: 2)")
    p.add_argument("--microbatches", type=int, default=4, help="num_micro_batches (lecture: 4)")
    p.add_argument("--schedule", default="gpipe", choices=SCHEDULES, help="the order of forwards and backwards")
    p.add_argument("--virtual", type=int, default=None, help="model chunks per rank (interleaved only; default 2)")
    args = p.parse_args(argv)
    stages, m = args.stages, args.microbatches
    model, data = _common.make_mlp(args), _common.sample_data(args)

    kernels = np.asarray(model.layers.linear.kernel.get_value())  # (layers, D, D)
    sent = run(pipeline_forward, stages, kernels, data, m)  # [rank, tick, micro-batch rows, D]
    for rank in range(stages - 1):
        for i in range(m):  # rank r works on micro-batch i at tick i + r
            x = _common.summarize(sent[rank, i + rank])
            print(f"[pipeline_parallelism] Rank {rank}: sending {x} to rank {rank + 1}")
    outputs = np.concatenate(list(sent[stages - 1, stages - 1:]))  # the last rank's results, micro-batch by micro-batch
    print(f"forward: the last rank's output, rel err vs one device {_common.relative_error(outputs, model(data)):.1e}")

    schedule = make_schedule(args.schedule, stages, m, args.virtual)  # who does what at each tick
    print(render(schedule))
    mesh = jshard.make_mesh(devices=jax.devices()[:stages], stage=stages)
    step = jshard.build_step(model, optax.adamw(1e-3), mlp_loss,
                             jshard.Layout.of("pp", mesh, microbatches=m, schedule=args.schedule,
                                              virtual=args.virtual), mesh)
    loss, grads = step.value_and_grad(step.state, step.shard_batch(data))
    kernel = np.asarray(grads["layers"]["linear"]["kernel"].get_value())  # (layers, D, D), in model order
    k = args.layers // (stages * schedule.virtual)  # layers per model chunk
    for rank in range(stages):  # chunk c of rank r is pipeline position c * stages + r
        held = [slice((c * stages + rank) * k, (c * stages + rank + 1) * k) for c in range(schedule.virtual)]
        block = np.concatenate([kernel[layers] for layers in held])
        print(f"[pipeline_parallelism] Rank {rank}: backward pass produced gradients {_common.summarize(block)} "
              f"(layers {', '.join(f'{layers.start}:{layers.stop}' for layers in held)})")
    expected_loss, expected_grads = _common.reference_grads(args, data)
    print(_common.parity_line("grads", loss, expected_loss, grads, expected_grads))


if __name__ == "__main__":
    main()
