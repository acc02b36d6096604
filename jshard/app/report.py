"""What a training run prints: its set-up, before the first step, and its summary, after the last."""

from __future__ import annotations

import math
import statistics

import jax
import numpy as np

from jshard.app.components import Checkpointer, Evaluator, MetricsWriter, NonFiniteGuard, Profiler, RouterStats
from jshard.app.prepare import Setup
from jshard.distributed import axes_across_processes
from jshard.mesh import mesh_shape, mesh_text, xla_flags_line, xla_options_line
from jshard.models import DecoderConfig
from jshard.placement import describe, format_bytes


def _count(n: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f}"


def xla_text(plan, platform: str) -> str:
    """On a GPU, the devices line's tail: the XLA flags in effect and the step's own options
    (`Plan.xla_options`), as `jshard compile` prints them; elsewhere nothing."""
    if platform != "gpu":
        return ""
    return f"; XLA_FLAGS {xla_flags_line()}; this program's own options {xla_options_line(plan.xla_options)}"


def setup_lines(p: Setup, abstract_model, abstract_opt) -> list[str]:
    """The set-up, a line each: model, devices, strategy, memory per device, batch, training, data, split."""
    m, lay, d, optimizer = p.model, p.config.layout, p.config.data, p.config.optimizer
    params = describe(abstract_model, p.mesh, p.rules)
    opt = describe(abstract_opt, p.mesh, p.rules, "opt")
    count = sum(math.prod(r.shape) for r in params.rows)
    per_device = sum(r.bytes_per_device // r.dtype.itemsize for r in params.rows)
    held = p.precision.param.itemsize
    master = ""
    if p.precision.master:  # the optimizer's copy of the params, in the opt layout
        sharded = describe(abstract_model, p.mesh, p.rules, "opt").rows
        master_bytes = sum(r.bytes_per_device // r.dtype.itemsize * p.precision.master.itemsize for r in sharded)
        master = f"{p.precision.master.name} master {format_bytes(master_bytes)}, "
    mesh = " ".join(f"{k}={v}" for k, v in mesh_shape(p.mesh).items())
    pipeline = ""
    if p.microbatches:
        pipeline = (f", schedule {lay.schedule or 'gpipe'} over {p.microbatches} micro-batches, stage remat "
                    f"{lay.stage_remat or 'none'}")
    lines = [
        f"model       {m.family} {p.config.model.model}: {m.layers} layers, embed {m.embed}, {m.heads} heads"
        f"{f' ({m.kv_heads} kv)' if hasattr(m, 'kv_heads') else ''}, mlp {m.mlp}, "
        f"{_count(count)} params, vocab {m.vocab}"
        + (f" (table {m.vocab_rows}: padded to split, the pad never a token)" if m.vocab_rows != m.vocab else "")
        + _experts_line(m),
        f"devices     {jax.device_count()} × {jax.devices()[0].device_kind}, mesh {mesh}" + _processes(p.mesh)
        + xla_text(p.plan, jax.devices()[0].platform),
        f"strategy    {p.rules.name} (ZeRO stage {p.rules.zero}){pipeline}" + (f"; {p.auto}" if p.auto else ""),
        f"per device  {_count(per_device)} params ({format_bytes(per_device * held)} in {p.precision.param.name} "
        f"of {format_bytes(count * held)}), {master}optimizer state {format_bytes(opt.bytes_per_device)} of "
        f"{format_bytes(opt.total_bytes)}",
        f"batch       {d.batch_size} rows × {p.seq_len} tokens = {d.batch_size * p.seq_len} tokens per step "
        f"over {'+'.join(p.batch_axes) or 'no axis'}" + (f", {lay.grad_accum} micro-batches accumulated" if lay.grad_accum > 1 else "")
        + _context_line(p),
        f"training    {optimizer.steps} steps, AdamW lr {optimizer.lr:g} (warm-up {optimizer.warmup_steps}, cosine to {optimizer.lr / 10:g}), "
        f"clip 1.0, precision {p.precision.describe()}, remat {lay.remat}",
        f"data        {p.data.source}; seed {p.seed}",
        f"split       {len(p.split.train.tokens):,} tokens to train on ({p.split.train.windows:,} rows of {p.seq_len + 1}), "
        f"{len(p.split.eval):,} held out ({d.eval_split:g})" + (
            f", evaluated every {p.config.eval.eval_every} steps on {p.split.batches} × {d.batch_size // lay.grad_accum} rows"
            if p.config.eval.eval_every else ", not evaluated (--eval-every N)"),
    ]
    lines += [f"! {row.path}: {flag}" for row in params.flagged for flag in row.flags]
    return lines


def _experts_line(m: DecoderConfig) -> str:
    if not getattr(m, "experts", 0):
        return ""
    slots = "dropless" if m.capacity_factor is None else f"capacity factor {m.capacity_factor:g}"
    where = "every block" if m.moe_every == 1 else f"one block in {m.moe_every}"
    return (f"; a mixture of {m.experts} experts in {where}, top-{m.top_k} routed, {slots}, "
            f"balance loss weight {m.balance_loss:g}")


def _processes(mesh) -> str:
    """', 2 processes × 4 devices, across processes: data' in a multi-process run."""
    if jax.process_count() == 1:
        return ""
    across = axes_across_processes(mesh)
    return (f", {jax.process_count()} processes × {jax.local_device_count()} devices, across processes: "
            f"{', '.join(across) or 'none'}")


def _context_line(p: Setup) -> str:
    """How context parallelism splits each row, for the set-up's batch line ('' without it)."""
    axes, n = p.plan.context_axes, p.plan.context_shards
    if not axes:
        return ""
    return (f"; each row over {'+'.join(axes)} ({n} devices × 2 chunks of {p.seq_len // (2 * n)} tokens, "
            f"load-balanced; {p.rules.context_attention} attention)")


def title(p: Setup) -> str:
    """The run as a command: the summary's and the plot's title."""
    m = p.config.model
    return (f"jshard train {f'--init-from {m.init_from}' if m.init_from else f'--model {m.model}'} "
            f"--strategy {p.rules.name} --mesh {mesh_text(mesh_shape(p.mesh))}")


def summary(p: Setup, start: int, wall: float, metrics: MetricsWriter, evaluator: Evaluator,
            router: RouterStats | None, guard: NonFiniteGuard, checkpointer: Checkpointer, profiler: Profiler) -> str:
    """What the run did (steps `start` + 1.. in `wall` seconds), from what each component kept."""
    steps, log = p.config.optimizer.steps, p.config.logging
    losses, times, throughput = metrics.losses, metrics.times, metrics.throughput
    evaluated, routed, peak = evaluator.losses, router.routed if router else {}, throughput.peak
    steady = times[1:] or times  # the first step compiles
    step_s = statistics.median(steady)
    rows, tokens, flops_per_step = p.config.data.batch_size, throughput.tokens, throughput.flops
    last = losses[-min(10, len(losses)):]
    lines = [
        "",
        f"summary of {title(p)}",
        f"  steps       {start + 1}..{start + len(losses)} of {steps}, {len(losses) * tokens / 1e3:.1f} k tokens "
        f"({rows} × {p.seq_len} per step)",
        f"  loss        {losses[0]:.4f} at step {start + 1} -> {losses[-1]:.4f} at step {start + len(losses)} "
        f"(mean of the last {len(last)}: {statistics.fmean(last):.4f}; "
        f"uniform over the vocab: {math.log(p.model.vocab):.4f})",
        f"  time        {wall:.1f} s in all, first step (compiling) {times[0]:.2f} s, then {step_s * 1e3:.1f} ms "
        f"per step (median), {tokens / step_s / 1e3:.1f} k tokens/s",
    ]
    if evaluated:
        first, last_step = min(evaluated), max(evaluated)
        lines.append(f"  eval        loss {evaluated[last_step]:.4f}, perplexity {math.exp(evaluated[last_step]):.2f} at "
                     f"step {last_step} on {p.split.batches} × {evaluator.rows} held-out rows"
                     + (f" (step {first}: {evaluated[first]:.4f})" if first != last_step else ""))
    if routed:
        at = max(routed)
        load = np.asarray(routed[at]["expert_load"])
        lines.append(f"  experts     load per expert (of {p.model.top_k} choices per token) {load.min():.3f}..{load.max():.3f} "
                     f"(uniform {1 / p.model.experts:.3f}), {routed[at]['dropped']:.1%} of choices dropped, balance loss "
                     f"{routed[at]['balance_loss']:.4f} (1 = balanced) at step {at}, on its batch")
    if peak:
        lines.append(f"  MFU         {flops_per_step / step_s / peak.flops:.2%}: {flops_per_step / step_s / 1e9:.2f} "
                     f"GFLOP/s of model FLOPs (6·N + attention) over a peak of {peak.flops / 1e9:.1f} GFLOP/s")
        lines.append(f"  peak        {peak.source}")
    else:
        lines.append("  MFU         not known for this device: give its peak with --peak-tflops")
    if skipped := guard.skipped:
        lines.append(f"  skipped     {len(skipped)} update(s), their gradients not finite (--skip-nonfinite "
                     f"{guard.config.skip_nonfinite}): step(s) {', '.join(map(str, skipped[:10]))}"
                     f"{' ...' if len(skipped) > 10 else ''}")
    if checkpointer.saved_at:
        lines.append(f"  checkpoint  step {checkpointer.saved_at} in {p.checkpoints.directory} (resume with --resume)")
    if log.metrics:
        lines.append(f"  metrics     {log.metrics} (one JSON object per step)")
    if log.tensorboard:
        lines.append(f"  tensorboard {log.tensorboard} (the same numbers as scalars: tensorboard --logdir {log.tensorboard})")
    if traced := profiler.traced:
        lines.append(f"  profile     {log.profile} (jax.profiler trace of steps {traced.start + 1}..{traced[-1] + 1}: "
                     "*.xplane.pb for TensorBoard's profile plugin, perfetto_trace.json.gz for ui.perfetto.dev)")
    return "\n".join(lines)
