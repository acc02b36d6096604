"""What a training run's loop asks each step (`jshard.app.training`): each component takes its
own config section and decides its part, the loop only sequences them.

    Profiler        --profile: a jax.profiler trace of PROFILE_STEPS steps after the compiling one
    NonFiniteGuard  a non-finite loss, or more non-finite gradients in a row than --skip-nonfinite: stop
    MetricsWriter   each step's record (metrics file, TensorBoard, the progress bar, a printed line)
    Evaluator       every `eval_every` steps, the held-out loss, forward only
    RouterStats     a mixture of experts' router statistics on the logged steps' batches
    Checkpointer    a save every `checkpoint_every` steps and at the last
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from jshard.app import data, optim
from jshard.app.checkpoint import Checkpoints
from jshard.app.train_config import CheckpointConfig, EvalConfig, LoggingConfig, OptimizerConfig, TrainError
from jshard.distributed import is_main_process
from jshard.metrics import PROFILE_STEPS, MetricsFile, Peak, device_memory, device_peak, flops_per_token
from jshard.parallel import ShardedStep, TrainState


class Profiler(contextlib.ExitStack):
    """--profile DIR: traces the steps `traced` names (none without a directory)."""

    def __init__(self, directory: str | None, start: int, steps: int):
        super().__init__()
        self.directory = directory
        first = start + 1 if steps - start > 1 else start  # after the compiling step, where there is one
        self.traced = range(first, min(first + PROFILE_STEPS, steps)) if directory else range(0)

    @contextlib.contextmanager
    def step(self, index: int):
        if self.traced and index == self.traced.start:
            self.enter_context(jax.profiler.trace(self._directory(), create_perfetto_trace=True))
        yield
        if self.traced and index == self.traced[-1]:
            self.close()

    def _directory(self) -> str:
        """DIR, or DIR/process_<i> for each process of a multi-process run."""
        if jax.process_count() == 1:
            return self.directory
        return os.path.join(self.directory, f"process_{jax.process_index()}")


class Checkpointer:
    """Saves every `checkpoint_every` steps and at the last (none without a checkpoint dir)."""

    def __init__(self, checkpoints: Checkpoints | None, config: CheckpointConfig, steps: int, resumed: dict | None):
        self.checkpoints, self.every, self.steps = checkpoints, config.checkpoint_every, steps
        self.directory = config.checkpoint_dir
        self.resumed = resumed and resumed["step"]  # the checkpoint the run started from
        self.saved_at = None  # this run's last save

    def should_save(self, step: int) -> bool:
        return bool(self.checkpoints) and (step == self.steps or bool(self.every and step % self.every == 0))

    def save(self, step: int, tree: dict, record: dict) -> None:
        self.checkpoints.save(step, tree, record)
        self.saved_at = step

    def wait(self) -> None:
        """Until the last save is written: the summary names a checkpoint once it is."""
        if self.checkpoints:
            self.checkpoints.wait()


class NonFiniteGuard:
    """A non-finite update is not applied (`optim.skip_nonfinite`), so the state stays finite; the
    run stops at a non-finite loss, or after more than `skip_nonfinite` such updates in a row."""

    def __init__(self, config: OptimizerConfig, precision: str, init_from: str | None, checkpointer: Checkpointer):
        self.config, self.precision, self.init_from, self.checkpointer = config, precision, init_from, checkpointer
        self.skipped = []  # the steps whose update was skipped

    def check(self, step: int, loss: float, state: TrainState) -> int:
        """The non-finite updates in a row up to `step`; TrainError where the run stops."""
        in_a_row = int(optim.skipped(state.opt_state))
        if not math.isfinite(loss) or in_a_row > self.config.skip_nonfinite:
            raise TrainError(self._stopped(step, loss, in_a_row, state))
        if in_a_row:
            self.skipped.append(step)
        return in_a_row

    def _stopped(self, step: int, loss: float, in_a_row: int, state: TrainState) -> str:
        """The line a run stops with: nothing after it is saved. `state`: after that step, whose
        non-finite update was not applied."""
        c, saved_at, resumed = self.config, self.checkpointer.saved_at, self.checkpointer.resumed
        kept = (f"the last checkpoint, step {saved_at or resumed} in {self.checkpointer.directory}, is kept"
                if saved_at or resumed else "no checkpoint was written")
        lower = f"a lower --lr (it is {c.lr}){', --precision fp32' if self.precision != 'fp32' else ''}"
        if step == (resumed or 0) + 1 and not math.isfinite(loss):  # before any update
            started = (f"checkpoint step {resumed}" if resumed else self.init_from) or "the random init"
            if all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(state.params)):  # the forward overflowed
                fix = "--precision fp32, or other weights" if self.precision != "fp32" else "other weights or data"
                return (f"step {step}: the loss is {loss} at the first step, before any update, though the params it "
                        f"started from ({started}) are finite: the forward overflows in {self.precision}; training "
                        f"stopped, {kept}. Fix: {fix}.")
            return (f"step {step}: the loss is {loss} at the first step, before any update: the params it started from "
                    f"({started}) are not finite; training stopped, {kept}. Fix: start from another checkpoint (delete "
                    "this one to resume from the one before), or from other weights.")
        resume = "; --resume continues from the one kept" if saved_at or resumed else ""
        if math.isfinite(loss):  # a finite loss whose gradients are not: their update was not applied
            what = (f"the gradients are not finite (the loss, {loss:.4f}, is); their update was not applied"
                    if in_a_row == 1 else f"the gradients were not finite {in_a_row} steps in a row (--skip-nonfinite "
                                          f"{c.skip_nonfinite}); none of those updates was applied")
            go_on = "" if c.skip_nonfinite else "; or --skip-nonfinite N to skip up to N such steps in a row and go on"
            return f"step {step}: {what}; training stopped, {kept}, nothing after it saved. Fix: {lower}{go_on}{resume}."
        return (f"step {step}: the loss is {loss} after the updates before it; training stopped, {kept}, nothing after "
                f"it saved. Fix: {lower}{resume}.")


@dataclasses.dataclass
class Throughput:
    """A step's tokens and model FLOPs, and the devices' peak (None: not known) for MFU."""

    tokens: int
    flops: float
    peak: Peak | None

    @classmethod
    def of(cls, model, seq_len: int, rows: int, compute_dtype, peak_tflops: float | None) -> Throughput:
        tokens = rows * seq_len
        return cls(tokens, flops_per_token(model, seq_len) * tokens, device_peak(jax.devices(), compute_dtype, peak_tflops))

    def mfu(self, seconds: float) -> float | None:
        return self.flops / seconds / self.peak.flops if self.peak else None


@dataclasses.dataclass
class Line:
    """One step's record (the metrics file's object) and the text the progress shows for it."""

    record: dict
    text: str

    def add(self, record: dict, text: str) -> None:
        self.record.update(record)
        self.text += text


class MetricsWriter(contextlib.ExitStack):
    """Each step's record, written by the main process (--metrics, --tensorboard) and kept for the
    summary and the plot; the progress bar, and a printed line every `log_every` steps."""

    def __init__(self, config: LoggingConfig, steps: int, start: int, throughput: Throughput, learning_rate,
                 append: bool, out):
        super().__init__()
        self.config, self.steps, self.start, self.throughput, self.learning_rate = config, steps, start, throughput, learning_rate
        self.log_every, self.out = config.log_every or max(1, steps // 10), out
        self.losses, self.times, self.records = [], [], []
        writes = is_main_process()  # one writer of the shared files
        self.progress = self.enter_context(tqdm(
            range(start, steps), initial=start, total=steps, desc="train", unit="step", dynamic_ncols=True,
            mininterval=0.5, disable=None if writes else True))  # None: no bar where stderr is no terminal
        self.file = self.enter_context(contextlib.closing(MetricsFile(
            config.metrics if writes else None, append=append, tensorboard=config.tensorboard if writes else None)))

    def measure(self, step: int, loss: float, seconds: float, state: TrainState, in_a_row: int) -> Line:
        """Step `step`'s numbers; `in_a_row`: its update skipped, its gradients not finite."""
        self.losses.append(loss)
        self.times.append(seconds)
        norm = None if in_a_row else float(optim.grad_norm(state.opt_state))  # (the clip keeps it)
        tokens, mfu = self.throughput.tokens, self.throughput.mfu(seconds)
        record = dict(step=step, loss=loss, lr=float(self.learning_rate(step - 1)), grad_norm=norm, step_s=seconds,
                      tokens_per_s=tokens / seconds, mfu=mfu) | device_memory() | ({"skipped": True} if in_a_row else {})
        text = f"loss {loss:.4f}  {seconds * 1e3:8.1f} ms  {tokens / seconds / 1e3:7.1f}k tok/s" + (
            f"  MFU {mfu:6.2%}" if mfu is not None else "") + ("  (gradients not finite: update skipped)" if in_a_row else "")
        return Line(record, text)

    def should_log(self, step: int, line: Line) -> bool:
        """Printed: every `log_every` steps, the first and last, and each evaluated."""
        return step % self.log_every == 0 or step in (self.steps, self.start + 1) or "eval_loss" in line.record

    def write(self, step: int, line: Line) -> None:
        self.file.write(**line.record)
        self.records.append(line.record)
        self.progress.set_postfix_str(line.text, refresh=False)
        if self.should_log(step, line):
            self.progress.write(f"step {step:5d}  {line.text}" + ("  (compiling)" if step == self.start + 1 else ""),
                                file=self.out)


class Evaluator:
    """The mean loss over held-out batches every `eval_every` steps and at the last: forward only,
    in the step's layouts (none without `eval_every`)."""

    def __init__(self, config: EvalConfig, steps: int, split: data.Split, rows: int, sharding):
        self.every, self.steps, self.split, self.rows, self.sharding = config.eval_every, steps, split, rows, sharding
        self.batches = None
        self.losses = {}  # step -> held-out loss

    def should_evaluate(self, step: int) -> bool:
        return bool(self.every) and (step % self.every == 0 or step == self.steps)

    def evaluate(self, step: int, sharded: ShardedStep, state: TrainState) -> tuple[dict, str]:
        # The same held-out rows every time: built once, on the devices from then on.
        self.batches = self.batches or [self.split.eval_batch(k, self.rows, self.sharding)
                                        for k in range(self.split.batches)]
        loss = self.losses[step] = float(np.mean([float(sharded.loss(state, batch)) for batch in self.batches]))
        return dict(eval_loss=loss, eval_perplexity=math.exp(loss)), f"  eval {loss:.4f}"


class RouterStats:
    """A mixture of experts' router statistics on a step's batch (`Llama.router_stats`), outside
    the step: a forward under jax.jit, the compiler placing it, on the state's params. Means over
    the MoE layers but `expert_load`, one list per layer."""

    def __init__(self, step: ShardedStep):
        self.step = step
        self.routed = {}  # step -> its statistics
        graphdef = nnx.graphdef(step.model(step.state))

        @jax.jit
        def stats(model_state, tokens):
            routed = nnx.merge(graphdef, model_state).router_stats(tokens[:, :-1])
            return dict(balance_loss=routed["balance"].mean(), dropped=routed["dropped"].mean(),
                        expert_load=routed["load"])

        self._stats = stats

    def __call__(self, step: int, state: TrainState, batch) -> tuple[dict, str]:
        found = jax.device_get(self._stats(nnx.state(self.step.model(state)), batch))
        routed = self.routed[step] = dict(balance_loss=float(found["balance_loss"]), dropped=float(found["dropped"]),
                                          expert_load=np.round(found["expert_load"], 4).tolist())
        return routed, f"  load max {max(map(max, routed['expert_load'])):.2f} dropped {routed['dropped']:.1%}"
