"""`jshard train`: a sharded GPT training run, on the text shipped with jshard or your own.

    jshard train                                   # small GPT, 8 fake CPU devices (or the local GPUs)
    jshard train --strategy zero3+tp --mesh fsdp=4,tensor=2 --precision bf16 --remat selective
    jshard train --data notes.txt --tokenizer bpe --eval-every 50 --plot curves.png
    jshard train --checkpoint-dir runs/a --checkpoint-every 50 ... ; jshard train ... --resume

One run: check every input (no device work until all are valid) -> print the set-up ->
place the model and the AdamW state by the strategy's rules (`jshard.init`, `build_step`)
-> restore a checkpoint onto them when resuming -> train: each step one global batch,
split over the batch axes, each shard's rows cut into `grad_accum` micro-batches whose gradients
the step adds up before its one reduction and update (`build_step(grad_accum=)`; and into
pipeline micro-batches); every `eval_every` steps the loss on held-out
rows, forward only (`step.loss`) -> save checkpoints (and the tokenizer beside them) ->
print a summary, and draw the curves (`curves.py`).

The parts live beside this module: `data.py` (files, memory maps, split, order,
per-process rows), `tokenizer.py` (bytes or BPE), `optim.py` (AdamW, schedule, sharded
clipping), `checkpoint.py` (orbax), `metrics.py` (FLOPs, peak, MFU, metrics file); the
step is `jshard.parallel.build_step`'s.
"""

# The run's own parts, beside this module: `train_config.py` (the config's sections and their
# checks), `prepare.py` (the set-up), `components.py` (what the loop asks each step), `report.py`
# (the set-up and summary text). (The docstring above is `jshard train --help`'s description.)

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time

import jax
from flax import nnx

import jshard
from jshard.app import curves, data, hf, optim, report
from jshard.app.components import (Checkpointer, Evaluator, MetricsWriter, NonFiniteGuard, Profiler, RouterStats,
                                   Throughput)
from jshard.app.prepare import Setup, model_identity, set_up
from jshard.app.train_config import TrainConfig
from jshard.distributed import is_main_process
from jshard.mesh import mesh_shape, mesh_text
from jshard.models import decoder, gpt_loss
from jshard.parallel import ShardedStep, TrainState
from jshard.parallel.step import step_from_plan


@dataclasses.dataclass
class TrainResult:
    losses: list[float]  # one per step run here
    first_step: int  # the step the run started from (0, or the checkpoint's)
    summary: str
    eval_losses: dict[int, float] = dataclasses.field(default_factory=dict)  # step -> held-out loss
    grad_norms: list[float] = dataclasses.field(default_factory=list)  # each step's gradients' global norm, clipped from


def train(config: TrainConfig, out=None) -> TrainResult:
    """Run `config`; prints the set-up, progress and a summary to `out` (default: stdout, on
    process 0 only in a multi-process run; every process returns the result)."""
    p = set_up(config)
    quiet = open(os.devnull, "w") if out is None and not is_main_process() else None
    try:
        return _train(p, out or quiet or sys.stdout)
    finally:
        if quiet:
            quiet.close()
        if p.checkpoints:
            p.checkpoints.close()  # a save in flight completes (killed, it leaves the one before)


def _train(p: Setup, out) -> TrainResult:
    """The loop: each step one global batch, then what each component decides for it."""
    c, say = p.config, functools.partial(print, file=out, flush=True)
    steps, rows, sharding = c.optimizer.steps, c.data.batch_size, p.plan.batch_sharding
    learning_rate = optim.schedule(c.optimizer.lr, steps, c.optimizer.warmup_steps)  # optimizer step i (from 0) uses (i)
    step, state, start, position = _start(p, optim.adamw(learning_rate), say)
    checkpointer = Checkpointer(p.checkpoints, c.checkpoint, steps, p.record)
    guard = NonFiniteGuard(c.optimizer, c.layout.precision, c.model.init_from, checkpointer)
    throughput = Throughput.of(p.model, p.seq_len, rows, p.precision.compute, c.logging.peak_tflops)
    # Held-out batches of one micro-batch's rows: an evaluation keeps no activations for a backward.
    evaluator = Evaluator(c.eval, steps, p.split, rows // c.layout.grad_accum, sharding)
    router = RouterStats(step) if getattr(p.model, "experts", 0) else None
    begin = time.perf_counter()
    with MetricsWriter(c.logging, steps, start, throughput, learning_rate, bool(p.record), out) as metrics, \
            Profiler(c.logging.profile, start, steps) as profiler:
        for done in (index + 1 for index in metrics.progress):
            with profiler.step(done - 1):
                tick = time.perf_counter()
                batch = p.split.train.batch(position, rows, sharding)
                state, loss = step(state, batch)  # (--grad-accum: the step runs the micro-batches itself)
                position += rows
                loss = float(loss)  # waits for the step
                seconds = time.perf_counter() - tick
                in_a_row = guard.check(done, loss, state)
            line = metrics.measure(done, loss, seconds, state, in_a_row)
            if evaluator.should_evaluate(done):
                line.add(*evaluator.evaluate(done, step, state))
            if router and metrics.should_log(done, line):
                line.add(*router(done, state, batch))
            metrics.write(done, line)
            if checkpointer.should_save(done):
                checkpointer.save(done, _portable(step, step.to_model_order(state)), _record(p, done, position, loss))
    checkpointer.wait()
    say(summary := report.summary(p, start, time.perf_counter() - begin, metrics, evaluator, router, guard,
                                  checkpointer, profiler))
    if c.logging.plot and is_main_process():
        history = curves.read_metrics(c.logging.metrics) if c.logging.metrics else metrics.records  # a resumed run's file has it all
        curves.metrics_png(history, c.logging.plot, title=report.title(p))
        say(f"  plot        {c.logging.plot}")
    return TrainResult(metrics.losses, start, summary, evaluator.losses, [r["grad_norm"] for r in metrics.records])


def _start(p: Setup, tx, say) -> tuple[ShardedStep, TrainState, int, int]:
    """The step, and the state, step number and data position the run starts from; the set-up
    printed, and the tokenizer saved beside the checkpoints."""

    def make_model():
        return decoder(p.model, nnx.Rngs(p.seed))

    abstract = nnx.eval_shape(make_model)
    say(f"jshard train: {p.model.family} {p.config.model.model} on {p.config.data.data or data.CORPUS}")
    for line in report.setup_lines(p, abstract, jax.eval_shape(tx.init, nnx.state(abstract))):
        say("  " + line)
    step = step_from_plan(p.plan, jshard.init(make_model, p.mesh, p.rules), tx, gpt_loss)
    init_from = p.config.model.init_from
    if not p.record and init_from:  # each device's blocks read from the files, in the master's dtype
        # in the model's layer order (an uneven pipeline's step holds padding rows the file has not)
        params = hf.load_params(init_from, p.model, _abstract(step.full_params(step.to_model_order(step.state))))
        say(f"  weights     from {init_from} (Hugging Face {hf.read_config(init_from)['model_type']})")
        started = step, step.from_model_order(step.with_params(step.state, params)), 0, 0
    elif not p.record:
        started = step, step.state, 0, 0
    else:
        started = _resume(p, step, say)
    if p.checkpoints and p.data.tokenizer and is_main_process():
        p.data.tokenizer.save(p.checkpoints.directory)  # beside the checkpoints: resume and generate read it
    return started


def _resume(p: Setup, step: ShardedStep, say) -> tuple[ShardedStep, TrainState, int, int]:
    """The checkpoint `p.record` names, restored into this step's layout."""
    start, position = p.record["step"], p.record["data_position"]
    # into this step's layout, the checkpoint in the model's layer order (`_portable`)
    saved = p.checkpoints.restore(start, _abstract(_portable(step, step.to_model_order(step.state))))
    state = TrainState(None, saved["opt_state"], step.state.model_state)  # (jshard's models hold Params only)
    state = step.from_model_order(step.with_params(state, saved["params"]))
    say(f"  resumed     step {start} from {p.checkpoints.directory} (saved under {p.record['strategy']} "
        f"on {p.record['mesh']}), data position {position} rows")
    saved, now = p.record.get("schedule"), p.config.optimizer.schedule()
    if saved and saved != now:  # the optimizer's step count carries on; the schedule is this run's
        changed = ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in now if saved.get(k) != now[k])
        say(f"  schedule    {changed}: from step {start + 1} the learning rate follows this run's warm-up and "
            f"cosine, not the checkpoint's run's (an uninterrupted run of {now['steps']} steps differs before it too)")
    return step, state, start, position


def _portable(step: ShardedStep, state: TrainState) -> dict:
    """What a checkpoint holds: the params at full precision (the fp32 master under `mixed`),
    so it restores under any --precision, and the optimizer's state (gradient accumulation
    keeps none: the step adds up its micro-batches itself), so under any --grad-accum; in the
    model's layer order (`ShardedStep.to_model_order`), so under any pipeline schedule."""
    return {"params": step.full_params(state), "opt_state": state.opt_state}


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def _record(p: Setup, step: int, position: int, loss: float) -> dict:
    """The JSON saved with a checkpoint: what resuming needs, and what it was saved under."""
    c = p.config
    return dict(step=step, data_position=position, model=model_identity(p.model), family=p.model.family,
                seed=p.seed, loss=loss, strategy=p.rules.name, mesh=mesh_text(mesh_shape(p.mesh)), batch_size=c.data.batch_size,
                seq_len=p.seq_len, precision=c.layout.precision, data=p.data.identity, eval_split=c.data.eval_split,
                tokenizer=p.data.tokenizer_identity, schedule=c.optimizer.schedule())
