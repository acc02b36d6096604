"""`jshard bench strategies`: each strategy's explicit step against the textbook and XLA.

For every strategy and combination, on the current devices (8 fake CPU devices when no
accelerator is present), one GPT training step (AdamW) gives one row:

    comm_bytes         collectives compiled into the step (HLO), K bytes per device
    textbook_bytes     what docs/strategies.md says the strategy moves (see `textbook_bytes`)
    memory_bytes_per_device  compiled.memory_analysis(): arguments + outputs - donated + temporaries
    textbook_memory_bytes    params, grads and Adam's two moments in their layouts, plus two
                       gathered layers under ZeRO-3 (activations are not counted)
    parity_rel_err     worst per-param relative error of the step's gradients vs one device
    step_s             median time of the explicit step (jit of shard_map)
    gspmd_step_s       the same model, mesh and param shardings through plain jax.jit,
                       XLA's own partitioner choosing the collectives
"""

from __future__ import annotations

import json
import math
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

import jshard
from jshard import hlo
from jshard.mesh import mesh_shape, parse_axis_sizes, use_fake_cpu_devices_unless_accelerated
from jshard.models import GPT, GPTConfig, gpt_loss
from jshard.parallel import ShardedStep, build_step

PLANS = (
    ("dp", "data=8"), ("zero1", "fsdp=8"), ("zero2", "fsdp=8"), ("zero3", "fsdp=8"),
    ("dp+tp", "data=2,tensor=4"), ("dp+tp+sp", "data=2,tensor=4"), ("dp+fsdp", "data=2,fsdp=4"),
    ("fsdp+tp", "fsdp=4,tensor=2"), ("dp+fsdp+tp", "data=2,fsdp=2,tensor=2"),
    ("dp+fsdp+tp+sp", "data=2,fsdp=2,tensor=2"),
)
COLUMNS = ("strategy", "mesh", "comm_bytes", "textbook_bytes", "comm_ratio", "memory_bytes_per_device",
           "textbook_memory_bytes", "parity_rel_err", "step_s", "gspmd_step_s", "speed_ratio")


def add_parser(benches) -> None:
    parser = benches.add_parser("strategies", help="explicit steps vs textbook bytes, memory, one device and XLA's partitioner")
    add = parser.add_argument
    add("--plans", default=";".join(f"{p}@{m}" for p, m in PLANS),
        help="';'-separated preset@mesh, e.g. 'dp@data=8;zero3@fsdp=8' (default: every strategy on 8 devices)")
    add("--layers", type=int, default=4)
    add("--embed", type=int, default=128)
    add("--heads", type=int, default=4)
    add("--seq-len", type=int, default=64)
    add("--batch-size", type=int, default=16)
    add("--repeats", type=int, default=5, help="timed steps; the median is reported")
    add("--json", metavar="FILE", help="also write the rows to FILE")
    add("--fake-devices", type=int, default=8, help="CPU devices to fake when no accelerator is present")
    parser.set_defaults(run=run)


def textbook_bytes(step: ShardedStep, config: GPTConfig, batch_shape) -> int:
    """Bytes per device per step that docs/strategies.md's formulas give for this step.

    Per param of S bytes: ZeRO-3 all-gathers its gathered size twice and reduce-scatters it
    once; ZeRO-1/2 reduce-scatter and all-gather it once each; what is left of the batch
    axes all-reduces the (possibly scattered) gradient. Per transformer block with tensor
    parallelism over its activation A = (local batch, seq, embed): 4 all-reduces of A; with
    sequence parallelism 4 all-gathers and 4 reduce-scatters of A.
    """
    sizes = mesh_shape(step.mesh)
    zero = {a for a in step.rules.zero_axes if sizes[a] > 1}

    def shards(layout, skip=frozenset()):
        return math.prod(sizes[a] for axes in layout for a in axes if a not in skip)

    total = 0
    for leaf, param, opt in zip(jax.tree.leaves(step.state.params), step.param_layouts, step.opt_layouts):
        size = leaf.size * leaf.dtype.itemsize
        in_param = {a for axes in param for a in axes} & zero
        if in_param:  # ZeRO-3: gathered forward and backward, its gradient scattered
            total += 3 * size // shards(param, skip=in_param)
        elif shards(opt) > shards(param):  # ZeRO-1/2
            total += 2 * size // shards(param)
        if any(sizes[a] > 1 and not any(a in axes for axes in opt) for a in step.batch_axes):
            total += size // shards(opt)  # all-reduce over the plain data-parallel axes
    tensor = sizes.get("tensor", 1)
    if tensor > 1:
        local_batch = batch_shape[0] // step.data_shards
        activation = local_batch * (batch_shape[1] - 1) * config.embed * np.dtype(config.dtype).itemsize
        sequence_parallel = step.rules.spec(("seq",), None, step.mesh, "activation") != jax.P(None)
        total += config.layers * activation * (8 if sequence_parallel else 4)
    return total


def textbook_memory(step: ShardedStep, config: GPTConfig) -> int:
    sizes = mesh_shape(step.mesh)

    def local(leaf, layout):
        return leaf.size * leaf.dtype.itemsize // math.prod(sizes[a] for axes in layout for a in axes)

    leaves = jax.tree.leaves(step.state.params)
    params = sum(local(x, p) for x, p in zip(leaves, step.param_layouts))
    grad_layouts = step.opt_layouts if step.rules.zero >= 2 else step.param_layouts
    grads = sum(local(x, g) for x, g in zip(leaves, grad_layouts))
    moments = 2 * sum(local(x, o) for x, o in zip(leaves, step.opt_layouts))
    gathered = 0
    if step.rules.zero == 3 and any(sizes[a] > 1 for a in step.rules.zero_axes):
        stacked = [v.get_value() for _, v in nnx.to_flat_state(step.state.params)
                   if (v.get_metadata().get("out_sharding") or (None,))[0] == "layers"]
        one_layer = sum(x.size * x.dtype.itemsize for x in stacked) // config.layers
        gathered = 2 * one_layer // sizes.get("tensor", 1)  # in use, and the next arriving
    return params + grads + moments + gathered


def _median_seconds(run_once, repeats: int) -> float:
    run_once()  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_once()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _gspmd_step(make_model, tx, mesh, rules):
    """The same training step through plain jax.jit: params and optimizer state placed by
    the rules, activations constrained by them, XLA's partitioner inserting collectives."""
    model = jshard.init(make_model, mesh, rules)
    optimizer = jshard.shard(nnx.Optimizer(model, tx, wrt=nnx.Param), mesh, rules, "opt")
    model_def, optimizer_def = nnx.graphdef(model), nnx.graphdef(optimizer)
    out_shardings = (jshard.shardings(model, mesh, rules), jshard.shardings(optimizer, mesh, rules, "opt"), None)

    def train_step(model_state, optimizer_state, tokens):
        model, optimizer = nnx.merge(model_def, model_state), nnx.merge(optimizer_def, optimizer_state)
        loss, grads = nnx.value_and_grad(gpt_loss)(model, tokens)
        optimizer.update(model, grads)
        return nnx.state(model), nnx.state(optimizer), loss

    return jax.jit(train_step, donate_argnums=(0, 1), out_shardings=out_shardings), nnx.state(model), nnx.state(optimizer)


def bench_plan(preset: str, mesh_text: str, config: GPTConfig, batch, reference, repeats: int) -> dict:
    mesh, rules = jshard.make_mesh(**parse_axis_sizes(mesh_text)), jshard.preset(preset)
    tx = optax.adamw(1e-3)

    def make_model():
        return GPT(config, rngs=nnx.Rngs(0))

    step = build_step(make_model(), tx, gpt_loss, mesh, rules)
    tokens = step.shard_batch(batch)
    compiled = step.lower(step.state, tokens).compile()
    memory = compiled.memory_analysis()
    comm = sum(c.bytes * c.count for c in hlo.collectives(compiled.as_text()))
    textbook = textbook_bytes(step, config, batch.shape)

    _, grads = step.value_and_grad(step.state, tokens)
    expected = dict(nnx.to_flat_state(reference))
    parity = max(
        float(np.linalg.norm(np.asarray(g.get_value()) - np.asarray(expected[path].get_value()))
              / np.linalg.norm(np.asarray(expected[path].get_value())))
        for path, g in nnx.to_flat_state(grads)
    )

    state = step.state

    def explicit_once():
        nonlocal state
        state, loss = step(state, tokens)
        loss.block_until_ready()

    gspmd, model_state, optimizer_state = _gspmd_step(make_model, tx, mesh, rules)
    gspmd_tokens = jax.device_put(batch, step.shard_batch(batch).sharding)

    def gspmd_once():
        nonlocal model_state, optimizer_state
        with jshard.activate(mesh, rules):
            model_state, optimizer_state, loss = gspmd(model_state, optimizer_state, gspmd_tokens)
        loss.block_until_ready()

    step_s, gspmd_s = _median_seconds(explicit_once, repeats), _median_seconds(gspmd_once, repeats)
    return dict(
        strategy=rules.name, mesh=mesh_text, comm_bytes=comm, textbook_bytes=textbook,
        comm_ratio=comm / textbook if textbook else float("nan"),
        memory_bytes_per_device=memory.argument_size_in_bytes + memory.output_size_in_bytes
        - memory.alias_size_in_bytes + memory.temp_size_in_bytes,
        textbook_memory_bytes=textbook_memory(step, config), parity_rel_err=parity,
        step_s=step_s, gspmd_step_s=gspmd_s, speed_ratio=step_s / gspmd_s,
    )


def format_row(row: dict) -> str:
    return (
        f"{row['strategy']:<16}{row['mesh']:<24}{row['comm_bytes']:>11}{row['textbook_bytes']:>11}"
        f"{row['comm_ratio']:>7.2f}{row['memory_bytes_per_device']:>11}{row['textbook_memory_bytes']:>11}"
        f"{row['parity_rel_err']:>10.1e}{row['step_s'] * 1e3:>9.1f}{row['gspmd_step_s'] * 1e3:>9.1f}{row['speed_ratio']:>7.2f}"
    )


HEADER = (f"{'strategy':<16}{'mesh':<24}{'comm B':>11}{'textbook':>11}{'ratio':>7}{'memory B':>11}"
          f"{'textbook':>11}{'parity':>10}{'step ms':>9}{'xla ms':>9}{'speed':>7}")


def run(args) -> int:
    use_fake_cpu_devices_unless_accelerated(args.fake_devices)
    config = GPTConfig(seq_len=args.seq_len, embed=args.embed, heads=args.heads, mlp=4 * args.embed, layers=args.layers)
    batch = np.random.default_rng(0).integers(0, config.vocab, (args.batch_size, args.seq_len + 1))
    reference = nnx.grad(gpt_loss)(GPT(config, rngs=nnx.Rngs(0)), batch)
    device = jax.devices()[0]
    print(f"# jshard bench strategies: {jax.device_count()} × {device.device_kind} ({device.platform}), GPT "
          f"layers={config.layers} embed={config.embed} heads={config.heads} seq={args.seq_len} batch={args.batch_size}, "
          f"AdamW, fp32, median of {args.repeats}")
    if device.platform == "cpu":
        print("# fake CPU devices: times are threads of one process; bytes and memory are exact")
    print(HEADER)
    rows = []
    for plan in filter(None, args.plans.split(";")):
        preset, _, mesh_text = plan.partition("@")
        rows.append(bench_plan(preset.strip(), mesh_text.strip(), config, batch, reference, args.repeats))
        print(format_row(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{key: row[key] for key in COLUMNS} for row in rows], f, indent=1)
    return 0
