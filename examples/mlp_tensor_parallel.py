"""The lecture's tensor_parallelism_main, forward *and backward*: each layer split by width.

    .venv/bin/python examples/mlp_tensor_parallel.py            # 8 fake CPU devices, or the GPUs
    .venv/bin/python examples/mlp_tensor_parallel.py --ranks 4

In the lecture every rank holds all the data and a D × D/N slice of every layer: it computes
its D/N output features, all-gathers the other ranks' features and goes on to the next
layer. It prints the activations each rank ends with (all full size, all the same) and
leaves the backward pass as homework.

Here `jshard.preset("tp")` puts the layer's `mlp` (output) dim on the mesh axis `tensor`:
a column-parallel matmul, then the all-gather (`jshard.nn.relayout`). The backward is
autodiff through those collectives, inside `build_step`: the all-gather's transpose is a
reduce-scatter of the activation gradient. Printed beyond the lecture: each rank's slice of
every gradient, the loss and gradients against one device, and the collectives XLA
compiled into the step, counted from its HLO.
"""

import jax
import numpy as np
import optax
from flax import nnx

import _common
import jshard
from jshard.models import mlp_loss

jshard.use_fake_cpu_devices(8, unless_accelerated=True)


def per_rank_forward(step, state, data) -> np.ndarray:
    """The activations each rank ends the forward pass with, stacked over ranks."""
    def forward(params, x):
        with jshard.use_rules(step.rules):  # inside, layers derive their collectives
            return nnx.merge(step.graphdef, params)(x)[None]

    in_specs = (step.state_specs.params, jax.P())  # params split by the rules, data whole on every rank
    run = jax.shard_map(forward, mesh=step.mesh, in_specs=in_specs, out_specs=jax.P("tensor"), check_vma=True)
    return np.asarray(jax.jit(run)(state.params, data))


def shards_along(array: jax.Array, dim: int) -> list[tuple[slice, np.ndarray]]:
    """The blocks of `array` that the devices hold, in order along `dim`: (index along dim, block)."""
    shards = sorted(array.addressable_shards, key=lambda s: s.index[dim].start or 0)
    return [(s.index[dim], np.asarray(s.data)) for s in shards]


def main(argv=None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--ranks", type=int, default=None, help="world_size (default: every device)")
    args = p.parse_args(argv)
    ranks = args.ranks or jax.device_count()
    mesh = jshard.make_mesh(devices=jax.devices()[:ranks], tensor=ranks)
    rules = jshard.preset("tp")
    model = _common.make_mlp(args)
    print(jshard.describe(model, mesh, rules))  # each rank: D x D/N of every layer
    step = jshard.build_step(model, optax.adamw(1e-3), mlp_loss, jshard.Layout.of(rules, mesh), mesh)
    data = _common.sample_data(args)

    activations = per_rank_forward(step, step.state, data)
    for rank in range(ranks):
        x = _common.summarize(activations[rank])
        print(f"[tensor_parallelism] Rank {rank}: forward pass produced activations {x}")
    expected_activations = _common.make_mlp(args)(data)
    print(f"forward: max |difference| between ranks {np.ptp(activations, axis=0).max():.1e}, "
          f"rel err vs one device {_common.relative_error(activations[0], expected_activations):.1e}")

    # The homework: the backward pass, each rank computing the gradient of its own slice.
    loss, grads = step.value_and_grad(step.state, step.shard_batch(data))
    kernel = grads["layers"]["linear"]["kernel"].get_value()  # (layers, D, D), split on its last dim
    for rank, (columns, block) in enumerate(shards_along(kernel, 2)):
        print(f"[tensor_parallelism] Rank {rank}: backward pass produced gradients {_common.summarize(block)} "
              f"(columns {columns.start}:{columns.stop})")
    expected_loss, expected_grads = _common.reference_grads(args, data)
    print(_common.parity_line("grads", loss, expected_loss, grads, expected_grads))
    compiled = step.lower(step.state, step.shard_batch(data)).compile()
    why = {"all-gather": "forward: each layer's output features", "reduce-scatter": "backward: its transpose"}
    print(f"the activation (batch x dim) is {data.nbytes} B")
    for (kind, nbytes), count in sorted(_common.collectives(compiled).items()):
        print(f"compiled step: {count} x {kind} of {nbytes} B ({why.get(kind, 'other')})")


if __name__ == "__main__":
    main()
