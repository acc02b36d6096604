"""The planner's estimate: for a decoder (GPT or Llama), a mesh, a strategy (rules preset), a pipeline schedule,
precision, remat policy, micro-batch size and a hardware profile (`PlanInput`), `estimate` gives per device:

    memory   params, grads, Adam's two moments in the layouts the rules give (placed exactly as
             `build_step` places them: the step's own layout table, on an abstract mesh), the
             gathered layers of ZeRO-3, and activations: bytes per token per layer times the
             tokens in flight (the schedule's activation buffers under a pipeline); on GPUs the
             gradient reduction's peak where it is above backward's (`memory.memory_per_device`)
    comm     bytes per collective kind and mesh axis per step (K, as `jshard/hlo.py` counts),
             and their time at the bandwidth of the link the axis falls on (intra- or inter-node)
             (`communication.communication`)
    time     compute from model FLOPs (6·N + attention, plus the forward that remat and the
             pipeline's stage recompute run again), the bubble, exposed communication, MFU
             (`timing.step_time`)

each from the step's plan on an abstract mesh (`planned_step`), for a profile of `hardware`.
A mixture of experts (a Llama with `experts`): its dispatch buffer's slots in the activations
(ACT_SLOT_*), its all-to-alls on the critical path, and in the compute time every slot the
experts run (E·C per row, filled or not), where MFU's model FLOPs count top_k experts a token;
context parallelism with experts is refused (not modelled).

The formulas are ../shared/SPEC.md's; `validate.py` checks them against XLA.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from jshard.layout import Layout
from jshard.models import DecoderConfig
from jshard.moe import capacity
from jshard.nn.attn import attention_implementation
from jshard.nn.context_parallel import block_kernel, check_all_to_all_heads
from jshard.parallel.step_plan import Plan
from jshard.placement import format_bytes
from jshard.planner.planned_step import PlannedStep, cached_step_plan, computed, local, shards, stage_layers_run
from jshard.planner.communication import communication
from jshard.planner.counts import is_moe, slots_per_token
from jshard.planner.hardware import HARDWARE, Hardware, link
from jshard.planner.memory import MODEL_STATE, memory_per_device
from jshard.planner.timing import step_time
from jshard.rules import ShardingError


@dataclasses.dataclass(frozen=True)
class PlanInput:
    """What the planner estimates: a model, its layout (`jshard.Layout`, whole), the hardware and
    the rows a step trains on. The layout's remat is the model's where it gives one (`model`);
    `batch_size`, where given, replaces the layout's rows per micro-batch."""

    config: DecoderConfig
    layout: Layout
    hardware: Hardware = HARDWARE["h100"]
    batch_size: int | None = None  # rows per step over every data shard and micro-batch (`jshard train`'s)

    def __post_init__(self):
        object.__setattr__(self, "layout", Layout.coerce(self.layout))

    @property
    def model(self) -> DecoderConfig:
        """The model as the layout runs it (`Layout.model`: its remat, a padded vocabulary)."""
        return self.layout.model(self.config)

    @property
    def sizes(self) -> dict[str, int]:
        return self.layout.sizes

    strategy = property(lambda self: self.layout.strategy)
    schedule = property(lambda self: self.layout.schedule)
    microbatches = property(lambda self: self.layout.microbatches)
    virtual = property(lambda self: self.layout.virtual)
    micro_batch_size = property(lambda self: self.layout.micro_batch_size)
    stage_remat = property(lambda self: self.layout.stage_remat)
    grad_accum = property(lambda self: self.layout.grad_accum)
    precision = property(lambda self: self.layout.policy)


def planned_step(inputs: PlanInput) -> PlannedStep:
    """The step `inputs` describe, planned on an abstract mesh, and what it fixes of one device's
    work; refused (`ShardingError`) where the step or the hardware cannot run it."""
    config, hw = inputs.model, inputs.hardware
    sizes = inputs.sizes
    if -1 in sizes.values():
        raise ShardingError(f"Layout.mesh {inputs.layout.mesh_text}: the planner has no devices to fill '-1' from. "
                            "Fix: give every axis its size.")
    step = cached_step_plan(dataclasses.replace(config, remat="none"),
                            dataclasses.replace(inputs.layout, remat=None, micro_batch_size=1))
    step.check_batch(inputs.batch_size, config.seq_len, rows_name="PlanInput.batch_size", seq_name="DecoderConfig.seq_len")
    config = computed(config, step)
    rules, context, cp = step.rules, step.context_axes, step.context_shards
    tensor = shards((step.tensor_axes,), sizes)
    rows = inputs.batch_size // step.batch_shards if inputs.batch_size else inputs.micro_batch_size
    if step.fp8 and hw.fp8_peak_flops is None:
        raise ShardingError(f"Layout.precision fp8: {hw.name} has no FP8 tensor cores (Hopper and later do). "
                            "Fix: Layout.precision mixed, or PlanInput.hardware h100 / h200.")
    try:
        attention = attention_implementation(config.attention, config.dtype, config.head_dim, hw.platform)
    except ValueError as e:  # cudnn asked of a profile or dtype it cannot run on
        raise ShardingError(f"DecoderConfig.attention {config.attention}: {e}") from None
    flash = fused = attention in ("cudnn", "pallas")
    if cp > 1 and rules.context_attention == "a2a":
        check_all_to_all_heads(config.heads // tensor, cp, context)
    if cp > 1 and rules.context_attention != "a2a":  # attention is jshard's own, not the model's kernel
        # (all-to-all CP runs the model's, on its share of the heads), its blocks by the flash kernel
        # or XLA's ops: the ring keeps no scores either way (each block's are recomputed in its
        # backward); "gather" by XLA's keeps each local query's scores over the whole sequence.
        try:
            blocks = block_kernel(config.attention, config.head_dim, config.seq_len // (2 * cp), cp, hw.platform)
        except ValueError as e:
            raise ShardingError(f"DecoderConfig.attention {config.attention}: {e}") from None
        fused = blocks == "pallas"
        attention = f"{rules.context_attention} (context parallel, {'flash kernel' if fused else 'XLA'} blocks)"
        flash = fused or rules.context_attention == "ring"
    return PlannedStep(config=config, hw=hw, step=step, sizes=sizes, rows=rows, microbatches=inputs.microbatches or 1,
                       grad_accum=inputs.grad_accum, local_seq=config.seq_len // cp, tensor=tensor,
                       layers_local=stage_layers_run(config, step), attention=attention, flash=flash, fused=fused)


def estimate(inputs: PlanInput) -> dict:
    """Everything `jshard plan` prints, as one JSON-able dict (see the module docstring)."""
    planned = planned_step(inputs)
    memory = memory_per_device(planned)
    collectives = communication(planned)
    time = step_time(planned, collectives, memory.per_device["activations"])
    config, hw, step = planned.config, planned.hw, planned.step
    schedule, params = step.schedule, step.params
    total_memory = sum(memory.per_device.values())
    return dict(
        model=dataclasses.asdict(config) | {"kind": config.family, "vocab_rows": config.vocab_rows,
                                            "dtype": jnp.dtype(config.dtype).name,
                                            "params": sum(math.prod(p.shape) for p in params)},
        attention=planned.attention, mesh=dict(planned.sizes), strategy=step.rules.name,
        schedule=schedule and type(schedule).__name__,
        stage_remat=step.stage_remat if schedule else None, stage_remat_trade=memory.stage_remat_trade,
        microbatches=planned.microbatches, micro_batch_size=planned.rows, hardware=dataclasses.asdict(hw),
        tokens_per_step=time["tokens_per_step"], in_flight_microbatches=memory.in_flight,
        memory_bytes_per_device=dict(total=int(total_memory), **{k: int(v) for k, v in memory.per_device.items()}),
        model_state_bytes=int(sum(memory.per_device[k] for k in MODEL_STATE)),
        precision=_precision_line(step),
        moe=_moe_summary(config, params, planned.sizes, step.expert_axes) if is_moe(config) else None,
        flops_per_step=time["flops_per_step"],
        fits=total_memory <= hw.hbm_bytes,
        comm_bytes_per_step={k: int(sum(r["bytes"] for r in collectives if r["kind"] == k)) for k in
                             sorted({r["kind"] for r in collectives})},
        collectives=collectives, compute_s=time["compute_s"], compute_terms=time["compute_terms"], host=time["host"],
        overlap_ratios=time["overlap_ratios"], bubble_fraction=time["bubble_fraction"],
        predicted_step_s=time["predicted_step_s"], predicted_mfu=time["predicted_mfu"],
        warnings=_warnings(planned, total_memory, time["overlap_ratios"]),
    )


def _warnings(planned: PlannedStep, total_memory: int, ratios: dict) -> list[str]:
    """What the report warns of: a plan that does not fit, an overlap ratio above 1, a TP or EP
    axis across nodes, a pipeline with fewer micro-batches than stages, a model not validated."""
    config, hw, step, sizes, tensor = planned.config, planned.hw, planned.step, planned.sizes, planned.tensor
    schedule, tensor_axes, m = step.schedule, step.tensor_axes, planned.microbatches
    stages = schedule.stages if schedule else 1
    warnings = []
    if total_memory > hw.hbm_bytes:
        warnings.append(f"does not fit: {format_bytes(total_memory, 2)} per device > {format_bytes(hw.hbm_bytes, 2)} of HBM")
    if tensor > 1 and link("+".join(tensor_axes), sizes, hw)[1] == "inter":
        warnings.append(f"TP axis spans nodes: {'+'.join(tensor_axes)}={tensor} > {hw.gpus_per_node} GPUs per node")
    for name, r in ratios.items():
        if r is not None and r > 1:
            warnings.append(f"{name} overlap ratio {r:.2f} > 1: its communication cannot hide behind compute")
    if schedule and m < stages:
        warnings.append(f"m < p: {m} micro-batches for {stages} stages leave most of the pipeline idle")
    experts_axes = step.expert_axes
    if experts_axes and link("+".join(experts_axes), sizes, hw)[1] == "inter":
        warnings.append(f"EP axis spans nodes: {'+'.join(experts_axes)}={shards((experts_axes,), sizes)}"
                        + (f" (× tensor={tensor} inside it)" if tensor > 1 else "")
                        + f" > {hw.gpus_per_node} GPUs per node: its all-to-alls cross the inter-node links")
    if is_moe(config):
        warnings.append("activations: the mixture of experts' bytes per token are XLA:CPU's, measured on one small "
                        "model (docs/planning.md)")
        if schedule:
            warnings.append("a mixture of experts under a pipeline: its stage buffers use the dense block's "
                            "formulas (ZB-H1's crossover, the recompute); not validated")
    return warnings


def _moe_summary(config: DecoderConfig, params, sizes: dict[str, int], experts_axes) -> dict:
    """What the report says of a mixture of experts: its routing, slots, and where its experts are."""
    experts = [p for p in params if "experts" in p.names]
    expert_params = sum(p.elements for p in experts)
    return dict(
        experts=config.experts, top_k=config.top_k, capacity_factor=config.capacity_factor,
        capacity=capacity(config.seq_len, config.experts, config.top_k, config.capacity_factor),
        slots_per_token=slots_per_token(config), expert_axes="+".join(experts_axes),
        moe_every=config.moe_every, moe_layers=config.moe_layers,
        experts_per_device=config.experts // shards((experts_axes,), sizes),
        expert_params=expert_params, active_params=sum(p.elements for p in params) - expert_params * (
            config.experts - config.top_k) // config.experts,
        expert_param_bytes_per_device=sum(local(p.bytes, p.param, sizes) for p in experts),
    )


def _precision_line(step: Plan) -> str:
    policy = step.precision
    if policy is None:
        return f"params {step.params[0].held.name}, no master"
    line = policy.describe()
    gathered = min(policy.param, policy.compute, key=lambda d: d.itemsize)  # the layers cast, then gather
    if step.rules.zero == 3 and step.fp8 and step.zero_axes:
        line += (f" (ZeRO-3 gathers the projections' weights in float8_e4m3fn, the others in {gathered.name}, "
                 f"and reduce-scatters their gradients in {gathered.name})")
    elif step.rules.zero == 3 and gathered != policy.reduce:  # its reduce-scatter is its gather's transpose
        line += f" (ZeRO-3 gathers weights in {gathered.name} and so reduce-scatters their gradients in it)"
    return line
