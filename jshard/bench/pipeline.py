"""`jshard bench pipeline`: the four schedules on one model, mesh and batch.

Per schedule, one GPT training step (AdamW) pipelined over `stage`:

    ticks, bubble      the tick table's length and idle slots per busy slot (unit costs)
    slots              activation + gradient buffer slots per device (the executor's buffers)
    temp_bytes         compiled.memory_analysis() temporaries per device, and / GPipe's
    step_s             median step time, and / GPipe's
    vs_flat            step time / the same step unpipelined (the stage axis used as data)
    parity_rel_err     the step's loss against one device's

The textbook: a pipelined step costs (1 + bubble) × the work, and this executor's backward
recomputes the chunk's forward (BW = F + 2F instead of 2F): 4/3 of the unpipelined work.
On fake CPU devices all "devices" share the host's cores, so an idle stage frees a core
instead of wasting it: there the measured ratio shows the extra work, not the bubble.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
from flax import nnx

import jshard
from jshard.mesh import use_fake_cpu_devices_unless_accelerated
from jshard.metrics import median_step_seconds
from jshard.models import GPT, GPTConfig, gpt_loss
from jshard.parallel import build_step
from jshard.parallel.pipeline import compile_program
from jshard.parallel.schedules import SCHEDULES

RECOMPUTE = 4 / 3  # F + (F + 2F) per micro-batch and stage, against F + 2F


def add_parser(benches) -> None:
    parser = benches.add_parser("pipeline", help="pipeline schedules: step time, memory and bubble side by side")
    add = parser.add_argument
    add("--stages", type=int, default=2)
    add("--microbatches", type=int, default=8)
    add("--schedules", default=",".join(SCHEDULES), help="comma-separated, from: " + ", ".join(SCHEDULES))
    add("--layers", type=int, default=8)
    add("--embed", type=int, default=128)
    add("--seq-len", type=int, default=64)
    add("--batch-size", type=int, default=32)
    add("--repeats", type=int, default=5, help="timed steps; the median is reported")
    add("--json", metavar="FILE", help="also write the rows to FILE")
    add("--fake-devices", type=int, default=8, help="CPU devices to fake when no accelerator is present")
    parser.set_defaults(run=run)


def run(args) -> int:
    use_fake_cpu_devices_unless_accelerated(args.fake_devices)
    config = GPTConfig(seq_len=args.seq_len, embed=args.embed, heads=4, mlp=4 * args.embed, layers=args.layers)
    batch = np.random.default_rng(0).integers(0, config.vocab, (args.batch_size, args.seq_len + 1))
    expected = float(gpt_loss(GPT(config, rngs=nnx.Rngs(0)), batch))
    data = jax.device_count() // args.stages
    tx = optax.adamw(1e-3)

    def make_model():
        return GPT(config, rngs=nnx.Rngs(0))

    flat = build_step(make_model(), tx, gpt_loss, jshard.make_mesh(data=-1), jshard.preset("dp"))
    flat_s = median_step_seconds(flat, flat.shard_batch(batch), args.repeats)
    device = jax.devices()[0]
    print(f"# jshard bench pipeline: {jax.device_count()} × {device.device_kind} ({device.platform}), "
          f"mesh data={data},stage={args.stages}, m={args.microbatches}, GPT layers={config.layers} "
          f"embed={config.embed} seq={args.seq_len} batch={args.batch_size}, AdamW, fp32, median of {args.repeats}")
    print(f"# unpipelined (dp over all {jax.device_count()} devices): {flat_s * 1e3:.1f} ms; textbook pipelined "
          f"= (1 + bubble) x {RECOMPUTE:.2f} of it (backward recomputes the chunk's forward)")
    if device.platform == "cpu":
        print("# fake CPU devices share the host's cores: idle stages cost nothing, so vs_flat shows work, not bubble")
    print(f"{'schedule':<13}{'ticks':>6}{'bubble':>8}{'slots':>7}{'temp B':>11}{'/gpipe':>8}"
          f"{'step ms':>9}{'/gpipe':>8}{'vs_flat':>8}{'textbook':>9}{'parity':>9}")
    rows = []
    for name in filter(None, args.schedules.split(",")):
        step = build_step(make_model(), tx, gpt_loss, jshard.make_mesh(data=data, stage=args.stages),
                          jshard.preset("dp+pp"), args.microbatches, name.strip())
        tokens = step.shard_batch(batch)
        program, schedule = compile_program(step.schedule), step.schedule
        temp = step.lower(step.state, tokens).compile().memory_analysis().temp_size_in_bytes
        loss, _ = step.value_and_grad(step.state, tokens)
        row = dict(schedule=schedule.name, ticks=schedule.ticks, bubble=schedule.bubble_fraction,
                   slots=program.act_slots + program.grad_slots, temp_bytes=temp,
                   step_s=median_step_seconds(step, tokens, args.repeats), flat_step_s=flat_s,
                   textbook_vs_flat=(1 + schedule.bubble_fraction) * RECOMPUTE,
                   parity_rel_err=abs(float(loss) - expected) / abs(expected))
        rows.append(row)
        first = rows[0]
        print(f"{row['schedule']:<13}{row['ticks']:>6}{row['bubble']:>8.3f}{row['slots']:>7}{temp:>11}"
              f"{temp / first['temp_bytes']:>8.2f}{row['step_s'] * 1e3:>9.1f}{row['step_s'] / first['step_s']:>8.2f}"
              f"{row['step_s'] / flat_s:>8.2f}{row['textbook_vs_flat']:>9.2f}{row['parity_rel_err']:>9.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
