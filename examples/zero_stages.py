"""Per-device memory of DP and ZeRO-1/2/3: the lecture notes' table, measured.

    .venv/bin/python examples/zero_stages.py                   # the lecture's MLP on 8 fake CPU devices, or the GPUs
    .venv/bin/python examples/zero_stages.py --dim 256 --layers 8

The notes' table: ZeRO-1 shards the optimizer state over the N data-parallel ranks, ZeRO-2
also the gradients, ZeRO-3 also the params; all three send one reduce-scatter of the
gradients, and one all-gather of the params (ZeRO-3: two, forward and backward). With
AdamW in fp32 and Ψ the param bytes, a rank holds params Ψ, gradients Ψ and the two
moments 2Ψ, so the textbook per device is DP 4Ψ, ZeRO-1 2Ψ + 2Ψ/N, ZeRO-2 Ψ + 3Ψ/N,
ZeRO-3 4Ψ/N (the playbook's (2 + 2 + 12)Ψ of mixed precision has the same shape).

Each row builds the step for one stage on the same model and mesh size and prints, per
device and in Ψ: the params, gradients and optimizer state from the shardings the rules
give them; the textbook figure; and what XLA allocates for the compiled step
(`compiled.memory_analysis()`), split into what it keeps between steps (arguments +
outputs - donated: params, optimizer state, the batch) and its temporaries (gradients,
activations, gathered weights and work buffers, which the textbook leaves out). Last, the
collectives compiled into the step, in Ψ, next to the notes' communication column.
"""

import collections

import jax
import optax

import _common
import jshard
from jshard.models import mlp_loss

jshard.use_fake_cpu_devices(8, unless_accelerated=True)

# Fractions of Ψ per device that are split N ways: (params, gradients, optimizer state).
SHARDED = {"dp": (0, 0, 0), "zero1": (0, 0, 1), "zero2": (0, 1, 1), "zero3": (1, 1, 1)}
LECTURE_COMM = {"dp": "1 all-reduce", "zero1": "1 reduce-scatter + 1 all-gather",
                "zero2": "1 reduce-scatter + 1 all-gather", "zero3": "1 reduce-scatter + 2 all-gathers"}


def textbook(preset: str, n: int) -> float:
    """Params + gradients + Adam's two moments per device, in Ψ."""
    p, g, o = (1 / n if split else 1 for split in SHARDED[preset])
    return p + g + 2 * o


def measure(preset: str, args, n: int, data) -> dict:
    axis = "data" if preset == "dp" else "fsdp"
    mesh, rules = jshard.make_mesh(devices=jax.devices()[:n], **{axis: n}), jshard.preset(preset)
    model = _common.make_mlp(args)
    step = jshard.build_step(model, optax.adamw(1e-3), mlp_loss, jshard.Layout.of(rules, mesh), mesh)
    compiled = step.lower(step.state, step.shard_batch(data)).compile()
    memory = compiled.memory_analysis()
    comm = collections.Counter()
    for (kind, nbytes), count in _common.collectives(compiled).items():
        comm[kind] += nbytes * count
    return dict(
        psi=jshard.describe(model, mesh, rules).total_bytes,
        params=jshard.describe(model, mesh, rules, "param").bytes_per_device,
        grads=jshard.describe(model, mesh, rules, "grad").bytes_per_device,
        opt=jshard.describe(step.state.opt_state, mesh, rules, "opt").bytes_per_device,
        kept=memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes,
        temp=memory.temp_size_in_bytes,
        comm=comm,
    )


def main(argv=None) -> None:
    p = _common.parser(__doc__)
    p.add_argument("--ranks", type=int, default=None, help="N, the data-parallel ranks (default: every device)")
    args = p.parse_args(argv)
    n, data = args.ranks or jax.device_count(), _common.sample_data(args)
    rows = {preset: measure(preset, args, n, data) for preset in SHARDED}
    psi = rows["dp"]["psi"]
    print(f"MLP {args.layers} x {args.dim}x{args.dim}, Ψ = {psi} B of fp32 params, AdamW, N = {n} ranks, "
          f"batch {args.batch_size}; per device, in Ψ:")
    print(f"{'strategy':<9}{'params':>7}{'grads':>7}{'opt':>7}{'sum':>7}{'textbook':>9} |{'compiled':>9}{'kept':>7}"
          f"{'temp':>7}{'compiled B':>12}  collectives compiled, in Ψ | the notes")
    for preset, row in rows.items():
        state = (row["params"] + row["grads"] + row["opt"]) / psi
        compiled = row["kept"] + row["temp"]
        comm = ", ".join(f"{kind} {nbytes / psi:.2f}" for kind, nbytes in sorted(row["comm"].items()))
        print(f"{preset:<9}{row['params'] / psi:>7.3f}{row['grads'] / psi:>7.3f}{row['opt'] / psi:>7.3f}{state:>7.3f}"
              f"{textbook(preset, n):>9.3f} |{compiled / psi:>9.3f}{row['kept'] / psi:>7.3f}{row['temp'] / psi:>7.3f}"
              f"{compiled:>12}  {comm} | {LECTURE_COMM[preset]}")


if __name__ == "__main__":
    main()
