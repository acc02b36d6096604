"""The step's context: what a jshard step's trace carries for the layers, in one contextvar.

A step enters it once, around everything it traces (`step_context(rules, whole_reads)`):
the explicit step's bodies (`parallel/step.py`) and the compiler-placed step's
(`parallel/compiled.py`). The layers read and write it: a plain read of a split param is
recorded in `whole_reads` (`params.py`, for `ShardedStep.describe`), a step input split over
the context axes in `context_splits` (`context.py`, which the step checks after tracing its
loss), and `loss_scale` weighs the losses a layer adds in backward (`losses.py`; a
pipeline's micro-batch scales it by `scaled_losses`); `compute` is the step's compute dtype,
which layers without one of their own compute in (`compute_dtype`), and `platform` the one it
is compiled for (attention's kernel is chosen for it), `fp8` whether the projections compute
in FP8 (`fp8.py`). Outside a step the context
is the default one: nothing recorded, scale 1, float32.

The rules are not a field. They keep their own contextvar in `jshard.rules`
(`use_rules`), which `step_context` enters with the rest, so a step has one `with`: rules
are a lower layer than `nn`, and `jshard.constrain` / `activate` / `use_rules` are public
and read them outside any step (a model under plain `jax.jit`, `jshard.init`), where a
step's records mean nothing. One home for them, and the step context holds only what is
the step's own.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jshard.nn import model_shardings
from jshard.rules import Rules, active_rules, manual_axes, use_rules


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What the layers record and read while a step traces, besides the rules."""

    whole_reads: dict[str, tuple[str, ...]] | None = None  # path -> axes: split params a plain read gathered whole
    context_splits: list[tuple] | None = None  # the names of each step input split over context axes
    loss_scale: float = 1.0  # the weight of losses added in backward (`scaled_losses`)
    compute: np.dtype | None = None  # the step's compute dtype (its precision policy's); None: none given
    platform: str | None = None  # what the step is compiled for ("gpu", "cpu"); None: this host's backend
    fp8: bool = False  # the projections compute in FP8 (the `fp8` precision policy; `nn.fp8`)
    pin_layouts: bool = False  # weights gathered along a later dim keep their row-major layout (`nn.params.param`)
    head_first: bool = False  # the output head's weight gradient before the layers' backward (`nn.Linear`)


_current: contextvars.ContextVar[StepContext] = contextvars.ContextVar("jshard_step", default=StepContext())


def current_step() -> StepContext:
    """The step context in force (outside a step: the default, which records nothing)."""
    return _current.get()


def compiled_for() -> str:
    """The platform the step in force is compiled for (a deviceless GPU compile's on a CPU
    host), else this host's default backend."""
    return _current.get().platform or jax.default_backend()


@contextlib.contextmanager
def replaced(**changes) -> Iterator[StepContext]:
    """Within this block, the step context with `changes` (its records stay the same objects)."""
    token = _current.set(dataclasses.replace(_current.get(), **changes))
    try:
        yield _current.get()
    finally:
        _current.reset(token)


@contextlib.contextmanager
def step_context(rules: Rules, whole_reads: dict[str, tuple[str, ...]] | None = None,
                 compute=None, platform: str | None = None, fp8: bool = False,
                 pin_layouts: bool = False, head_first: bool = False) -> Iterator[StepContext]:
    """While a step's function traces: `rules` active (`jshard.rules.use_rules`) and a fresh
    step context, recording whole reads into `whole_reads` (None: not recorded) and context
    splits into a new list; loss scale 1; layers without a dtype of their own compute in
    `compute` (the step's precision policy's; None: float32); kernels are chosen for `platform`
    (its devices', which for a deviceless GPU compile are not this host's); `fp8`: the
    projections (`nn.Linear` kernels marked so) compute in FP8; `pin_layouts`: weights ZeRO-3
    gathers along a later dim keep their layout (`Plan.pins_weight_layouts`); `head_first`: the
    output head's weight gradient is computed and scattered before the layers' backward
    (`Plan.head_backward_first`)."""
    model_shardings.install()  # the model's own out_sharding= / reshard requests, met in the step
    token = _current.set(StepContext(whole_reads, [], compute=compute and np.dtype(compute), platform=platform,
                                     fp8=fp8, pin_layouts=pin_layouts, head_first=head_first))
    try:
        with use_rules(rules):
            yield _current.get()
    finally:
        _current.reset(token)


def compute_dtype(dtype=None, step=None) -> np.dtype:
    """A layer's compute dtype: its own (`dtype`) where it has one, else the step's (`step`, or the
    one in force: its precision policy's, `step_context`), else float32. So a model whose config
    leaves `dtype` unset computes in whatever precision the step that runs it was built with."""
    return np.dtype(dtype or step or _current.get().compute or jnp.float32)


def in_step() -> bool:
    """Inside a jshard step's shard_map: rules active and the mesh's axes split by hand."""
    return active_rules() is not None and bool(manual_axes())
