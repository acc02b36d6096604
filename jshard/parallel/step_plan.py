"""The plan of a step: everything `build_step` derives from its inputs, resolved once, with no
device, and every check of those inputs in one place (each error raised once, before any work).

    plan = make_plan(model, Layout.parse("pp+fsdp stage=4,fsdp=2 precision=mixed m=8 schedule=1f1b"))

`model` may be abstract (`nnx.eval_shape`) and the mesh (the layout's, or one given) an
`AbstractMesh`. The plan holds

    params        per param (`placement.ParamLayout`): its `param` and `opt` layouts, and its
                  dtypes under the precision policy (held, compute, reduce, master)
    axes          batch, context (cp), grad (batch + context: gradients are summed over them),
                  stage (pp), expert (ep), ZeRO and tensor (tp) axes: the mesh axes of size > 1
                  the rules put each on
    pipeline      the schedule's tick table (which the executor compiles to its program while it
                  traces), micro-batches, `stage_remat`, the layers of each model chunk
                  (`stage_layers`: uneven where the chunks do not divide the layers)

and `check_batch` (rows and sequence length against the batch, accumulation (`grad_accum`),
micro-batch and context splits).
The explicit step (`step.py`), the compiler-placed step (`compiled.py`), `jshard train` and
`generate`, `describe`, the planner (`jshard.planner`, on an AbstractMesh) and the benches read
it; none derives an axis again.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from jshard.distributed import axes_across_processes
from jshard.layout import Layout, LayoutError
from jshard.mesh import (COLLECTIVES_IN_FLIGHT_OPTION, REMAT_COLLECTIVES_IN_FLIGHT, SCATTER_OVERLAP_OPTIONS,
                         TRITON_GEMM_OPTION, ZERO3_COLLECTIVES_IN_FLIGHT, abstract_mesh, make_mesh, mesh_shape, mesh_text)
from jshard.models.stack import StagedLoss, stack_remat
from jshard.parallel import tick_program
from jshard.parallel.model_state import check_no_pipeline
from jshard.parallel.schedules import Schedule, make_schedule, stage_layers
from jshard.placement import ParamLayout, Placement, Report, adopt_array_shardings, paths_and_shapes, place, specs_of
from jshard.precision import Precision
from jshard.rules import Kind, Rules, ShardingError

COLLECTIVES = ("explicit", "compiler")  # who places a step's collectives: jshard (shard_map) or XLA (jit)


@dataclasses.dataclass(frozen=True)
class Plan:
    """One step's layouts, dtypes, axes and pipeline, resolved once (`make_plan`)."""

    rules: Rules
    mesh: Mesh | AbstractMesh
    collectives: str  # "explicit" (jax.jit of jax.shard_map) or "compiler" (jax.jit alone)
    params: tuple[ParamLayout, ...]  # in the leaf order of the params' State
    precision: Precision | None  # None: params held as the model holds them, no master
    schedule: Schedule | None  # None: no pipeline
    microbatches: int | None
    stage_remat: str  # what a pipeline stage keeps from F to its backward: "none" or "full"
    layer_remat: str | None  # the layer stack's remat policy (`stack_layers`); None: no stack
    batch_axes: tuple[str, ...]  # the batch dim's, size-1 axes included (a batch spec's)
    context_axes: tuple[str, ...]  # attention's seq: context parallelism's (size > 1)
    stage_axis: str | None  # the stacked layers' (size > 1): a pipeline's
    expert_axes: tuple[str, ...]  # the experts' (size > 1)
    tensor_axes: tuple[str, ...]  # the MLP width's (size > 1): tensor parallelism's
    sequence_axes: tuple[str, ...]  # the residual stream's seq (size > 1): sequence and context parallelism's
    has_aux: bool = False  # the loss returns (loss, metrics): a pytree of scalars, averaged as the loss is
    grad_accum: int = 1  # micro-batches a step accumulates gradients over before its data-parallel reduction
    # A pipeline's layers per model chunk, in pipeline order (`schedules.stage_layers`; chunk k =
    # c·p + d is device d's chunk c, so with v = 1 the layers of each stage); None: no pipeline.
    stage_layers: tuple[int, ...] | None = None

    @property
    def has_stack(self) -> bool:
        """Whether the model runs its layers through `scan_layers` (it remats them itself)."""
        return self.layer_remat is not None

    @property
    def layer_slots(self) -> int | None:
        """The stacked layers' rows a pipeline holds per model chunk: its largest chunk's layers.
        A chunk with fewer holds zeros in the rest, which the step skips (`pipelining.held_slots`), so
        each device holds virtual × `layer_slots` layers' params and optimizer state."""
        return max(self.stage_layers) if self.stage_layers else None

    # -- derived from the fields, read by the steps and the planner --------------------------

    @functools.cached_property
    def mesh_sizes(self) -> dict[str, int]:
        return mesh_shape(self.mesh)

    @property
    def grad_axes(self) -> tuple[str, ...]:
        """Axes whose devices see other tokens with the same params, over which gradients are
        summed: the batch axes, and context parallelism's, which split each sequence."""
        return self.batch_axes + self.context_axes

    @property
    def compute(self) -> np.dtype | None:
        """The dtype the step's layers compute in, where they set none (`nn.compute_dtype`): the
        precision policy's; None without one (float32)."""
        return self.precision.compute if self.precision else None

    @property
    def fp8(self) -> bool:
        """Whether the projections compute in FP8 (the precision policy's; `nn.fp8`)."""
        return bool(self.precision and self.precision.fp8)

    @property
    def platform(self) -> str | None:
        """The platform the step is compiled for: its devices' ("gpu" for a GPU topology's, with
        no GPU here); None on an AbstractMesh (lowered for the host's, or `lower(platform=)`)."""
        return self.mesh.devices.flat[0].platform if isinstance(self.mesh, Mesh) else None

    @property
    def collectives_ordered(self) -> bool:
        """Whether the pipeline executor chains each tick's collectives (`pipelining._after`): off a
        GPU, where XLA:CPU may start two in either order on two devices, and deadlock (docs/pipeline.md)."""
        return self.platform != "gpu"

    @functools.cached_property
    def collectives_in_flight(self) -> int:
        """How many collectives XLA:GPU may run at once in this step's program: several for
        ZeRO-3 without tensor parallelism (`mesh.ZERO3_COLLECTIVES_IN_FLIGHT`, why there; two where
        its layers are rematerialised, in bf16 compute but FP8: `mesh.REMAT_COLLECTIVES_IN_FLIGHT`),
        else XLA's one; what XLA_FLAGS set, where they set it."""
        if m := re.search(rf"--{COLLECTIVES_IN_FLIGHT_OPTION}=(\d+)", os.environ.get("XLA_FLAGS", "")):
            return int(m[1])
        if not self.zero3_without_tensor_axes:
            return 1
        if self.scatters_without_tensor_axes and self.layer_remat in ("full", "selective") and not self.fp8:
            return REMAT_COLLECTIVES_IN_FLIGHT
        return ZERO3_COLLECTIVES_IN_FLIGHT

    @functools.cached_property
    def xla_options(self) -> dict[str, int | str]:
        """XLA options for this step's GPU program beyond the process's flags (`mesh.GPU_XLA_FLAGS`),
        passed to its `jax.jit`: `collectives_in_flight` where it is not XLA's default (nor
        XLA_FLAGS' own); under collective matmuls, XLA's dot merger off (XLA_FLAGS' disabled passes
        kept), which would join a ring's partial matmuls, all of one weight, into one matmul that
        waits for every transfer (seen in the compiled H100 program). Under FP8, so that every FP8
        product is a cuBLASLt FP8 GEMM, as Transformer Engine's are: XLA's Triton GEMMs off, which
        compute an FP8 product's dequantized operands in bf16 (on an H100 too: 158 ms a step
        against 133 with them off, docs/benchmarks.md), and the dot merger off, which joins
        products of one input (a Llama's q and kv), each weight at its own scale, into one
        bf16 GEMM (on the H100: 11 of 15 products FP8 with it on). Where ZeRO-3 reduce-scatters the
        gradients inside the backward with no tensor axis (bf16 compute), Triton GEMMs off too:
        XLA:GPU then schedules each layer's reduce-scatter beside the next layer's weight-gradient
        matmuls (Llama 3.1 8B on fsdp=8, bf16: 52% -> 91% of the reduce-scattered bytes
        overlapped, 100% in the layer loop); under tensor parallelism it does not help (dp+fsdp+tp
        bf16: 62% -> 23%), so there they stay on (`scatters_without_tensor_axes`, docs/gpu-compile.md).
        There, under full remat, also the layer loop double-buffered and MaxText's combine thresholds
        (`mesh.SCATTER_OVERLAP_OPTIONS`: mixed 90% -> 97% of the step's reduce-scattered bytes
        overlapped, bf16 91% -> 97% and 21.94 -> 21.02 GiB, measured 2026-11-28, before the
        backward loop's gathers were pipelined too: docs/gpu-compile.md; without remat they cost
        the gathers: 92% -> 87% of the loop's)."""
        if self.platform != "gpu":
            return {}
        flags, options = os.environ.get("XLA_FLAGS", ""), {}
        if self.collectives_in_flight > 1 and COLLECTIVES_IN_FLIGHT_OPTION not in flags:
            options[COLLECTIVES_IN_FLIGHT_OPTION] = self.collectives_in_flight
        if (self.rules.collective_matmul and self.sequence_parallel) or self.fp8:
            disabled = m[1] if (m := re.search(r"--xla_disable_hlo_passes=(\S+)", flags)) else ""
            options["xla_disable_hlo_passes"] = ",".join(filter(None, (disabled, "dot-merger")))
        if (self.fp8 or self.scatters_without_tensor_axes) and TRITON_GEMM_OPTION not in flags:
            options[TRITON_GEMM_OPTION] = False
        if self.scatters_without_tensor_axes and self.layer_remat == "full":
            options |= {name: value for name, value in SCATTER_OVERLAP_OPTIONS.items() if name not in flags}
        return options

    @property
    def zero3_without_tensor_axes(self) -> bool:
        """Whether params are split over ZeRO axes (ZeRO-3) and no tensor axis splits them: the
        programs whose GPU options are their own (`collectives_in_flight`, `xla_options`)."""
        return self.rules.zero == 3 and bool(self.zero_axes) and not self.tensor_axes

    @property
    def pins_weight_layouts(self) -> bool:
        """Whether a weight ZeRO-3 gathers along a later dim (the down and output projections'
        `embed`) keeps the row-major layout it is held in, each layer's slice pinned so
        (`nn.params.param`): on a GPU, without a tensor axis, under full remat. XLA:GPU gathers
        along a tensor's most major dim only, and left alone gave those weights' whole stacks that
        layout, a copy made before the layers' loops and alive through the backward's (Llama 3.1 8B,
        fsdp=8, bf16: 1.1 GiB of fp32, 22.34 -> 21.21 GiB; mixed 21.62 -> 21.38); pinned, each
        trip transposes its own slice. Without remat it saved 0.15 GiB and XLA's rematerialization
        then gathered a small tensor twice; under dp+fsdp+tp the data sums in the backward lost
        their matmuls (84% -> 27% of the bytes): not pinned there (docs/gpu-compile.md)."""
        return self.platform == "gpu" and self.zero3_without_tensor_axes and self.layer_remat == "full"

    @property
    def head_backward_first(self) -> bool:
        """Whether the output head's weight gradient is computed and reduce-scattered before the
        layers' backward, its input gradient held back until then (`nn.params.released_together`):
        where weights are pinned (`pins_weight_layouts`). Left to itself XLA:GPU computed it after
        the backward loop, keeping the logits' gradient (2 GiB for Llama 3.1 8B) alive through
        it; first, its scatter runs beside the input gradient's GEMM. Llama 3.1 8B, fsdp=8, full
        remat: bf16 21.21 -> 19.40 GiB, mixed 21.38 -> 21.06, fp8 21.24 -> 21.11, the step along
        the schedule 0.1 ms longer. Under selective remat it cost 0.34 GiB, under dp+fsdp+tp the
        scatters' overlap (58% -> 51%): not there (docs/gpu-compile.md)."""
        return self.pins_weight_layouts

    @property
    def scatters_without_tensor_axes(self) -> bool:
        """Whether ZeRO-3 reduce-scatters each layer's gradients inside the backward, with no tensor
        axis, in bf16 compute: where XLA:GPU's cuBLAS GEMMs let those scatters run beside matmuls.
        (ZeRO-2's program grew 3.4x with them on the validation Llama: its GEMMs' split-K
        partials; there, and in fp32 compute, XLA keeps its Triton GEMMs.)"""
        return (self.zero3_without_tensor_axes and self.compute is not None
                and np.dtype(self.compute) == np.dtype(jnp.bfloat16))

    @functools.cached_property
    def summed_in_backward(self) -> tuple[tuple[str, ...], ...]:
        """Per param: the batch (and context) axes its gradient is summed over inside the backward,
        where it is produced (`nn.params.LocalBlock`); () where the step sums it after the backward.

        A ZeRO-3 layer's weight, in a stack, gathered over a ZeRO axis: summed just after the
        gather's reduce-scatter, so each layer's data-parallel all-reduce (HSDP's) runs beside
        the next layer's backward, where after the backward it runs exposed (the 8B on 8 H100s
        under `dp+fsdp+tp`: 0% of it hidden → 62% bf16, 84% mixed, and more of the scatters
        too; docs/gpu-compile.md). That under tensor parallelism, or where the sum crosses hosts
        (the network, slower than the scatters' NVLink). Otherwise XLA:GPU hides the scatters
        themselves by moving each into the next layer's trip, which it no longer does with an
        all-reduce chained after it (90% → 3% hidden), and on one host that costs more than the
        sum's exposure: there the sum stays after the backward. Not with accumulated
        micro-batches (summed once a step, after the last) nor in a pipeline (whose executor runs
        its own backward); nor the weights outside the stack (the embedding and head: read more
        than once, each read would sum its own part).
        """
        if self.rules.zero != 3 or self.schedule or self.grad_accum > 1 or not self.zero_axes:
            return ((),) * len(self.params)
        across_hosts = set(axes_across_processes(self.mesh)) if isinstance(self.mesh, Mesh) else set()

        def summed(p: ParamLayout) -> tuple[str, ...]:
            held = {a for axes in p.param for a in axes}
            if not p.stacked or not held & set(self.zero_axes) or p.param != p.opt:
                return ()
            axes = tuple(a for a in self.grad_axes if a not in held and self.mesh_sizes[a] > 1)
            return axes if self.tensor_axes or across_hosts & set(axes) else ()

        return tuple(summed(p) for p in self.params)

    @property
    def sequence_parallel(self) -> bool:
        """Whether the residual stream's seq is split beyond context parallelism's axes (over tensor)."""
        return bool(set(self.sequence_axes) - set(self.context_axes))

    @functools.cached_property
    def zero_axes(self) -> tuple[str, ...]:
        """The ZeRO axes (size > 1): those that split both the batch and some param's weight."""
        return tuple(a for a in self.rules.zero_axes if self.mesh_sizes[a] > 1)

    @functools.cached_property
    def data_shards(self) -> int:
        """The devices that split a batch's rows."""
        return math.prod(self.mesh_sizes[a] for a in self.batch_axes)

    @property
    def batch_shards(self) -> int:
        """What one global batch splits into: its data shards, times its accumulated micro-batches
        (`grad_accum`), times a pipeline's micro-batches (each accumulated one runs the schedule)."""
        return self.data_shards * self.grad_accum * (self.microbatches or 1)

    @functools.cached_property
    def context_shards(self) -> int:
        return math.prod(self.mesh_sizes[a] for a in self.context_axes)

    @property
    def batch_spec(self) -> jax.P:
        return jax.P(self.batch_axes)

    @property
    def batch_sharding(self) -> NamedSharding:
        """A global batch's placement: split along dim 0 over the batch axes."""
        return NamedSharding(self.mesh, self.batch_spec)

    def specs(self, params, kind: Kind = "param"):
        """The params' PartitionSpecs in `kind`'s layout ('param' or 'opt'), in their tree's structure."""
        return specs_of(params, [p.placement if kind == "param" else p.opt_placement for p in self.params])

    def layouts(self, kind: Kind = "param") -> list:
        return [p.param if kind == "param" else p.opt for p in self.params]

    def check_params(self, params: nnx.State) -> None:
        """Whether `params` are the ones planned (a plan made on other shapes would misplace them)."""
        have = paths_and_shapes(params)
        want = [(p.path, p.shape) for p in self.params]
        if have != want:
            diff = next((h, w) for h, w in zip(have + [None] * len(want), want + [None] * len(have)) if h != w)
            raise ShardingError(f"build_step: the model's params are not the plan's (first difference: the model has "
                                f"{diff[0]}, the plan {diff[1]}). Fix: make the plan from this model or its shapes.")

    def opt_state_specs(self, opt_state):
        """An optimizer state's specs (its Variables carry their params' names): the `opt` layout."""
        return specs_of(opt_state, place(opt_state, self.mesh_sizes, self.rules, "opt"))

    def report(self) -> Report:
        """The params' placements; where only the optimizer's layout splits an unnamed param
        (ZeRO-1/2), that too."""
        def flagged(p: ParamLayout) -> Placement:
            extra = tuple(f"optimizer state: {f}" for f in p.opt_placement.flags
                          if "split by itself" in f and f not in p.placement.flags)
            return dataclasses.replace(p.placement, flags=p.placement.flags + extra)

        return Report(self.rules, self.mesh_sizes, "param", tuple(flagged(p) for p in self.params))

    # -- the batch ---------------------------------------------------------------------------

    def check_batch(self, rows: int | None = None, seq_len: int | None = None, *,
                    rows_name: str = "batch size", seq_name: str = "sequence length", name_accum: bool = False) -> None:
        """Whether a global batch of `rows` rows splits over the batch axes, `grad_accum`'s
        micro-batches and a pipeline's, and a sequence of `seq_len` tokens into
        context parallelism's chunks (two per device, load-balanced; one under all-to-all) and, on each device,
        sequence parallelism's (one per tensor shard). The names say what the caller calls
        the two in the error (a config's fields: 'TrainConfig.batch_size'); `name_accum`: the
        error names the accumulation even at 1 (a run whose rows it multiplies)."""
        n = self.context_shards
        chunks = n if self.rules.context_attention == "a2a" else 2 * n
        if seq_len is not None and n > 1 and seq_len % chunks:
            raise ShardingError(
                f"{seq_name} {seq_len}: context parallelism over {'×'.join(self.context_axes)} = {n} cuts each "
                f"sequence into {chunks} equal chunks ({'one per device' if chunks == n else 'two per device, load-balanced'}). "
                f"Fix: a {seq_name} that is a multiple of {chunks}.")
        sp_axes = [a for a in self.sequence_axes if a not in self.context_axes]
        sp = math.prod(self.mesh_sizes[a] for a in sp_axes)
        if seq_len is not None and sp > 1 and seq_len % (n * sp):
            multiple = math.lcm(chunks, n * sp) if n > 1 else sp
            raise ShardingError(
                f"{seq_name} {seq_len}: sequence parallelism splits each sequence's tokens "
                f"{'on a device ' if n > 1 else ''}over {'×'.join(sp_axes)} = {sp}. Fix: a {seq_name} that is a "
                f"multiple of {multiple}.")
        per_step = self.batch_shards
        if rows is not None and rows % per_step:
            over = " × ".join([f"{self.data_shards} batch shards ({'×'.join(self.batch_axes) or 'none'})"]
                              + ([f"{self.microbatches} pipeline micro-batches"] if self.microbatches else [])
                              + ([f"Layout.grad_accum {self.grad_accum}"] if self.grad_accum > 1 or name_accum else []))
            raise ShardingError(f"{rows_name} {rows} does not split over {over} = {per_step}. "
                                f"Fix: make {rows_name} a multiple of {per_step}.")


def make_plan(model, layout: Layout | str | Mesh | AbstractMesh, mesh: Mesh | AbstractMesh | None = None, *,
              loss_fn=None, collectives: str = "explicit", default_microbatches: int | None = None,
              has_aux: bool = False, **deprecated) -> Plan:
    """Resolve and check a step of `model` (an NNX module, abstract or not) laid out as `layout`
    (`jshard.Layout`, or its line) on `mesh` (None: `step_mesh`'s, from the layout): the one place
    `build_step`'s inputs are checked.

    `loss_fn` None: not known here (the planner, `describe`); a pipeline needs a StagedLoss.
    `default_microbatches`: a pipeline's micro-batches where the layout gives none (a
    command's default); without it a pipeline needs `Layout.microbatches`. `has_aux`: `loss_fn`
    returns (loss, metrics), as for `jax.value_and_grad(..., has_aux=True)`.

    The form before `Layout`, `make_plan(model, mesh, rules, precision=..., microbatches=...)`,
    still works for this release, with a DeprecationWarning.
    """
    layout, mesh = step_layout("make_plan", layout, mesh, deprecated)
    mesh = step_mesh(layout, mesh, abstract=True)
    rules, microbatches, grad_accum = layout.rules, layout.microbatches, layout.grad_accum
    schedule, virtual, stage_remat = layout.schedule, layout.virtual, layout.stage_remat
    _check_remat(model, layout)
    if collectives not in COLLECTIVES:
        raise ShardingError(
            f"build_step: collectives={collectives!r}; choose 'explicit' (jit of shard_map, every "
            "collective derived from the rules) or 'compiler' (plain jit, XLA's partitioner places them).")
    policy = layout.policy
    rules.check_mesh(mesh)
    sizes = mesh_shape(mesh)

    def split(name: str, kind: Kind = "param") -> tuple[str, ...]:
        return rules.axes(name, mesh, kind, split=True)

    stages = split("layers")
    if stages and microbatches is None:
        microbatches = default_microbatches
    given = dict(microbatches=microbatches, schedule=schedule, virtual=virtual, stage_remat=stage_remat)
    given = ", ".join(f"Layout.{k}={v!r}" for k, v in given.items() if v is not None)
    if collectives == "compiler":
        _check_compiler_step(rules, stages, sizes, given, policy)
    adopt_array_shardings(model)  # (the optimizer's state is laid out as its params)
    _, params, others = nnx.split(model, nnx.Param, ...)
    check_no_pipeline(others, stages)
    plan_schedule = _schedule(rules, mesh, stages, given, loss_fn, microbatches, schedule, virtual, stage_remat)
    layers = _stage_layers(params, plan_schedule, rules, stages) if plan_schedule else None
    held = _held(params, layers)  # placed as the step holds them, described in the model's shapes
    rows = tuple(ParamLayout.of(dataclasses.replace(placed, shape=shape), dataclasses.replace(opt, shape=shape), policy)
                 for placed, opt, (_, shape) in zip(place(held, sizes, rules, "param"), place(held, sizes, rules, "opt"),
                                                    paths_and_shapes(params)))
    plan = Plan(rules, mesh, collectives, rows, policy, plan_schedule, microbatches, stage_remat or "none",
                stack_remat(model), rules.axes("batch", mesh), rules.context_axes(mesh), stages[0] if stages else None,
                split("experts"), split("mlp", "activation"), split("seq", "activation"), bool(has_aux),
                grad_accum, stage_layers=layers)
    if has_aux and plan.schedule:
        raise ShardingError(
            f"build_step(has_aux=True): rules {rules.name!r} pipeline the layers, and a pipeline's loss is a "
            "StagedLoss whose micro-batch losses are summed, with no metrics beside them. Fix: compute the "
            "metrics in an evaluation step (step.loss) of a non-pipelined preset, or drop has_aux.")
    _check_experts(plan)
    if plan.fp8 and rules.collective_matmul and plan.sequence_parallel:
        raise ShardingError(
            f"build_step: Layout.precision 'fp8' with rules {rules.name!r}: the collective matmuls' rings (sp-overlap) compute "
            "in bf16 and have no FP8 form. Fix: drop sp-overlap (tp+sp gathers and reduce-scatters as whole "
            "collectives) or use precision 'mixed'.")
    if rules.zero == 2 and collectives == "explicit":
        _check_one_zero_dim(rows)
    return plan


OLD_OPTIONS = ("precision", "microbatches", "schedule", "virtual", "stage_remat", "grad_accum")  # Layout fields now


def step_layout(where: str, layout, mesh, deprecated: dict) -> tuple[Layout, Mesh | AbstractMesh | None]:
    """(the Layout, the mesh given) of a call to `where` (`build_step`, `make_plan`, ...): a Layout
    or its line; or, the form before Layout (deprecated, one release), a mesh, Rules and options."""
    if isinstance(layout, (Mesh, AbstractMesh)):
        old_mesh, rules = layout, mesh
        unknown = sorted(set(deprecated) - set(OLD_OPTIONS))
        if unknown:
            raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
        if not isinstance(rules, Rules):
            raise LayoutError(f"{where}(model, ..., mesh, rules): rules is a {type(rules).__name__}, not jshard.Rules. "
                              f"Fix: {where}(model, ..., jshard.Layout.of(rules, mesh), mesh).")
        fields = {k: v for k, v in deprecated.items() if v is not None}
        warnings.warn(f"{where}(..., mesh, rules{''.join(f', {k}=...' for k in fields)}) is deprecated: pass one "
                      f"jshard.Layout, {where}(..., jshard.Layout.of(rules, mesh{''.join(f', {k}=...' for k in fields)}), "
                      "mesh)", DeprecationWarning, stacklevel=3)
        return Layout.of(rules, mesh_shape(old_mesh), **fields), old_mesh
    if deprecated:
        name = sorted(deprecated)[0]
        if name in OLD_OPTIONS:
            raise TypeError(f"{where}(): {name}= is a field of the layout. Fix: jshard.Layout(..., {name}=...).")
        raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")
    return Layout.coerce(layout), mesh


def step_mesh(layout: Layout, mesh: Mesh | AbstractMesh | None = None, abstract: bool = False) -> Mesh | AbstractMesh:
    """The mesh a step of `layout` runs on: `mesh` where given (the layout's sizes, where it names
    any, must be its), else the layout's over this process's devices (`jshard.make_mesh`; with no
    devices, an AbstractMesh, where `abstract`)."""
    if mesh is None:
        sizes = dict(layout.mesh)
        if not abstract:
            return make_mesh(**sizes)
        if -1 in sizes.values():
            raise LayoutError(f"Layout.mesh {layout.mesh_text}: a mesh with no devices needs every size; -1 takes "
                              "the devices left. Fix: give that axis its size.")
        return abstract_mesh(**sizes)
    shape = {a: n for a, n in mesh_shape(mesh).items() if n != 1}
    named = {a: n for a, n in layout.mesh if n != -1}
    wild = len(named) < len(layout.mesh)
    if layout.mesh and (any(shape.get(a, 1) != n for a, n in named.items()) or (not wild and set(shape) - set(named))):
        raise LayoutError(f"Layout.mesh {layout.mesh_text} is not the mesh given ({mesh_text(shape)}). "
                          "Fix: the same sizes in both, or leave the layout's mesh empty (it then takes the mesh's).")
    return mesh


def _check_remat(model, layout: Layout) -> None:
    """A layout's remat is the model's: a jshard decoder sets it in its config, which must agree."""
    if layout.remat is None:
        return
    config = getattr(model, "config", None)
    if not hasattr(config, "remat"):
        raise LayoutError(f"Layout.remat={layout.remat!r}: this model ({type(model).__name__}) has no config.remat; "
                          "its activation checkpointing is its own (nnx.remat in its forward). Fix: leave "
                          "Layout.remat unset (None).")
    if config.remat != layout.remat:
        raise LayoutError(f"Layout.remat={layout.remat!r}, but the model was built with remat={config.remat!r}. "
                          f"Fix: build it from dataclasses.replace(config, remat={layout.remat!r}), or leave "
                          "Layout.remat unset.")


def _is_stacked(leaf) -> bool:
    """Whether a param is a stack of layers: its first logical name is 'layers'."""
    return isinstance(leaf, nnx.Variable) and (leaf.get_metadata().get("out_sharding") or (None,))[:1] == ("layers",)


def _stage_layers(params, schedule: Schedule, rules: Rules, stages) -> tuple[int, ...]:
    """The layers of each of the pipeline's model chunks (`schedules.stage_layers`)."""
    stacked = [np.shape(leaf.get_value())[0] for leaf in jax.tree.leaves(params, is_leaf=_is_stacked) if _is_stacked(leaf)]
    if not stacked:
        raise ShardingError(
            f"build_step: rules {rules.name!r} pipeline the layers over {stages[0]}, but no param of the "
            "model has a 'layers' dim to split: its blocks are separate modules (a list, nnx.Sequential). "
            "Fix: stack them on a 'layers' dim with jshard.models.stack_layers(make_block, n, rngs) and run "
            "them with jshard.models.scan_layers, or use a preset without pp.")
    return stage_layers(stacked[0], schedule.stages, schedule.virtual)


def _held(params, layers: tuple[int, ...] | None):
    """`params` in the shapes a pipeline holds them: each stack padded to `layer_slots` rows per
    model chunk where its chunks' layers differ (abstract values, to place)."""
    if not layers or len(set(layers)) == 1:
        return params
    rows = len(layers) * max(layers)

    def padded(leaf):
        if not _is_stacked(leaf):
            return leaf
        value = leaf.get_value()
        return leaf.replace(jax.ShapeDtypeStruct((rows, *np.shape(value)[1:]), value.dtype))

    return jax.tree.map(padded, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _check_compiler_step(rules: Rules, stages, sizes, given: str, policy: Precision | None) -> None:
    """What the compiler-placed step cannot do: pipeline, hold params other than as the model does,
    or place jshard's own collective matmuls."""
    if rules.collective_matmul:
        raise ShardingError(
            f"build_step(collectives='compiler'): rules {rules.name!r} ask for collective matmuls, which the "
            "explicit step places; the compiler-placed step leaves every collective to XLA. Fix: use the explicit "
            "step, or 'sp' in place of 'sp-overlap' (XLA's own: --xla_gpu_threshold_for_windowed_einsum_mib).")
    if given:
        raise ShardingError(
            f"build_step(collectives='compiler'): {given}, but the compiler-placed step does not "
            "pipeline. Fix: drop them, or use the explicit step (collectives='explicit').")
    if stages:
        raise ShardingError(
            f"build_step(collectives='compiler'): rules {rules.name!r} split layers over "
            f"{'+'.join(stages)}={math.prod(sizes[a] for a in stages)}, a pipeline, and the "
            "compiler-placed step does not pipeline. Fix: use the explicit step (build_step(..., "
            "collectives='explicit'), Layout.microbatches=M), or pick a preset without pp / give stage size 1.")
    if policy is not None and (policy.master is not None or policy.param != np.float32):
        raise ShardingError(
            f"build_step(collectives='compiler'): Layout.precision {policy.name!r} holds params in "
            f"{policy.param.name}{' with an fp32 master' if policy.master else ''}, but the compiler-placed step "
            "holds them as the model does. Fix: Layout.precision 'fp32' or 'bf16', or the explicit step.")


def _schedule(rules: Rules, mesh, stages, given: str, loss_fn, microbatches, schedule, virtual,
              stage_remat) -> Schedule | None:
    """The pipeline schedule (None when the rules put no layers on a stage axis of size > 1)."""
    if not stages:
        if given:
            raise ShardingError(
                f"build_step: {given} but rules {rules.name!r} put no layers on a stage axis of size > 1, so "
                "there is no pipeline to feed. Fix: drop them, or use 'pp' with stage=N.")
        return None
    if len(stages) > 1:
        raise ShardingError(f"build_step: layers split over several stage axes {stages}; the pipeline uses one.")
    size = mesh_shape(mesh)[stages[0]]
    if not isinstance(loss_fn, (StagedLoss, type(None))):
        raise ShardingError(
            f"build_step: rules {rules.name!r} split layers over {stages[0]}={size}, which pipelines them, "
            f"and the loss {getattr(loss_fn, '__name__', type(loss_fn).__name__)!r} is a plain function: a "
            "pipeline needs a jshard.models.StagedLoss that says where the stack of layers starts and ends "
            "(its first, the stack, its last). Fix: wrap the loss in StagedLoss(first=..., layers=..., last=...), "
            "as jshard.models.gpt_loss and mlp_loss are, or use a preset without pp.")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ShardingError(
            f"build_step: rules {rules.name!r} split layers over {stages[0]}={size}, "
            f"which pipelines them: it needs Layout.microbatches, the micro-batches a step pipelines, "
            f"at least 1 (got {microbatches!r}). Fix: Layout.microbatches=4 (or more, for a smaller bubble).")
    tick_program.check_stage_remat(stage_remat or "none")
    context = rules.context_axes(mesh)
    if context and rules.context_attention == "ring":
        # A pipeline tick runs its stage's action in a branch the other stages skip. XLA:CPU
        # makes every device of the mesh join each collective-permute, so a ring's ppermute there
        # deadlocks or pairs with another stage's; an all-gather groups only its stage's devices.
        raise ShardingError(
            f"build_step: rules {rules.name!r} pipeline the layers over {stages[0]} and pass keys and values "
            f"round a ring over {'+'.join(context)}; a ring's sends cannot run inside one "
            "stage's tick. Fix: all-gather them instead, preset "
            f"{rules.name.replace('cp', 'cp-gather')!r} (Rules.context_attention='gather'), or trade the split for "
            f"heads, {rules.name.replace('cp', 'cp-a2a')!r}.")
    return make_schedule(schedule or "gpipe", size, microbatches, virtual)


def _check_experts(plan: Plan) -> None:
    """Rules that split `experts` over an axis need experts: else that axis only splits the batch,
    a data-parallel axis under another name. And a mixture of experts does not take context
    parallelism: its rows, gathered whole, arrive in cp's load-balanced chunk order, in which
    their choices would queue for the experts' slots, and drop, unlike on one device."""
    has_experts = any("experts" in (p.placement.names or ()) for p in plan.params)
    name = plan.rules.name
    if plan.expert_axes and not has_experts:
        raise ShardingError(
            f"build_step: rules {name!r} split experts over {'+'.join(plan.expert_axes)}, but no param of the model has "
            "an 'experts' dim: there are no experts to place. Fix: a model with a mixture of experts (jshard.moe.MoE, "
            "e.g. jshard.models.SIZES['moe-tiny']), or a preset without ep (its devices then split the batch: use 'data').")
    if has_experts and plan.context_axes:
        raise ShardingError(
            f"build_step: rules {name!r} split each sequence over {'+'.join(plan.context_axes)} (context "
            "parallelism), but the model has a mixture of experts, whose capacity queues follow token order, which "
            "context parallelism's load-balanced chunks reorder. Fix: a preset without cp.")


def _check_one_zero_dim(params: tuple[ParamLayout, ...]) -> None:
    """ZeRO-2 scatters each gradient along one dim; rules that split a param over ZeRO axes
    on two dims would need two."""
    for p in params:
        if sum(h != w for h, w in zip(p.param, p.opt)) > 1:
            raise ShardingError(
                f"build_step: ZeRO-2 param {p.path!r} is split over ZeRO axes on more than "
                f"one dim ({p.opt}); it reduce-scatters along one. Fix: map the ZeRO axis to one logical name.")

