"""Memory per device: the training state in the layouts the rules give (`state_bytes`: placed
exactly as `build_step` places it, from the step's own layout table), ZeRO-3's gathered layers,
and the activations: bytes per token per layer (`Activations`, measured per compiler) times the
tokens in flight, or under a pipeline the schedule's activation buffers (`pipeline_activations`);
on GPUs the gradient reduction's peak where it is above backward's (`reduction_bytes`).
`memory_per_device` adds them up for one planned step.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax.numpy as jnp

from jshard.models import DecoderConfig
from jshard.nn.context_parallel import query_tile
from jshard.parallel.tick_program import STAGE_REMAT, work as pipeline_work
from jshard.parallel.step_plan import Plan
from jshard.planner.planned_step import PlannedStep, cached_program, local, shards
from jshard.planner.counts import attention_widths, column_outputs, is_moe, mlp_widths, slots_per_token


@dataclasses.dataclass(frozen=True)
class Activations:
    """What one transformer layer keeps for backward per token, in elements of the compute
    dtype, as one compiler's buffer assignment has it for jshard's GPT block (h = embed, f = MLP
    width, a·s = attention scores per token); and, once per step, what the backward of one
    layer holds beside it. Measured from `compiled.memory_analysis()`: double differences of
    the temporaries over layer counts and batch sizes (docs/planning.md, docs/gpu-compile.md)."""

    h_replicated: float  # per element of h, whole over tensor: the norms' inputs, residuals, the out-projections' outputs
    attention: float  # per element of q, k, v and the attention output (`counts.attention_widths`), split by TP
    mlp: float  # per element of the MLP's hidden values (`counts.mlp_widths`), split by TP
    scores: float  # XLA's attention (`nn.xla_attention`): its probabilities (cuDNN's fused kernel and the ring keep none)
    xla_attention: float  # XLA's attention: more per element of q, k, v and its output than cuDNN's keeps
    h_sp_whole: float  # under SP, the part of h_replicated that stays whole: the column-parallel linears' gathered inputs
    combine: float  # a MoE layer: per element of its combine's expert outputs (top_k · h a token, whole over tensor)
    # Once per step, the backward of one layer (recomputed under remat) beside what the layers
    # keep: a multiple of what a layer keeps without remat, by remat policy.
    backward: dict[str, float]
    # The loss's logits (per token and vocab entry ÷ tensor, in 4-byte units): XLA:GPU keeps the bf16
    # logits and writes their bf16 gradient (`nn.token_losses`: 2 · 2 bytes, measured on the 8B at two
    # vocabularies, 0.5 with them sharing a slot); XLA:CPU's, fitted at vocab 256, overstates a large one.
    logits: float
    # A pipeline tick's residual record (one micro-batch's chunk), as a share of one: copied out of
    # its slot buffer (1) or read in place (0). XLA:CPU copies it under JAX 0.10 and not 0.12
    # (measured; 0.5 between the two), XLA:GPU copies it. ZB-H1's W ticks read their crossover
    # record the same way (counted so, its validation rows moved toward the compiled: XLA:GPU
    # −11.0..−3.3% → −6.8..+4.1%, XLA:CPU −6.6..+0.4% → −4.6..+3.7%).
    record: float
    # A pipeline stage that recomputes its chunk (`--stage-remat full`) holds the chunk's layers'
    # activations, this many layers' worth a layer (measured over chunks of 2 and 4 layers), and one
    # layer's backward beside them.
    stage_recompute: float
    # XLA's attention (not fused, keeping scores) and all-gathered K/V: bytes per score of the one
    # layer in backward (its fp32 scores, their exponentials and gradients), where they outgrow the
    # logits the loss's backward has freed by then (below that, at short sequences, the rows above
    # hold them: they were fitted there). Measured at long sequences (docs/planning.md): XLA:CPU,
    # one device and cp-gather over 2, 4, 8 at seq 4096, fp32 (10.5-11.2); XLA:GPU, Llama 3.1 8B with
    # XLA's attention at 8k and under cp-gather at 8k-128k, mixed, full remat (12.0-17.8).
    score_backward: float


# XLA:CPU, fp32: fitted to the `jshard plan --validate` rows (docs/planning.md); XLA:GPU, bf16:
# compiled for 8 H100s by `examples/gpu_activations.py` at h = s = 2048, its once-per-step
# terms on Llama 3.1 8B at 8192 tokens a row (docs/gpu-compile.md). XLA:GPU's `attention` and
# `mlp` are counted in its buffer assignment: the layer scan's stacked residuals hold each
# element of q, k, v, the attention output and the MLP's hidden values once (Llama 3.1 8B, and
# the GPU validation models; a GPT layer at h = s = 2048 keeps the same sum, 4 h + 2 f, at f = 4 h).
# Its `xla_attention` alone is fitted to `--validate --target h100x8`'s rows (the backward scan's
# transposed copies of attention's residuals, seen there), `scores` held at its measured slope over
# heads (docs/gpu-compile.md). A MoE layer's `combine` is counted there too: XLA:GPU keeps each
# token's top_k expert outputs (`[layers, rows, seq, top_k, h]`) for the gates' gradient; XLA:CPU's
# rows, fitted without it, stay so.
ACTIVATIONS = {
    "cpu": Activations(h_replicated=5.1, attention=1.025, mlp=1.2, scores=1.17, xla_attention=0.0, h_sp_whole=2.65,
                       combine=0.0, backward={"none": 0.0, "selective": 0.37, "full": 2.0}, logits=6.0, record=0.5,
                       stage_recompute=1.0, score_backward=10.7),
    "gpu": Activations(h_replicated=4.0, attention=1.0, mlp=1.0, scores=0.94, xla_attention=0.5, h_sp_whole=2.0,
                       combine=1.0, backward={"none": 1.0, "selective": 1.0, "full": 0.5}, logits=0.5, record=1.0,
                       stage_recompute=1.45, score_backward=15.0),
}
# Under remat the same on both compilers:
ACT_FULL_REMAT = 1.0  # remat full: each layer keeps its input only
# remat selective keeps what the linear layers output (`dots_with_no_batch_dims_saveable`) and
# recomputes the rest (attention core, norms, GELU) one layer at a time in backward; measured
# the same way, and over layer counts to part the two (docs/planning.md):
ACT_SEL_H_REPLICATED = 2.0  # kept per layer, whole over tensor
ACT_SEL_SPLIT = 1.0  # kept per layer, per element of the column-parallel linears' outputs (`counts.column_outputs`)
ACT_SEL_H_SP_WHOLE = 1.0  # under SP: the part of ACT_SEL_H_REPLICATED that stays whole
# A mixture of experts (`jshard.moe`) in place of the MLP: the dispatch buffer has E·C slots
# per row (C = `moe.capacity` of the whole row), s = E·C/seq per token (about capacity factor
# × top_k), every slot computed whether a token fills it or not. Measured as the ACT_* above
# (slopes over batch size, parted over 2 and 4 layers, varying the MLP width, the capacity
# factor, the embedding and the experts; ep, dp, dp+ep+tp, fsdp+ep: docs/planning.md), in
# place of the dense MLP's `f` term:
ACT_SLOT_H = 1.0  # per slot: the buffer the experts read (whole over tensor; under ep the all-to-all'd copy)
ACT_SLOT_F = 3.0  # per slot: gate and up (2f) and their product (SiLU recomputed: `nn.swiglu`), split over tensor
ACT_ROUTER_FP32 = 1.0  # per expert: the router's probabilities, float32 whatever the compute dtype
# Once per step, what the backward of one MoE layer holds at once (the gradients of gate_up
# and the hidden, per slot, split over tensor); under remat (full or selective: the experts'
# matmuls have a batch dim, `experts`, so selective keeps none of them) that layer's recompute
# with it, in place of the dense layer's recomputed activations (measured: none beside it).
ACT_SLOT_BACKWARD_F = 8.0
ACT_SLOT_RECOMPUTE_F = 9.0
ACT_SLOT_TP_H = 2.0  # under TP, per slot: the two buffers its all-reduces leave whole (down's output, gate_up's input gradient)
RING_BLOCK_FP32 = 4  # ring attention: fp32 (query tile × keys) arrays its backward holds at once


def gathered_layers_bytes(plan: Plan, layers: int, platform: str, remat: str) -> int:
    """ZeRO-3: two layers' weights gathered at once (one in use, the next arriving), each still
    split over its other axes (tensor; an expert's weights over `expert`); three on a GPU whose
    program keeps several collectives in flight (`Plan.collectives_in_flight`): XLA:GPU then
    starts a gather a layer earlier (measured on the GPU validation rows: 0.2 to 1 layer more);
    four there under full `remat` (the model's), whose peak is in the backward loop, where
    XLA:GPU's pipeliner gathers a trip early too (docs/gpu-compile.md: one of Llama 3.1 8B's
    layers, 0.41 GiB; the rest of its +0.4 to +1.3 GiB, transposed copies, is not counted).
    A layer is one of the stack's: `layers` blocks, or of a MoE Llama `layers // moe_every` of
    `moe_every` blocks each (the stack's own leading dim)."""
    zero, sizes = set(plan.rules.zero_axes), plan.mesh_sizes
    stacked = [p for p in plan.params if p.stacked]
    if not stacked:
        return 0
    per_layer = sum(p.gathered_bytes // shards(p.param[1:], sizes, skip=zero) for p in stacked)
    held = 2
    if platform == "gpu" and plan.collectives_in_flight > 1:
        held += 2 if remat == "full" else 1
    return held * per_layer // min(layers, stacked[0].shape[0])


def grad_bytes(p, plan: Plan) -> int:
    """One param's gradient per device as backward leaves it: in the param's dtype and layout,
    or its optimizer shard under ZeRO-2/3 (ZeRO-2 scatters it in the reduction dtype onto
    the master's: `ShardedStep._differentiable`)."""
    zero, sizes = plan.rules.zero, plan.mesh_sizes
    if zero < 2:
        return local(p.bytes, p.param, sizes)
    dtype = p.master if zero == 2 and p.master else p.held
    return local(p.elements * dtype.itemsize, p.opt, sizes)


def state_bytes(plan: Plan, layers: int, platform: str, remat: str) -> dict[str, int]:
    """Training state per device: params and grads as held, the fp32 master (mixed precision)
    and Adam's two moments in the optimizer's layout, ZeRO-3's gathered layers (on `platform`,
    under the model's `remat`);
    under gradient accumulation, the sum of the micro-batches' gradients, in the reduction
    dtype, in the layout backward leaves them (`accumulate`'s carry)."""
    params, sizes = plan.params, plan.mesh_sizes
    return dict(
        params=sum(local(p.bytes, p.param, sizes) for p in params),
        grads=sum(grad_bytes(p, plan) for p in params),
        accumulated=sum(local(p.reduce_bytes, p.param if plan.rules.zero < 2 else p.opt, sizes) for p in params)
        if plan.grad_accum > 1 else 0,
        master=sum(local(p.elements * p.master.itemsize, p.opt, sizes) for p in params if p.master),
        optimizer=2 * sum(local(p.elements * p.optimizer_dtype.itemsize, p.opt, sizes) for p in params),
        gathered=gathered_layers_bytes(plan, layers, platform, remat) if plan.rules.zero == 3 and plan.zero_axes else 0,
    )


MODEL_STATE = ("params", "grads", "master", "optimizer")  # ZeRO's "model states" (its Figure 1)

# XLA:GPU combines the collectives that follow backward into buffers of up to this many bytes
# (xla/service/collective_utils.h, kDefaultAllReduceCombineThreshold and its reduce-scatter twin).
XLA_GPU_COMBINE_BYTES = 30 * 2**20


def reduction_bytes(plan: Plan) -> int:
    """XLA:GPU: what the gradient reduction after backward holds at once (ZeRO-0/1/2's all-reduce
    or reduce-scatter; ZeRO-3 reduces each layer's inside the stack): the gradients concatenated
    in the reduction dtype (one combined buffer, up to `XLA_GPU_COMBINE_BYTES`) beside the reduced
    ones (whole, or on the optimizer's shards), as the GPU buffer assignment of the validation
    rows shows them (docs/gpu-compile.md). Where backward keeps little (remat, mixed precision's
    bf16 activations beside an fp32 reduction), this and not backward is the step's peak."""
    sizes = plan.mesh_sizes
    if plan.rules.zero == 3 or plan.stage_axis:
        return 0
    batch = {a for a in plan.grad_axes if sizes[a] > 1}
    reduced = [p for p in plan.params if batch - {a for axes in p.param for a in axes}]
    combined = sum(local(p.reduce_bytes, p.param, sizes) for p in reduced)
    out = sum(local(p.reduce_bytes, p.opt, sizes) for p in reduced)
    return min(combined, XLA_GPU_COMBINE_BYTES) + out if reduced else 0


def _moe_parts(config: DecoderConfig) -> tuple[DecoderConfig, DecoderConfig, int]:
    """(one MoE block, one dense block, blocks per layer of the stack) of a MoE Llama: its
    `moe_every` = n blocks of a stacked layer are n - 1 dense ones and one with the experts."""
    n = getattr(config, "moe_every", 1)
    return dataclasses.replace(config, moe_every=1, layers=1), dataclasses.replace(config, experts=0), n


def activation_bytes_per_token_layer(config: DecoderConfig, tensor: int, sp: bool, flash: bool,
                                     act: Activations) -> float:
    """Bytes per token per block that its backward keeps (a MoE Llama's: the mean over its blocks)."""
    itemsize = jnp.dtype(config.dtype).itemsize
    h = config.embed
    if config.remat == "full":  # each layer of the stack keeps its input (a MoE Llama's: of moe_every blocks)
        return ACT_FULL_REMAT * h * itemsize / (tensor if sp else 1) / (_moe_parts(config)[2] if is_moe(config) else 1)
    if is_moe(config) and config.moe_every > 1:
        block, dense, n = _moe_parts(config)
        return (activation_bytes_per_token_layer(block, tensor, sp, flash, act)
                + (n - 1) * activation_bytes_per_token_layer(dense, tensor, sp, flash, act)) / n
    if config.remat == "selective":
        whole = (ACT_SEL_H_SP_WHOLE * h + (ACT_SEL_H_REPLICATED - ACT_SEL_H_SP_WHOLE) * h / tensor if sp
                 else ACT_SEL_H_REPLICATED * h)
        if is_moe(config):  # the experts' matmuls have a batch dim: only the router's output is kept
            return (whole + ACT_SEL_SPLIT * 3 * h / tensor) * itemsize + _router_bytes(config)
        return (whole + ACT_SEL_SPLIT * column_outputs(config) / tensor) * itemsize
    return _all_activations(config, tensor, sp, flash, act)


def _all_activations(config: DecoderConfig, tensor: int, sp: bool, flash: bool, act: Activations) -> float:
    """Bytes per token of one layer that keeps everything for its backward (a MoE layer: its
    slots and router in place of the MLP's `f` term)."""
    h, f, scores = config.embed, config.mlp, 0 if flash else config.heads * config.seq_len
    split = (act.attention + (0.0 if flash else act.xla_attention)) * attention_widths(config) + act.scores * scores
    whole = act.h_sp_whole * h + (act.h_replicated - act.h_sp_whole) * h / tensor if sp else act.h_replicated * h
    itemsize = jnp.dtype(config.dtype).itemsize
    if is_moe(config):
        slots = slots_per_token(config) * (ACT_SLOT_H * h + ACT_SLOT_F * f / tensor)
        return (whole + act.combine * config.top_k * h + split / tensor + slots) * itemsize + _router_bytes(config)
    return (whole + (split + act.mlp * mlp_widths(config)) / tensor) * itemsize


def _router_bytes(config: DecoderConfig) -> float:
    return ACT_ROUTER_FP32 * config.experts * 4


def backward_working_bytes(config: DecoderConfig, tensor: int, sp: bool, flash: bool, act: Activations) -> float:
    """Bytes per token the backward adds once per step beyond what each layer keeps, one layer at
    a time (`Activations.backward`: under remat the layer being recomputed with it); a MoE
    layer's own measured terms, its experts' gradients (ACT_SLOT_BACKWARD_F), under remat with
    their recompute (ACT_SLOT_RECOMPUTE_F), and under TP two whole buffers (ACT_SLOT_TP_H);
    under remat with `moe_every` = n, the n - 1 dense blocks recomputed with it."""
    recomputed = act.backward[config.remat]
    if is_moe(config):
        _, dense, n = _moe_parts(config)
        coefficient = ACT_SLOT_BACKWARD_F if config.remat == "none" else ACT_SLOT_RECOMPUTE_F
        whole = ACT_SLOT_TP_H * config.embed if tensor > 1 else 0.0
        experts = slots_per_token(config) * (coefficient * config.mlp / tensor + whole) * jnp.dtype(config.dtype).itemsize
        dense_layers = (n - 1) * recomputed * _all_activations(dense, tensor, sp, flash, act) if config.remat != "none" else 0.0
        return experts + dense_layers
    return _all_activations(config, tensor, sp, flash, act) * recomputed


def stack_bytes(plan: Plan) -> int:
    """The layer stack's params on one device, as held."""
    return sum(local(p.bytes, p.param, plan.mesh_sizes) for p in plan.params if p.stacked)


def crossover_bytes_per_token_layer(config: DecoderConfig, tensor: int, sp: bool) -> float:
    """What ZB-H1's B hands its W per token and layer: each matmul's and norm's output gradient."""
    h = config.embed
    return (column_outputs(config) / tensor + (4 * h / tensor if sp else 4 * h)) * jnp.dtype(config.dtype).itemsize


def pipeline_activations(program, config: DecoderConfig, chunk_layers: int, per_token_layer: float, logits: float,
                         tokens: int, a_mb: int, tensor: int, sp: bool, stage_remat: str, act: Activations) -> float:
    """Bytes of a pipelined step's activation buffers per device (`pipeline.compile_program`'s
    slots, each buffer one slot more, which nobody reads) and of one chunk's backward.

    Kept (`stage_remat="none"`): per micro-batch in flight what the chunk's layers keep for
    their backward (an unpipelined layer's activations) and, at the last position, the head's
    (the logits'), and the one record a tick reads; ZB-H1's crossover, what B hands W: each
    matmul's and norm's output gradient per layer, and the logits', and the crossover record a
    W tick reads. Recomputing: the stage inputs, and one chunk's backward."""
    itemsize = jnp.dtype(config.dtype).itemsize

    def slots(count):
        return count + 1 if count else 0

    h = config.embed
    crossover = crossover_bytes_per_token_layer(config, tensor, sp)
    head = logits / act.logits + h * itemsize  # the softmax, fp32, and the final norm's output
    total = (program.act_slots + program.grad_slots + 2) * a_mb + tokens * (
        program.crossover_slots["layers"] * chunk_layers * crossover  # (measured: not its unread slot)
        + program.crossover_slots["last"] * head)
    # The crossover record a W tick reads, copied or read in place as the residual record is.
    total += tokens * act.record * chunk_layers * crossover * bool(program.crossover_slots["layers"])
    if stage_remat == "full":  # one chunk recomputed (`Activations.stage_recompute`), one layer's backward beside it
        return total + tokens * ((chunk_layers * act.stage_recompute + 1) * per_token_layer + logits)
    total += tokens * (slots(program.saved_slots["layers"]) * chunk_layers * per_token_layer
                       + slots(program.saved_slots["last"]) * head)
    # The residual record a tick reads (`Activations.record`), one layer's backward beside the
    # kept ones (as unpipelined: `Activations.backward`), and the head's backward.
    return total + tokens * ((chunk_layers * act.record + act.backward["none"]) * per_token_layer + logits)


class MemoryEstimate(NamedTuple):
    per_device: dict[str, int]  # bytes per device by kind (the estimate's `memory_bytes_per_device`, less its total)
    stage_remat_trade: dict | None  # under a pipeline: each `--stage-remat` mode's activations and work
    in_flight: int  # micro-batches in flight at the peak


def memory_per_device(planned: PlannedStep) -> MemoryEstimate:
    """One device's memory at the step's peak, by kind: the training state (`state_bytes`), the
    activations (with the pipeline's trade of them against recompute), the gradient reduction's
    peak on a GPU (`reduction_bytes`), and the batch."""
    config, hw, step = planned.config, planned.hw, planned.step
    schedule, stage_remat, rules = step.schedule, step.stage_remat, step.rules
    rows, local_seq, tensor, sp, flash = planned.rows, planned.local_seq, planned.tensor, step.sequence_parallel, planned.flash
    cp = step.context_shards
    memory = state_bytes(step, config.layers, hw.platform, config.remat)
    if schedule and hw.platform == "cpu":
        # The executor accumulates gradients in the scan's carry: XLA:CPU keeps its input and
        # output buffers apart, XLA:GPU updates it in place (measured).
        memory["grads"] *= 2
    act = ACTIVATIONS[hw.platform]
    per_token_layer = activation_bytes_per_token_layer(config, tensor, sp, flash, act)
    logits = act.logits * config.vocab / tensor * 4
    if schedule:
        a_mb = rows * local_seq * config.embed * jnp.dtype(config.dtype).itemsize
        chunk_layers = step.layer_slots
        # Each chunk's weights are sliced out of the local stack for the branch that runs it
        # (measured: XLA materialises the slices), so the stack counts once more.
        memory["chunk_weights"] = stack_bytes(step)
        # The trade `stage_remat` picks: activation memory against the work of the backward.
        trade = {mode: dict(activations=int(pipeline_activations(
                     cached_program(schedule, mode), config, chunk_layers, per_token_layer, logits, rows * local_seq,
                     a_mb, tensor, sp, mode, act)), work=pipeline_work(schedule, mode))
                 for mode in STAGE_REMAT}
        memory["activations"] = trade[stage_remat]["activations"]
        in_flight = schedule.peak_in_flight()
    else:
        recomputed = backward_working_bytes(config, tensor, sp, flash, act)
        memory["activations"] = int(rows * local_seq * (config.layers * per_token_layer + recomputed + logits))
        in_flight, trade = 1, None
    # (Not in a pipeline stage that recomputes its chunk: measured, its GPU rows read over with it,
    # the Llama's 1F1B +11.9% and ZB-H1 +7.7%, and within without, +8.1% and +5.3%.)
    if not flash and not (schedule and stage_remat == "full"):
        # one layer's scores in backward (each local query's over the whole sequence) beyond the freed logits
        scores = act.score_backward * rows * config.heads // tensor * local_seq * config.seq_len
        memory["activations"] += max(0, int(scores - rows * local_seq * logits))
    if cp > 1 and rules.context_attention == "ring" and not planned.fused:
        # The ring's working set by XLA's blocks, one tile of queries of one block at a time: over the largest
        # block (its own, local_seq keys), scores, probabilities and their two gradients in fp32,
        # in backward (measured: the compiled temporaries at seq 4096 over 2, 4, 8 devices,
        # examples/context_parallel.py).
        tile = query_tile(local_seq)
        memory["activations"] += RING_BLOCK_FP32 * 4 * rows * config.heads // tensor * tile * local_seq
    if cp > 1 and rules.context_attention == "gather" and config.remat == "none" and not schedule:
        # Each layer's all-gathered K and V, kept for backward (`nn.context_parallel`, named so that
        # ZeRO's remat policy keeps them too): the whole sequence's keys and values, every layer.
        kv_heads = getattr(config, "kv_heads", config.heads) // tensor
        memory["activations"] += (config.layers * 2 * rows * config.seq_len * kv_heads * config.head_dim
                                  * jnp.dtype(config.dtype).itemsize)
    if hw.platform == "gpu":  # the larger of backward's peak and the reduction's (above what backward counts)
        memory["reduction"] = max(0, reduction_bytes(step) - memory["grads"] - memory["activations"])
    memory["batch"] = rows * planned.microbatches * planned.grad_accum * (config.seq_len + 1) * 4
    return MemoryEstimate(memory, trade, in_flight)
