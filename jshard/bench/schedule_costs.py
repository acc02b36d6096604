"""`jshard bench pipeline`: the four schedules on one model, mesh and batch.

Per schedule, one GPT training step (AdamW) pipelined over `stage`:

    ticks, bubble      the tick table's length and idle slots per busy slot (unit costs)
    slots              activation + gradient buffer slots per device (the executor's buffers)
    flops              compiled matmul FLOPs per device (mean over stages) / the unpipelined step's
    temp_bytes         compiled.memory_analysis() temporaries per device, and / GPipe's
    step_s             median step time, and / GPipe's
    vs_flat            step time / the same step unpipelined (the stage axis used as data)
    parity_rel_err     the step's loss against one device's

The textbook: a pipelined step costs (1 + bubble) × the work. By default each stage keeps
its residuals from F to the backward, so the work is the unpipelined step's; with
`--stage-remat full` the backward recomputes the chunk's forward (BW = F + 2F instead of
2F: 4/3 of the work; ZB-H1's B and W each recompute it: 5/3).
On fake CPU devices all "devices" share the host's cores, so an idle stage frees a core
instead of wasting it: there the measured ratio shows the extra work, not the bubble.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from flax import nnx

import jshard
from jshard import hlo
from jshard.layout import Layout
from jshard.mesh import default_mesh, format_mesh, mesh_shape, mesh_sizes
from jshard.metrics import median_step_seconds
from jshard.models import DecoderConfig, decoder, gpt_loss
from jshard.parallel import build_step
from jshard.parallel.tick_branches import matmul_flops
from jshard.parallel.tick_program import compile_program, work


def run_schedules(config: DecoderConfig, mesh: str | None, schedules, microbatches: int, virtual: int | None = None,
                  stage_remat: str = "none", batch_size: int = 32, repeats: int = 5) -> list[dict]:
    """Every row of `jshard bench pipeline`: one per schedule name in `schedules`, on `mesh`
    (--mesh; None: dp+pp's default mesh over the devices), printed as it comes."""
    batch = np.random.default_rng(0).integers(0, config.vocab, (batch_size, config.seq_len + 1))
    expected = float(gpt_loss(decoder(config, nnx.Rngs(0)), batch))
    pipelined = jshard.preset("dp+pp")
    mesh = jshard.make_mesh(**mesh_sizes(mesh, pipelined, jax.device_count()))
    tx = optax.adamw(1e-3)

    def make_model():
        return decoder(config, nnx.Rngs(0))

    flat_rules = jshard.preset("dp")  # every device a data shard
    flat = build_step(make_model(), tx, gpt_loss, Layout.of(flat_rules, default_mesh(flat_rules, jax.device_count())))
    flat_tokens = flat.shard_batch(batch)
    flat_compiled = flat.lower(flat.state, flat_tokens).compile()
    flat_flops = hlo.matmul_flops(flat_compiled.as_text())
    flat_s = median_step_seconds(flat, flat_tokens, repeats, flat_compiled)
    device = jax.devices()[0]
    print(f"# jshard bench pipeline: {jax.device_count()} × {device.device_kind} ({device.platform}), "
          f"mesh {format_mesh(mesh_shape(mesh))}, m={microbatches}, {config.family} layers={config.layers} "
          f"embed={config.embed} seq={config.seq_len} batch={batch_size}, AdamW, fp32, stage remat "
          f"{stage_remat}, median of {repeats}")
    print(f"# unpipelined (dp over all {jax.device_count()} devices): {flat_s * 1e3:.1f} ms, {flat_flops / 1e9:.3f} "
          f"GFLOP of matmuls per device; textbook pipelined = (1 + bubble) x the work (flops) of it")
    if device.platform == "cpu":
        print("# fake CPU devices share the host's cores: idle stages cost nothing, so vs_flat shows work, not bubble")
    print(f"{'schedule':<13}{'ticks':>6}{'bubble':>8}{'slots':>7}{'flops':>7}{'temp B':>11}{'/gpipe':>8}"
          f"{'step ms':>9}{'/gpipe':>8}{'vs_flat':>8}{'textbook':>9}{'parity':>9}")
    rows = []
    for name in schedules:
        step = build_step(make_model(), tx, gpt_loss, Layout.of(
            pipelined, mesh, microbatches=microbatches, schedule=name.strip(), stage_remat=stage_remat,
            virtual=virtual if name.strip() == "interleaved" else None), mesh)  # v is interleaved's alone
        tokens = step.shard_batch(batch)
        program, schedule = compile_program(step.schedule, stage_remat), step.schedule
        compiled = step.lower(step.state, tokens).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        flops = float(np.mean(matmul_flops(schedule, compiled.as_text(), stage_remat, step.plan.stage_layers))) / flat_flops
        loss, _ = step.value_and_grad(step.state, tokens)
        row = dict(schedule=schedule.name, stage_remat=stage_remat, ticks=schedule.ticks,
                   bubble=schedule.bubble_fraction, slots=program.act_slots + program.grad_slots,
                   flops_vs_flat=flops, textbook_flops=work(schedule, stage_remat), temp_bytes=temp,
                   step_s=median_step_seconds(step, tokens, repeats, compiled), flat_step_s=flat_s,
                   textbook_vs_flat=(1 + schedule.bubble_fraction) * work(schedule, stage_remat),
                   parity_rel_err=abs(float(loss) - expected) / abs(expected))
        rows.append(row)
        first = rows[0]
        print(f"{row['schedule']:<13}{row['ticks']:>6}{row['bubble']:>8.3f}{row['slots']:>7}{flops:>7.3f}{temp:>11}"
              f"{temp / first['temp_bytes']:>8.2f}{row['step_s'] * 1e3:>9.1f}{row['step_s'] / first['step_s']:>8.2f}"
              f"{row['step_s'] / flat_s:>8.2f}{row['textbook_vs_flat']:>9.2f}{row['parity_rel_err']:>9.1e}", flush=True)
    return rows
