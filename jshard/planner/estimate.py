"""The planner's formulas: for a decoder (GPT or Llama), a mesh, a strategy (rules preset), a pipeline schedule,
precision, remat policy, micro-batch size and a hardware profile, `estimate` gives per device:

    memory   params, grads, Adam's two moments in the layouts the rules give (placed exactly as
             `build_step` places them: the step's own layout table, on an abstract mesh), the
             gathered layers of ZeRO-3, and activations: bytes per token per layer times the
             tokens in flight (the schedule's activation buffers under a pipeline); on GPUs the
             gradient reduction's peak where it is above backward's (`reduction_bytes`)
    comm     bytes per collective kind and mesh axis per step (K, as `jshard/hlo.py` counts),
             and their time at the bandwidth of the link the axis falls on (intra- or inter-node)
    time     compute from model FLOPs (6·N + attention, plus the forward that remat and the
             pipeline's stage recompute run again), the bubble, exposed communication, MFU

A mixture of experts (a Llama with `experts`): its dispatch buffer's slots in the activations
(ACT_SLOT_*), its all-to-alls on the critical path, and in the compute time every slot the
experts run (E·C per row, filled or not), where MFU's model FLOPs count top_k experts a token;
context parallelism with experts is refused (not modelled).

The formulas are ../shared/SPEC.md's; `validate.py` checks them against XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from flax import nnx

from jshard import metrics
from jshard.layout import Layout
from jshard.mesh import STANDARD_AXES as AXES
from jshard.models import DecoderConfig, decoder
from jshard.parallel.pipelining import STAGE_REMAT, compile_program, work as pipeline_work
from jshard.parallel.step_plan import Plan, make_plan
from jshard.placement import format_bytes
from jshard.planner import physics
from jshard.planner.counts import attention_widths, column_outputs, fp8_cast_widths, input_projections, mlp_widths
from jshard.moe import capacity
from jshard.nn import attention_implementation, compute_dtype, query_tile
from jshard.nn.context_parallel import check_all_to_all_heads
from jshard.rules import ShardingError

GiB = 2**30


# A GPU step's memory-bound work between its GEMMs (`compute_terms`), as bytes of HBM traffic
# at the profile's bandwidth: what a step measured on one H100 takes beyond its GEMMs and
# attention (`physics`, the measured sweep), AdamW's pass and the launches, fitted over the
# runs of docs/results/bench-step-h100-jax0.11.2-2026-11-27.json, each checked with it left out
# (`jshard bench fit`, docs/planning.md):
ELEMENTWISE_LAYER_BYTES = 47  # per token, layer and element of embed + mlp: norms, activations,
#                                residuals, the layer scan's stacking of what backward keeps
ELEMENTWISE_LOGIT_BYTES = 22  # per token and vocabulary entry: the loss over the logits, in fp32

@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense bf16 FLOP/s per device (fp32 matmuls: half, as TF32)
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    intra_bw: float  # bytes/s per device, one direction, inside a node (NVLink)
    inter_bw: float  # bytes/s per device, one direction, between nodes (one NIC per GPU)
    gpus_per_node: int
    # Fraction of peak that a step's matmuls sustain. Measured on one H100 (`jshard bench gpu`,
    # docs/benchmarks.md): an 8192² bf16 matmul 681-806 TFLOP/s, a 1B model's matmul and
    # attention kernels 732 (its profile): 0.74-0.75 of the 989 datasheet.
    matmul_efficiency: float = 0.75
    # Where attention may run as cuDNN's fused flash kernel, which keeps no (seq × seq) scores
    # (`nn.attention_implementation`: GPUs, in bf16); XLA's materialises them for backward.
    platform: str = "gpu"
    # Dense FP8 FLOP/s per device (the `fp8` policy's projections); None: no FP8 tensor cores.
    # A CPU has none either, but computes FP8 products in bf16 (`nn.fp8`): its bf16 peak.
    fp8_peak_flops: float | None = None
    # A GPU step's memory-bound work between its GEMMs, as bytes of HBM traffic (below).
    elementwise_layer_bytes: float = ELEMENTWISE_LAYER_BYTES
    elementwise_logit_bytes: float = ELEMENTWISE_LOGIT_BYTES
    # Fake CPU devices (`platform` "cpu") share one host: what a pipeline tick and a ZeRO-3 gather
    # or scatter (per other device of its group: a rendezvous of their threads) cost the host
    # beyond its FLOPs (`host_step_seconds`).
    tick_s: float = 0.0
    call_s: float = 0.0


# Datasheets (SXM parts; NVLink 4 = 450 GB/s each way, 400 Gb/s InfiniBand NIC per GPU).
# cpu: this repository's 2-core host (README: a measured 206 GFLOP/s), threads as "links".
# The CPU profile's host constants (`bench fit` of a `bench search --json` result)
CPU_HOST = dict(matmul_efficiency=0.732, tick_s=1.88e-3, call_s=5.63e-5)
HARDWARE = {
    "h100": Hardware("h100", 989e12, 80 * GiB, 3.35e12, 450e9, 50e9, 8, fp8_peak_flops=1979e12),
    "h200": Hardware("h200", 989e12, 141e9, 4.8e12, 450e9, 50e9, 8, fp8_peak_flops=1979e12),
    "a100": Hardware("a100", 312e12, 80 * GiB, 2.04e12, 300e9, 25e9, 8),
    # matmul_efficiency, tick_s, call_s: fitted (`bench.fit.fit_host`) to `jshard bench search` of
    # the small GPT on 8 fake devices of this 2-core host (jax 0.12.0.1, timed in rounds), checked
    # on the small Llama (docs/planning.md).
    "cpu": Hardware("cpu", 0.206e12, 16 * GiB, 20e9, 10e9, 10e9, 8, matmul_efficiency=CPU_HOST["matmul_efficiency"],
                    platform="cpu", tick_s=CPU_HOST["tick_s"], call_s=CPU_HOST["call_s"], fp8_peak_flops=0.206e12),
}
# A device's kind, as JAX names it, to its profile (the parts the profiles describe).
KINDS = {"H100": "h100", "H200": "h200", "A100": "a100"}


def hardware_of(device) -> Hardware | None:
    """The profile of a JAX device: `cpu` for a CPU (fake devices: the host's), a GPU's by its
    kind; None where there is none."""
    if device.platform == "cpu":
        return HARDWARE["cpu"]
    return next((HARDWARE[name] for kind, name in KINDS.items() if kind in device.device_kind), None)

# XLA's attention (not cuDNN's fused kernel) computes the seq × seq scores in HBM: masking,
# softmax and their gradients in fp32. Bytes per score element (one query, key, head and layer):
# a step with XLA's attention less the rest of its prediction (its QK^T and PV as batched GEMMs
# on the sweep), over its scores: 38 (Llama-3.2-1B), 20 (GPT-1B), measured on one H100 with
# `nn.xla_attention` (docs/results/gpu-check-h100-jax0.11.2-2026-11-26-softmax.json), their mean.
XLA_SCORE_BYTES = 29
# FP8 (`nn.fp8`): each cast reads its bf16 operand twice (its max, then the cast) and writes one
# byte: activations and gradients per token (`counts.fp8_cast_widths`), the weights forward and
# again in backward. Counted from the bytes, not fitted (docs/planning.md).
FP8_CAST_BYTES = 5


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


# --- the model's params, placed by the rules ----------------------------------------


def step_plan(config: DecoderConfig, layout: Layout) -> Plan:
    """The decoder's step plan, the step's own (`parallel.plan.make_plan`, with its checks), from
    abstract shapes on an abstract mesh (the layout's): no memory is allocated, no device is needed."""
    return make_plan(_abstract_decoder(config), layout)


@functools.cache
def _abstract_decoder(config: DecoderConfig):
    return nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0)))


# A schedule's executor program is a pure function of the (frozen) schedule: kept for a search.
_program = functools.cache(compile_program)


@functools.cache
def _cached_plan(config: DecoderConfig, layout: Layout) -> Plan:
    """`step_plan`, kept: a search estimates one plan under many batch and remat choices, which
    the plan does not depend on (the params and their layouts do not change)."""
    return step_plan(config, layout)


def shards(layout, sizes: dict[str, int], skip=frozenset()) -> int:
    return math.prod(sizes[a] for axes in layout for a in axes if a not in skip)


def local(nbytes: int, layout, sizes: dict[str, int]) -> int:
    return nbytes // shards(layout, sizes)


def gathered_layers_bytes(plan: Plan, layers: int, platform: str = "cpu") -> int:
    """ZeRO-3: two layers' weights gathered at once (one in use, the next arriving), each still
    split over its other axes (tensor; an expert's weights over `expert`); three on a GPU whose
    program keeps several collectives in flight (`Plan.collectives_in_flight`): XLA:GPU then
    starts a gather a layer earlier (measured on the GPU validation rows: 0.2 to 1 layer more).
    A layer is one of the stack's: `layers` blocks, or of a MoE Llama `layers // moe_every` of
    `moe_every` blocks each (the stack's own leading dim)."""
    zero, sizes = set(plan.rules.zero_axes), plan.mesh_sizes
    stacked = [p for p in plan.params if p.names and p.names[0] == "layers"]
    if not stacked:
        return 0
    per_layer = sum(p.gathered_bytes // shards(p.param[1:], sizes, skip=zero) for p in stacked)
    held = 3 if platform == "gpu" and plan.collectives_in_flight > 1 else 2
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


def state_bytes(plan: Plan, layers: int, platform: str = "cpu") -> dict[str, int]:
    """Training state per device: params and grads as held, the fp32 master (mixed precision)
    and Adam's two moments in the optimizer's layout, ZeRO-3's gathered layers (on `platform`);
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
        gathered=gathered_layers_bytes(plan, layers, platform) if plan.rules.zero == 3 and plan.zero_axes else 0,
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


# --- communication --------------------------------------------------------------------


def in_mesh_order(axes) -> list[str]:
    """Mesh axes in the order of the mesh (as a compiled program's groups name them)."""
    return sorted(axes, key=AXES.index)


def _add(table: dict, kind: str, axes, nbytes: float) -> None:
    if nbytes and axes:
        key = (kind, axes if isinstance(axes, str) else "+".join(axes))
        table[key] = table.get(key, 0) + nbytes


def plain_grad_axes(plan: Plan) -> tuple[str, ...]:
    """The axes (size > 1) whose gradient sum is an all-reduce: the batch and context axes but ZeRO's."""
    zero = set(plan.zero_axes)
    return tuple(a for a in plan.grad_axes if plan.mesh_sizes[a] > 1 and a not in zero)


def folded_norms(plan: Plan) -> frozenset[str]:
    """The paths of the params whose gradient XLA:GPU sums over tensor and the batch axes in one
    all-reduce: under SP, a norm outside the layer stack (the final norm), whose input is split
    over seq (SP reduces its gradient over tensor) and which the batch axes all-reduce whole (not
    split by ZeRO, not on every pipeline stage). Measured on the dp+tp+sp validation rows; the
    stack's norms, reduced inside the layer scan, and the position table are not folded."""
    plain = set(plain_grad_axes(plan))
    if not plan.sequence_parallel or not plain or plan.stage_axis:
        return frozenset()
    apart = plain | set(plan.zero_axes)
    return frozenset(p.path for p in plan.params if "norm" in p.path and p.names[:1] != ("layers",)
                     and not apart & {a for axes in p.param for a in axes})


def param_traffic(plan: Plan, remat: bool = False, tied_head: bool = True, combined: bool = False,
                  folded: frozenset[str] = frozenset(), scale_reductions: int = 1, looked_up: bool = False) -> dict:
    """{(kind, axes): bytes} of the gradient and weight collectives, per device per step.

    ZeRO-3 gathers each param forward and reduce-scatters its gradient; the layer stack's
    kernels and norm scales are gathered again in backward (the remat policy frees them; under
    `remat`, every stacked param, biases too, as the layer's forward runs again); the token
    table, `looked_up` without a gather (`lookup_axes`), is neither gathered nor scattered; a
    tied table's gradient is reduce-scattered once per use (lookup and head; XLA:GPU,
    `combined`, sums them first). ZeRO-1/2
    reduce-scatter each gradient and gather the new params (ZeRO-2 per use, inside backward).
    What is left of the batch axes all-reduces the gradient in its optimizer layout.
    Under a pipeline, params on every stage (embeddings, final norm) sum over the stage axis:
    after the batch axes' all-reduce, or (`combined`, as XLA:GPU does) in one all-reduce over both;
    and the `folded` params (`folded_norms`) over the batch and tensor axes at once.
    Gathers move the held dtype (ZeRO-3's, of a matrix, the compute dtype where narrower: the
    layers cast before they gather; under FP8 a projection's kernel in e4m3); reductions the
    reduction dtype, but ZeRO-3's reduce-scatter is its gather's transpose, in the compute dtype.
    An FP8 kernel's scale is all-reduced over the ZeRO axes `scale_reductions` times a layer
    (XLA:GPU's collective pipeliner computes the next layer's once more, for its early gather).
    """
    sizes, stage_axis, zero = plan.mesh_sizes, plan.stage_axis, set(plan.zero_axes)
    # Gradients are summed over the batch and context axes (the step's grad axes).
    plain = plain_grad_axes(plan)
    out: dict = {}
    for p in plan.params:
        in_param = {a for axes in p.param for a in axes} & zero
        # (a batch axis that splits the param, as `expert` an expert's weights: its gradient
        # is whole there already, each device having computed with every row sent to it)
        reduced = tuple(a for a in plain if not any(a in axes for axes in p.param))
        table = p.path.startswith("token_embed")
        # a tied table's two gradients (lookup, head), each scattered; XLA:GPU sums them first (`combined`)
        tied = table and tied_head and plan.rules.zero >= 2 and not combined
        if in_param and not (table and looked_up):  # (ZeRO-3's lookup: the table neither gathered nor scattered)
            size = p.gathered_bytes // shards(p.param, sizes, skip=in_param)
            # (a norm's scale: the norm's backward runs it again, `nn.recomputed`; its bias it does not read)
            again = p.stacked_kernel or (p.names[:1] == ("layers",) and (remat or p.path.endswith("norm/scale")))
            _add(out, "all-gather", in_mesh_order(in_param), size * (2 if again else 1))
            scattered = p.scattered_bytes // shards(p.param, sizes, skip=in_param)
            _add(out, "reduce-scatter", in_mesh_order(in_param), scattered * (2 if tied else 1))
            if p.fp8:  # its e4m3 shards share one scale, the max of theirs: a float32 all-reduce a layer
                layers = p.shape[0] if p.names[:1] == ("layers",) else 1
                _add(out, "all-reduce", in_mesh_order(in_param), 4 * layers * scale_reductions)
        elif shards(p.opt, sizes) > shards(p.param, sizes):
            axes = in_mesh_order({a for axes in p.opt for a in axes} - {a for axes in p.param for a in axes})
            _add(out, "all-gather", axes, p.bytes // shards(p.param, sizes))
            _add(out, "reduce-scatter", axes, p.reduce_bytes // shards(p.param, sizes) * (2 if tied else 1))
        on_every_stage = stage_axis and not any(stage_axis in axes for axes in p.param)
        if on_every_stage and combined:
            _add(out, "all-reduce", tuple(a for a in plan.mesh_sizes if a in reduced or a == stage_axis),
                 p.reduce_bytes // shards(p.opt, sizes))
            continue
        if p.path in folded:
            reduced = tuple(a for a in sizes if a in reduced or a in plan.tensor_axes)
        _add(out, "all-reduce", reduced, p.reduce_bytes // shards(p.opt, sizes))
        if on_every_stage:
            _add(out, "all-reduce", (stage_axis,), p.reduce_bytes // shards(p.opt, sizes))
    return out


def lookup_axes(config: DecoderConfig, plan: Plan, tokens: int) -> tuple[str, ...]:
    """The ZeRO axes the token table is looked up over without gathering it, for a call of the
    model on `tokens` local tokens (`nn.Embed`): under ZeRO-3, those that split its embed dim
    alone and the batch, where the table is no head's and has more local rows than `tokens`."""
    table = next((p for p in plan.params if p.path.startswith("token_embed")), None)
    if plan.rules.zero != 3 or table is None or config.tied_head:
        return ()
    zero, batch = set(plan.zero_axes), {a for a in plan.batch_axes if plan.mesh_sizes[a] > 1}
    vocab, embed = table.param
    axes = tuple(a for a in embed if a in zero)
    fewer = tokens < config.vocab_rows // shards((vocab,), plan.mesh_sizes)
    return axes if axes and fewer and not zero & set(vocab) and set(axes) <= batch else ()


def lookup_traffic(config: DecoderConfig, plan: Plan, axes: tuple[str, ...], tokens: int) -> dict:
    """{(kind, axes): bytes} of ZeRO-3's lookup without the table over `axes` (`lookup_axes`) of
    `tokens` local tokens a step: the group's int32 ids gathered, and the looked-up rows
    all-to-all'd to their devices (tokens × embed, its columns over the other axes if any),
    forward and, its transpose, backward."""
    if not axes:
        return {}
    table = next(p for p in plan.params if p.path.startswith("token_embed"))
    columns = config.embed // shards((table.param[1],), plan.mesh_sizes, skip=set(axes))
    return {("all-gather", axes): shards((axes,), plan.mesh_sizes) * tokens * 4,
            ("all-to-all", axes): 2 * tokens * columns * jnp.dtype(config.dtype).itemsize}


def tensor_traffic(config: DecoderConfig, params, rows: int, seq: int, layers_run: int, sp: bool,
                   tensor: tuple[str, ...], combined: bool = False, folded: frozenset[str] = frozenset(),
                   ring: int = 0) -> dict:
    """{(kind, tensor axes): bytes} of Megatron TP / SP for `rows` sequences through `layers_run` layers.

    Per block, A = (rows, seq, embed) in the compute dtype, and c = the block's input
    projections (`counts.input_projections`: column-parallel linears reading the normed
    residual, each reducing its own input gradient; the GPT's qkv and up, 2; `combined`, as
    XLA:GPU sums them: one per normed input, 2): TP all-reduces A
    2 + c times (2 forward, c backward); SP all-gathers it 4 times (2 forward, where linears
    reading one input share a gather, 2 backward) and reduce-scatters it 2 + c times. The
    vocab-parallel embedding and head add 2 A (forward lookup, head's input gradient),
    the vocab-parallel cross-entropy 3 all-reduces of (rows, seq) in fp32, and under SP the
    params that see seq-split inputs (norms, position table) all-reduce their gradients, but
    the `folded` ones, which the batch axes' all-reduce sums over tensor too (`param_traffic`).
    Under remat (full or selective) each block's forward runs again in backward up to its
    last collective, whose output backward does not need: TP's first all-reduce, SP's two
    all-gathers and its first reduce-scatter, once more per block. A layer of the stack that
    holds several blocks (a MoE Llama's `moe_every`) reruns all but its last one whole: their
    second all-reduce (SP: reduce-scatter) too.

    `ring` (the tensor axes' size, under `Rules.collective_matmul`): SP's gathers and
    reduce-scatters at the linears (the head's included) are collective matmuls, n - 1 permutes
    of 1/n of A each, and a linear's input gradient is reduced round its own ring (nothing for
    the compiler to combine); the embedding's reduce-scatter and its gradient's gather stay.
    """
    if not tensor:
        return {}
    a = rows * seq * config.embed * jnp.dtype(config.dtype).itemsize
    out: dict = {}
    c = input_projections(config, combined and not ring)
    blocks, reductions = 4 * layers_run * a + 2 * a, (2 + c) * layers_run * a + 2 * a
    inner = layers_run - layers_run // config.blocks_per_layer  # blocks rerun whole
    again = layers_run * a if config.remat != "none" else 0
    whole = inner * a if config.remat != "none" else 0
    ce = 3 * rows * seq * 4
    gathered, scattered = blocks + 2 * again, reductions + again + whole
    if sp and ring:  # all but the embedding's: its lookup's reduce-scatter, its gradient's gather
        _add(out, "collective-permute", tensor, (gathered - a + scattered - a) * (ring - 1) // ring)
        gathered, scattered = a, a
    if sp:
        _add(out, "all-gather", tensor, gathered)
        _add(out, "reduce-scatter", tensor, scattered)
        # (the position table's: the gradient of the rows looked up, seq of them)
        replicated = sum(p.bytes for p in params if "norm" in p.path and p.path not in folded) + sum(
            p.bytes * seq // p.shape[0] for p in params if p.path.startswith("pos_embed"))
        _add(out, "all-reduce", tensor, ce + replicated)
    else:
        _add(out, "all-reduce", tensor, reductions + again + whole + ce)
    return out


def context_traffic(config: DecoderConfig, rows: int, seq: int, layers_run: int, context: tuple[str, ...],
                    sizes: dict[str, int], tensor: int, context_attention: str, platform: str = "cpu") -> dict:
    """{(kind, context axes): bytes} of context parallelism's attention for `rows` sequences of
    `seq` tokens split n ways, through `layers_run` layers (`jshard.nn.context_attention`).

    With B = one device's keys (or values): rows · seq/n · kv_heads/tensor · head_dim in the
    compute dtype, the ring sends K and V on n-1 times forward and n-1 times backward, and their
    gradients, in fp32, n times (home again; XLA:GPU sends the last in the compute dtype, moving
    the cast that follows it before it); "gather" all-gathers K and V (n·B each) and
    reduce-scatters their gradients; "a2a" all-to-alls Q, K, V and the output forward (K and V
    with their heads repeated as often as n needs), and their gradients backward, each one
    device's share. Under remat the forward runs again in backward: the gathers and
    all-to-alls once more; the ring's output and log-sum-exp are its backward's residuals, and
    XLA runs its sends once (measured). (A stack of one layer, whose scan XLA unrolls, sends K
    and V n-1 times in all: XLA merges the backward's sends with the forward's; not modelled.)"""
    if not context:
        return {}
    n = shards((context,), sizes)
    kv_heads = getattr(config, "kv_heads", config.heads) // tensor
    block = rows * (seq // n) * kv_heads * config.head_dim  # elements of one device's K (or V)
    itemsize = jnp.dtype(config.dtype).itemsize
    forwards = 2 if config.remat != "none" else 1
    out: dict = {}
    if context_attention == "a2a":
        queries = rows * (seq // n) * config.heads // tensor * config.head_dim
        shares = 2 * queries + 2 * block * (n // math.gcd(kv_heads, n))  # Q, output; K, V repeated
        _add(out, "all-to-all", context, layers_run * (forwards + 1) * shares * itemsize)
    elif context_attention == "gather":
        _add(out, "all-gather", context, layers_run * forwards * 2 * n * block * itemsize)
        _add(out, "reduce-scatter", context, layers_run * 2 * n * block * itemsize)
    else:
        home = itemsize if platform == "gpu" else 4  # the gradients' last send
        sends = 2 * block * (2 * (n - 1) * itemsize + (n - 1) * 4 + home)
        _add(out, "collective-permute", context, layers_run * sends)
    return out


def expert_traffic(config: DecoderConfig, params, rows: int, seq: int, layers_run: int, batch_axes, experts_axes,
                   tensor: tuple[str, ...], sp: bool, ring: int = 0) -> dict:
    """{(kind, axes): bytes} of a mixture of experts (`jshard.moe`) for `rows` local sequences of
    `seq` tokens through `layers_run` blocks, every `moe_every`-th a MoE layer.

    With D = one device's dispatch buffer, rows · experts · C · embed in the compute dtype
    (C = `moe.capacity`, slots per expert per row), expert parallelism all-to-alls D four
    times per layer (to the experts and back, forward and backward), six under remat (the
    forward runs again). The load f_e sums over the batch axes (experts floats, forward).
    Under TP the experts' down projection all-reduces D forward and their gate_up's input
    gradient D backward (again under remat), in place of the dense MLP's A = rows · seq ·
    embed; under SP the MoE gathers whole rows (one all-gather, its transpose one
    reduce-scatter, in place of the dense MLP's two each) and the router, which reads them,
    all-reduces its gradient. Under collective matmuls (`ring`, `tensor_traffic`) the dense
    MLP's gathers and reduce-scatters it replaces were permutes; the MoE's own stay."""
    if not getattr(config, "experts", 0):
        return {}
    layers_run //= config.moe_every  # the MoE layers among them
    itemsize = jnp.dtype(config.dtype).itemsize
    slots = capacity(seq, config.experts, config.top_k, config.capacity_factor)
    buffer = rows * config.experts * slots * config.embed * itemsize
    dense = rows * seq * config.embed * itemsize
    again = config.remat != "none"
    out: dict = {}
    _add(out, "all-to-all", experts_axes, layers_run * (6 if again else 4) * buffer)
    _add(out, "all-reduce", batch_axes, layers_run * config.experts * 4)
    if tensor:
        _add(out, "all-reduce", tensor, layers_run * (3 if again else 2) * buffer)
        if sp and ring:
            _add(out, "collective-permute", tensor, -4 * layers_run * dense * (ring - 1) // ring)
        if sp:
            _add(out, "all-gather", tensor, (1 if ring else -1) * layers_run * dense)
            _add(out, "reduce-scatter", tensor, (1 if ring else -1) * layers_run * dense)
            # (this stage's routers: layers_run of the model's moe_layers)
            routers = sum(p.bytes for p in params if "router" in p.path)
            _add(out, "all-reduce", tensor, routers * layers_run // config.moe_layers)
        else:
            _add(out, "all-reduce", tensor, -2 * layers_run * dense)
    return out


def stage_layers_run(config: DecoderConfig, plan: Plan) -> int:
    """The layers the busiest stage runs: all of them unpipelined, else the most any device's
    chunks hold (`Plan.stage_layers`, uneven where the stages do not divide the layers; chunk
    k = c·p + d is device d's); it sets a pipelined step's pace."""
    if not plan.stage_layers:
        return config.layers
    stages = plan.mesh_sizes[plan.stage_axis]
    return max(sum(plan.stage_layers[d::stages]) for d in range(stages))


def per_pass(plan: Plan, kind: str, axes: str) -> bool:
    """Whether a param collective runs once per forward-backward pass rather than once per step
    under gradient accumulation: ZeRO-3's gathers and reduce-scatters (the weights are gathered
    for each pass; each pass's gradients scattered onto their shards), ZeRO-2's reduce-scatters
    (its gradients are held on their shards). Plain all-reduces and ZeRO-1's reduce-scatter
    reduce the accumulated gradient once; the updated params are gathered once."""
    zero = plan.rules.zero
    return bool(set(axes.split("+")) <= set(plan.zero_axes)) and (zero == 3 or (zero == 2 and kind == "reduce-scatter"))


def computed(config: DecoderConfig, plan: Plan) -> DecoderConfig:
    """`config` with the dtype its layers compute in under `plan`'s step (`nn.compute_dtype`):
    its own, else the step's precision's. The formulas below read `config.dtype` as that."""
    return dataclasses.replace(config, dtype=compute_dtype(config.dtype, plan.compute))


def traffic(config: DecoderConfig, plan: Plan, rows: int, seq: int, platform: str = "cpu", accum: int = 1,
            call_rows: int | None = None) -> dict:
    """{(kind, axes): bytes} per device per step, but the pipeline's sends: params (gradients
    summed over the batch and context axes), TP / SP over `rows` local sequences of this
    device's seq / context tokens through this stage's layers, context parallelism's
    attention, and the loss's all-reduces; as the compiler for `platform` combines them.
    `accum` passes accumulate before the update: what moves per pass moves `accum` times
    (`per_pass`), the gradient reductions after the last pass once. `call_rows`: the rows of one
    call of the model (a pipeline's micro-batch; default `rows`), which decide ZeRO-3's lookup."""
    config = computed(config, plan)
    params, sizes, stage_axis, context = plan.params, plan.mesh_sizes, plan.stage_axis, plan.context_axes
    batch_axes = plan.batch_axes
    # XLA:GPU reassociates reductions of one value's parts (rs(a) + rs(b) -> rs(a + b)): a tied
    # embedding's two gradients (lookup, head), a normed input's gradients from the linears
    # reading it; all-reduces a pipeline's shared params over the batch and stage axes at once,
    # and under SP the final norm's over the batch and tensor axes. XLA:CPU does each separately.
    folded = folded_norms(plan) if platform == "gpu" else frozenset()
    local_seq = seq // shards((context,), sizes)
    lookup = lookup_axes(config, plan, (call_rows or rows) * local_seq)
    comm = param_traffic(plan, remat=config.remat != "none", tied_head=config.tied_head, combined=platform == "gpu",
                         folded=folded, scale_reductions=2 if platform == "gpu" else 1, looked_up=bool(lookup))
    comm = {key: nbytes * (accum if per_pass(plan, *key) else 1) for key, nbytes in comm.items()}
    rows *= accum
    layers_run = stage_layers_run(config, plan)
    sp, tensor = plan.sequence_parallel, plan.tensor_axes
    ring = shards((tensor,), sizes) if plan.rules.collective_matmul and sp else 0
    for key, nbytes in tensor_traffic(config, params, rows, local_seq, layers_run, sp, tensor, platform == "gpu",
                                      folded, ring).items():
        _add(comm, *key, nbytes)
    for key, nbytes in context_traffic(config, rows, seq, layers_run, context, sizes, shards((tensor,), sizes),
                                       plan.rules.context_attention, platform).items():
        _add(comm, *key, nbytes)
    for key, nbytes in lookup_traffic(config, plan, lookup, rows * local_seq).items():
        _add(comm, *key, nbytes)
    for key, nbytes in expert_traffic(config, params, rows, seq, layers_run, tuple(a for a in batch_axes if sizes[a] > 1),
                                      plan.expert_axes, tensor, sp, ring).items():
        _add(comm, *key, nbytes)
    # The mean loss: over the context axes (the loss's own mean, each micro-batch's), the batch
    # axes, then the stages.
    _add(comm, "all-reduce", context, 4 * accum)
    for axes in (a for a in batch_axes if sizes[a] > 1), (stage_axis,) if stage_axis else ():
        _add(comm, "all-reduce", tuple(axes), 4)
    return comm


def sends(schedule) -> tuple[int, int]:
    """Sends forward / backward of the schedule, each of one tick's outputs, in that tick or late
    in the next: the executor's own count (`compile_program`), which skips ticks with none."""
    program = _program(schedule)
    return (int(program.sends_forward.sum() + program.late_forward.sum()),
            int(program.sends_backward.sum() + program.late_backward.sum()))


# --- the estimate -------------------------------------------------------------------------


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


def _link(axes: str, sizes: dict[str, int], hw: Hardware) -> tuple[float, str]:
    """Bandwidth of a mesh axis group: intra-node when its devices and every axis inside it
    (mesh order data, stage, fsdp, context, expert, tensor: tensor innermost) fit in one node."""
    first = min(AXES.index(a) for a in axes.split("+"))
    span = math.prod(sizes[a] for a in AXES[first:])
    return (hw.intra_bw, "intra") if span <= hw.gpus_per_node else (hw.inter_bw, "inter")


def is_moe(config: DecoderConfig) -> bool:
    return bool(getattr(config, "experts", 0))


def _moe_parts(config: DecoderConfig) -> tuple[DecoderConfig, DecoderConfig, int]:
    """(one MoE block, one dense block, blocks per layer of the stack) of a MoE Llama: its
    `moe_every` = n blocks of a stacked layer are n - 1 dense ones and one with the experts."""
    n = getattr(config, "moe_every", 1)
    return dataclasses.replace(config, moe_every=1, layers=1), dataclasses.replace(config, experts=0), n


def slots_per_token(config: DecoderConfig) -> float:
    """A MoE layer's dispatch buffer slots per token, E · C / seq (C = `moe.capacity` of a whole
    row): what the experts compute, filled or not (about capacity factor × top_k; E when dropless)."""
    return config.experts * capacity(config.seq_len, config.experts, config.top_k, config.capacity_factor) / config.seq_len


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
    crossover = ((column_outputs(config) / tensor + (4 * h / tensor if sp else 4 * h)) * itemsize)
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


def estimate(plan: PlanInput) -> dict:
    """Everything `jshard plan` prints, as one JSON-able dict (see the module docstring)."""
    config, hw = plan.model, plan.hardware
    sizes = plan.sizes
    if -1 in sizes.values():
        raise ShardingError(f"Layout.mesh {plan.layout.mesh_text}: the planner has no devices to fill '-1' from. "
                            "Fix: give every axis its size.")
    step = _cached_plan(dataclasses.replace(config, remat="none"),
                        dataclasses.replace(plan.layout, remat=None, micro_batch_size=1))
    step.check_batch(plan.batch_size, config.seq_len, rows_name="PlanInput.batch_size", seq_name="DecoderConfig.seq_len")
    config = computed(config, step)
    rules, schedule, stage_remat, params = step.rules, step.schedule, step.stage_remat, step.params
    batch_axes, data_shards, context, cp = step.batch_axes, step.data_shards, step.context_axes, step.context_shards
    tensor_axes, sp = step.tensor_axes, step.sequence_parallel
    tensor = shards((tensor_axes,), sizes)
    m = plan.microbatches or 1
    # The tokens of one sequence on a device (context parallelism splits it).
    rows = plan.batch_size // step.batch_shards if plan.batch_size else plan.micro_batch_size
    local_seq = config.seq_len // cp
    stages = schedule.stages if schedule else 1
    n_devices = math.prod(sizes.values())
    if step.fp8 and hw.fp8_peak_flops is None:
        raise ShardingError(f"Layout.precision fp8: {hw.name} has no FP8 tensor cores (Hopper and later do). "
                            "Fix: Layout.precision mixed, or PlanInput.hardware h100 / h200.")
    try:
        attention = attention_implementation(config.attention, config.dtype, config.head_dim, hw.platform)
    except ValueError as e:  # cudnn asked of a profile or dtype it cannot run on
        raise ShardingError(f"DecoderConfig.attention {config.attention}: {e}") from None
    flash = attention == "cudnn"
    if cp > 1 and rules.context_attention == "a2a":
        check_all_to_all_heads(config.heads // tensor, cp, context)
    if cp > 1 and rules.context_attention != "a2a":  # attention is jshard's own, not the model's kernel
        # (all-to-all CP runs the model's, on its share of the heads): the ring keeps no scores (each
        # block's are recomputed in its backward); "gather" keeps each local query's scores over
        # the whole sequence, as XLA's kernel does.
        attention, flash = f"{rules.context_attention} (context parallel)", rules.context_attention == "ring"

    # memory
    memory = state_bytes(step, config.layers, hw.platform)
    # AdamW's pass over the state once a step: reads and writes params, master and moments, reads the gradients.
    optimizer_traffic = 2 * (memory["params"] + memory.get("master", 0) + memory["optimizer"]) + memory["grads"]
    if schedule and hw.platform == "cpu":
        # The executor accumulates gradients in the scan's carry: XLA:CPU keeps its input and
        # output buffers apart, XLA:GPU updates it in place (measured).
        memory["grads"] *= 2
    layers_local = stage_layers_run(config, step)
    act = ACTIVATIONS[hw.platform]
    per_token_layer = activation_bytes_per_token_layer(config, tensor, sp, flash, act)
    logits = act.logits * config.vocab / tensor * 4
    if schedule:
        a_mb = rows * local_seq * config.embed * jnp.dtype(config.dtype).itemsize
        chunk_layers = step.layer_slots
        # Each chunk's weights are sliced out of the local stack for the branch that runs it
        # (measured: XLA materialises the slices), so the stack counts once more.
        memory["chunk_weights"] = sum(local(p.bytes, p.param, sizes) for p in params if p.names[:1] == ("layers",))
        # The trade `stage_remat` picks: activation memory against the work of the backward.
        trade = {mode: dict(activations=int(pipeline_activations(
                     _program(schedule, mode), config, chunk_layers, per_token_layer, logits, rows * local_seq,
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
    if cp > 1 and rules.context_attention == "ring":
        # The ring's working set, one tile of queries of one block at a time: over the largest
        # block (its own, local_seq keys), scores, probabilities and their two gradients in fp32,
        # in backward (measured: the compiled temporaries at seq 4096 over 2, 4, 8 devices,
        # examples/context_parallel.py).
        tile = query_tile(local_seq)
        memory["activations"] += RING_BLOCK_FP32 * 4 * rows * config.heads // tensor * tile * local_seq
    if hw.platform == "gpu":  # the larger of backward's peak and the reduction's (above what backward counts)
        memory["reduction"] = max(0, reduction_bytes(step) - memory["grads"] - memory["activations"])
    memory["batch"] = rows * m * plan.grad_accum * (config.seq_len + 1) * 4
    total_memory = sum(memory.values())

    # communication
    stage_axis = step.stage_axis
    comm = traffic(config, step, rows * m, config.seq_len, hw.platform, plan.grad_accum, call_rows=rows)
    if schedule:
        a_mb = rows * local_seq * config.embed * jnp.dtype(config.dtype).itemsize
        forward, backward = sends(schedule)
        _add(comm, "collective-permute", (stage_axis,), (forward + backward) * a_mb * plan.grad_accum)

    # time
    accum = plan.grad_accum
    tokens = rows * config.seq_len * m * data_shards * accum
    flops_model = metrics.flops_per_token(config, config.seq_len) * tokens
    # The FLOPs run count what the experts compute: every slot of the buffer, filled or not,
    # E·C/seq per token where the model FLOPs (and MFU) count top_k.
    flops_base, expert_forward = flops_model, 0.0
    if is_moe(config):
        per_slot = 2 * 3 * config.embed * config.mlp * config.moe_layers * tokens  # the experts' forward, a slot per token
        flops_base += 3 * per_slot * (slots_per_token(config) - config.top_k)
        expert_forward = per_slot * slots_per_token(config)  # what selective remat runs again
    if schedule and stage_remat == "full":  # one more forward: +1/3 of 6N (ZB-H1: one for B, one for W)
        flops_run = flops_base * pipeline_work(schedule, stage_remat)
    elif config.remat == "full":
        flops_run = flops_base * 8 / 6
    elif config.remat == "selective":  # the attention core's forward again: QK^T and PV; and the experts'
        flops_run = flops_base + 4 * config.layers * config.seq_len * config.embed * tokens + expert_forward
    else:
        flops_run = flops_base
    peak = hw.peak_flops * (1 if jnp.dtype(config.dtype) == jnp.bfloat16 else 0.5)
    terms = compute_terms(config, step, hw, rows, local_seq, m * accum, layers_local, tensor, sp, attention,
                          optimizer_traffic, stage_recompute=bool(schedule) and stage_remat == "full")
    t_compute = sum(terms.values())
    times, rows_out = {}, []
    for (kind, axes), nbytes in sorted(comm.items()):
        n = math.prod(sizes[a] for a in axes.split("+"))
        bw, where = _link(axes, sizes, hw)
        count = calls(kind, axes, nbytes, step, layers_local, m * accum, schedule and sum(sends(schedule)) * accum,
                      hw.platform)
        t = count * physics.collective_seconds(kind, nbytes / count, n, where, bw, _nodes(axes, sizes, hw))
        times[(kind, axes)] = t
        rows_out.append(dict(kind=kind, axes=axes, group=n, bytes=int(nbytes), calls=count, link=where, seconds=t))

    def t_of(pred):
        return sum(t for (kind, axes), t in times.items() if pred(kind, axes))

    zero = set(step.zero_axes)
    t_tp = t_of(lambda k, a: a == "+".join(tensor_axes))
    t_zero = t_of(lambda k, a: set(a.split("+")) <= zero and k in ("all-gather", "reduce-scatter"))
    plain = ({a for a in batch_axes if sizes[a] > 1} | set(context)) - zero  # the gradient all-reduce's axes
    t_dp = t_of(lambda k, a: k == "all-reduce" and set(a.split("+")) <= plain) if plain else 0.0
    t_pp = t_of(lambda k, a: a == stage_axis)
    t_cp = t_of(lambda k, a: a == "+".join(context) and k != "all-reduce") if cp > 1 else 0.0
    # ZeRO-3's lookup of the token table (`lookup_axes`): the other all-to-all, over the ZeRO axes
    t_lookup = t_of(lambda k, a: k == "all-to-all" and set(a.split("+")) <= zero and a != "+".join(context)
                    ) if rules.zero == 3 else 0.0
    # All-to-all CP's (`context_attention` "a2a"), like EP's, on the critical path: attention waits for its heads
    t_ep = t_of(lambda k, a: k == "all-to-all" and a != "+".join(context)) - t_lookup
    bubble = schedule.bubble_fraction_of_step if schedule else 0.0
    ratios = {
        "dp": t_dp / (t_compute * 2 / 3) if t_dp else None,  # the gradient all-reduce hides behind backward
        "zero3": t_zero / t_compute if t_zero and rules.zero == 3 else None,
        "tp": t_tp / t_compute if t_tp else None,
        "ep": t_ep / t_compute if t_ep else None,
        "pp": t_pp / t_compute if t_pp else None,
        "cp": context_overlap(config, cp, peak * hw.matmul_efficiency, _link("+".join(context), sizes, hw)[0])
        if cp > 1 and rules.context_attention == "ring" else None,
    }
    # TP sits on the critical path (each block waits for its reduction), and so do EP's
    # all-to-alls (the experts wait for their rows, the rows for the experts' outputs) and the
    # lookup's (the first layer waits for its rows, the table's gradient for theirs); the
    # others overlap compute and show only where they are longer than it.
    # The ring's sends overlap attention only: what the ratio leaves of them is exposed.
    t_cp_exposed = t_cp * max(0.0, 1 - 1 / ratios["cp"]) if t_cp and rules.context_attention == "ring" else t_cp
    # Collective matmuls (`sp-overlap`) take SP's transfers off the critical path, each ring step
    # beside a partial matmul (91% of their bytes in the compiled H100 program, docs/gpu-compile.md).
    t_ring = t_of(lambda k, a: k == "collective-permute" and a == "+".join(tensor_axes)) if rules.collective_matmul else 0.0
    # The optimizer runs once, after the pipeline drains: the bubble stretches the rest.
    step_s = ((t_compute - terms["optimizer"]) / (1 - bubble) + terms["optimizer"] + t_tp - t_ring + t_ep + t_lookup
              + t_cp_exposed + max(0.0, t_dp + t_zero + t_pp + t_ring - t_compute))
    host = None
    if hw.platform == "cpu":
        host = host_work(step, rows_out, schedule.ticks * accum if schedule else 0)
        # XLA:CPU: a layer's recompute (remat) measured to cost the host a quarter to a third of its
        # FLOPs (+8-12% a step for +33% FLOPs at remat full: docs/planning.md): not counted
        host_terms = terms if config.remat == "none" else compute_terms(
            dataclasses.replace(config, remat="none"), step, hw, rows, local_seq, m * accum, layers_local, tensor, sp,
            attention, optimizer_traffic, stage_recompute=bool(schedule) and stage_remat == "full")
        step_s = host_step_seconds(host_terms, host, hw, n_devices)
    mfu = flops_model / (step_s * n_devices * peak)

    warnings = []
    if total_memory > hw.hbm_bytes:
        warnings.append(f"does not fit: {format_bytes(total_memory, 2)} per device > {format_bytes(hw.hbm_bytes, 2)} of HBM")
    if tensor > 1 and _link("+".join(tensor_axes), sizes, hw)[1] == "inter":
        warnings.append(f"TP axis spans nodes: {'+'.join(tensor_axes)}={tensor} > {hw.gpus_per_node} GPUs per node")
    for name, r in ratios.items():
        if r is not None and r > 1:
            warnings.append(f"{name} overlap ratio {r:.2f} > 1: its communication cannot hide behind compute")
    if schedule and m < stages:
        warnings.append(f"m < p: {m} micro-batches for {stages} stages leave most of the pipeline idle")
    experts_axes = step.expert_axes
    if experts_axes and _link("+".join(experts_axes), sizes, hw)[1] == "inter":
        warnings.append(f"EP axis spans nodes: {'+'.join(experts_axes)}={shards((experts_axes,), sizes)}"
                        + (f" (× tensor={tensor} inside it)" if tensor > 1 else "")
                        + f" > {hw.gpus_per_node} GPUs per node: its all-to-alls cross the inter-node links")
    if is_moe(config):
        warnings.append("activations: the mixture of experts' bytes per token are XLA:CPU's, measured on one small "
                        "model (docs/planning.md)")
        if schedule:
            warnings.append("a mixture of experts under a pipeline: its stage buffers use the dense block's "
                            "formulas (ZB-H1's crossover, the recompute); not validated")

    return dict(
        model=dataclasses.asdict(config) | {"kind": config.family, "vocab_rows": config.vocab_rows,
                                            "dtype": jnp.dtype(config.dtype).name,
                                            "params": sum(math.prod(p.shape) for p in params)},
        attention=attention, mesh=dict(sizes), strategy=rules.name, schedule=schedule and type(schedule).__name__,
        stage_remat=stage_remat if schedule else None, stage_remat_trade=trade,
        microbatches=m, micro_batch_size=rows, hardware=dataclasses.asdict(hw),
        tokens_per_step=tokens, in_flight_microbatches=in_flight,
        memory_bytes_per_device=dict(total=int(total_memory), **{k: int(v) for k, v in memory.items()}),
        model_state_bytes=int(sum(memory[k] for k in MODEL_STATE)),
        precision=_precision_line(step),
        moe=_moe_summary(config, params, sizes, experts_axes) if is_moe(config) else None,
        flops_per_step=dict(model=flops_model, run=flops_run),
        fits=total_memory <= hw.hbm_bytes,
        comm_bytes_per_step={k: int(sum(r["bytes"] for r in rows_out if r["kind"] == k)) for k in
                             sorted({r["kind"] for r in rows_out})},
        collectives=rows_out, compute_s=t_compute, compute_terms=terms, host=host, overlap_ratios=ratios, bubble_fraction=bubble,
        predicted_step_s=step_s, predicted_mfu=mfu, warnings=warnings,
    )


def compute_terms(config: DecoderConfig, step: Plan, hw: Hardware, rows: int, seq: int, passes: int, layers: int,
                  tensor: int, sp: bool, attention: str, optimizer_traffic: float, stage_recompute: bool) -> dict:
    """One device's compute in a step, by term (`physics`): `passes` forward-backward passes
    (micro-batches × accumulation) of `rows` rows of `seq` tokens through its `layers` and the
    head, then the optimizer once. On a GPU also the memory-bound work between the GEMMs (bytes
    per element, measured: `ELEMENTWISE_*`), kernel launches and the layers' loops; XLA:CPU
    runs the elementwise work beside its matmuls (measured: none to add)."""
    tokens, gpu = rows * seq, hw.platform == "gpu"
    dtype = "bf16" if jnp.dtype(config.dtype) == jnp.bfloat16 else "f32"
    # remat full (or a pipeline stage's) runs the forward again; selective, attention's core
    forwards = 2.0 if config.remat == "full" or stage_recompute else 1.0
    core_forwards = 2.0 if config.remat != "none" or stage_recompute else 1.0
    moe_layers = config.moe_layers * layers // config.layers if is_moe(config) else 0
    shapes = physics.projections(config, tensor)
    gemms = layers * physics.training_gemms_seconds(shapes[:-2], tokens, "fp8" if step.fp8 else dtype, hw, forwards)
    mlp = physics.training_gemms_seconds(shapes[-2:], tokens, "fp8" if step.fp8 else dtype, hw, forwards)
    gemms += (layers - moe_layers) * mlp
    if moe_layers:  # each slot through an expert's MLP: the tokens' slots, spread over the experts
        gemms += moe_layers * physics.training_gemms_seconds(
            shapes[-2:], math.ceil(tokens * slots_per_token(config)), dtype, hw, forwards)
    gemms += physics.training_gemms_seconds([(config.embed, config.vocab // tensor)], tokens, dtype, hw)  # the head
    if attention == "cudnn":
        core = layers * physics.attention_seconds(config, tokens, config.seq_len, tensor, hw, core_forwards)
    else:  # QK^T and PV per head as batched GEMMs: forward two, backward four
        hd, keys, batch = config.head_dim, config.seq_len, rows * config.heads // tensor
        core = layers * batch * ((core_forwards + 1) * physics.gemm_seconds(seq, keys, hd, dtype, hw)
                                 + (core_forwards + 1) * physics.gemm_seconds(seq, hd, keys, dtype, hw))
    terms = dict(gemms=passes * gemms, attention=passes * core, memory_bound=0.0, launches=0.0, optimizer=0.0)
    if not gpu:  # XLA:CPU runs the elementwise work beside its matmuls; a host's ops: `host_step_seconds`
        return terms
    recompute = forwards if config.remat == "full" or stage_recompute else 1.0
    width = config.embed / (tensor if sp else 1) + config.mlp / tensor
    per_element = jnp.dtype(config.dtype).itemsize / 2
    memory = (hw.elementwise_layer_bytes * per_element * tokens * layers * width * recompute
              + hw.elementwise_logit_bytes * tokens * config.vocab / tensor)  # the loss is fp32 in any compute dtype
    if step.fp8:
        memory += FP8_CAST_BYTES * tokens * layers * fp8_cast_widths(config) / tensor * recompute
    if attention != "cudnn":  # XLA's kernel, or jshard's own under cp: each local query's scores over the sequence
        memory += XLA_SCORE_BYTES * layers * config.heads / tensor * rows * seq * config.seq_len * recompute
    terms["memory_bound"] = passes * memory / hw.hbm_bw
    terms["launches"] = passes * (physics.launch_seconds(layers, hw) + physics.loop_seconds(2 * layers, hw))
    fp8_weights = sum(local(p.elements, p.param, step.mesh_sizes) for p in step.params if p.fp8)
    terms["optimizer"] = (optimizer_traffic + FP8_CAST_BYTES * 2 * fp8_weights * passes) / hw.hbm_bw
    return terms


def scheduled_step_seconds(est: dict, overlapped: dict[tuple[str, str], float]) -> float:
    """The estimate's step with its communication exposed as a compiled program schedules it:
    each collective's time but the share of its bytes a matmul runs beside (`overlapped`:
    {(kind, axes): share}, `aot.GpuProgram.overlapped_share`) added to the compute (stretched
    by the bubble, the optimizer after it), in place of the overlap ratios' guess."""
    terms = est["compute_terms"]
    compute = (est["compute_s"] - terms["optimizer"]) / (1 - est["bubble_fraction"]) + terms["optimizer"]
    return compute + sum(r["seconds"] * (1 - overlapped.get((r["kind"], r["axes"]), 0.0)) for r in est["collectives"])


# AdamW's ops on one param per step (its moments, their corrections, the decay and update).


def host_work(step: Plan, collectives: list[dict], ticks: int) -> dict:
    """What fake CPU devices' program costs their host beyond its FLOPs: a pipeline's ticks, and
    ZeRO-3's gathers and scatters (XLA:CPU's, one a param: `calls`), each counted once per other
    device of its group, whose threads must all reach it on the host's few cores. (TP's and SP's
    collectives, of activations inside a layer, measured to add nothing: docs/planning.md.)"""
    zero = set(step.zero_axes) if step.rules.zero == 3 else set()
    members = sum(c["calls"] * (c["group"] - 1) for c in collectives
                  if c["kind"] in ("all-gather", "reduce-scatter") and set(c["axes"].split("+")) <= zero)
    return dict(ticks=ticks, zero3_member_calls=members)


def host_step_seconds(terms: dict, host: dict, hw: Hardware, devices: int) -> float:
    """A step of fake CPU devices: they share the host's cores, so the host runs every device's
    compute (the step costs their sum; an idle pipeline stage costs nothing: no bubble), plus
    `tick_s` a pipeline tick and `call_s` per ZeRO-3 collective and other member (`host_work`;
    measured: `jshard bench search`)."""
    return devices * sum(terms.values()) + host["ticks"] * hw.tick_s + host["zero3_member_calls"] * hw.call_s


def calls(kind: str, axes: str, nbytes: float, step: Plan, layers: int, passes: int, sends: int | None,
          platform: str = "gpu") -> int:
    """How many collectives of (kind, axes) a step runs, each paying its latency: scalar
    all-reduces one each, a layer's TP, CP and EP ones every pass (forward and backward), ZeRO-3's
    gathers and scatters per layer every pass, the pipeline's sends, and gradient reductions
    combined into `XLA_GPU_COMBINE_BYTES` buffers. XLA:CPU combines none: ZeRO-3 gathers (twice:
    forward, backward) and scatters each param of each layer every pass, and ZeRO-1/2 reduce and
    gather each param once (counted in its programs: docs/planning.md)."""
    group = set(axes.split("+"))
    if kind == "all-reduce" and nbytes < 4096:  # scalars, each its own call: the loss, FP8 scales
        return max(1, int(nbytes // 4))
    if kind == "all-to-all" and group == set(step.context_axes):  # q, k, v and the output's: forward, backward
        return max(1, 8 * layers * passes)
    if kind == "all-to-all" and step.rules.zero == 3 and group <= set(step.zero_axes):  # the lookup's: forward, backward
        return 2 * passes
    if group == set(step.tensor_axes) or group == set(step.context_axes) or kind == "all-to-all":
        return max(1, 4 * layers * passes)
    if step.stage_axis and group == {step.stage_axis} and kind == "collective-permute":
        return max(1, sends or 1)
    if step.rules.zero == 3 and group <= set(step.zero_axes):
        if platform == "cpu":
            stacked = sum(1 for p in step.params if p.names[:1] == ("layers",))
            per_pass = stacked * layers + len(step.params) - stacked
            return max(1, (2 if kind == "all-gather" else 1) * per_pass * passes)
        return max(1, (2 if kind == "all-gather" else 1) * layers * passes)
    if platform == "cpu" and kind in ("all-gather", "reduce-scatter"):
        return len(step.params)
    return max(1, math.ceil(nbytes / XLA_GPU_COMBINE_BYTES))


def _nodes(axes: str, sizes: dict[str, int], hw: Hardware) -> int:
    """The nodes a group of `axes` spans: one inside a node, else its devices and those of the
    axes inside it (`_link`) over `gpus_per_node`, at most one a member."""
    if _link(axes, sizes, hw)[1] == "intra":
        return 1
    first = min(AXES.index(a) for a in axes.split("+"))
    span = math.prod(sizes[a] for a in AXES[first:])
    return min(math.prod(sizes[a] for a in axes.split("+")), math.ceil(span / hw.gpus_per_node))


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


def context_overlap(config: DecoderConfig, cp: int, flops: float, bandwidth: float) -> float:
    """Ring attention's overlap condition: one K/V block's send over one ring step's attention.

    A step after the first computes half a block, (seq/cp) queries × (seq/2cp) keys, per head:
    4 · rows · heads/tensor · head_dim · seq²/(2cp²) FLOPs forward, while K and V of seq/cp
    tokens travel (2 · rows · seq/cp · kv_heads/tensor · head_dim · itemsize bytes). Their ratio:

        t_send / t_block = (cp / seq) · (kv_heads / heads) · itemsize · flops / bandwidth

    rows, head_dim and tensor parallelism cancel; it falls with the sequence, as the attention per byte grows. (In
    backward each step computes 2.5× the FLOPs and sends K, V and their fp32 gradients.)"""
    kv_heads = getattr(config, "kv_heads", config.heads)
    itemsize = jnp.dtype(config.dtype).itemsize
    return cp / config.seq_len * kv_heads / config.heads * itemsize * flops / bandwidth


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


def report(est: dict) -> str:
    mem, model, moe = est["memory_bytes_per_device"], est["model"], est["moe"]
    hw = est["hardware"]
    mesh = " ".join(f"{a}={n}" for a, n in est["mesh"].items())
    lines = [
        f"jshard plan: {model['kind']} {model['layers']} layers, embed {model['embed']}, heads {model['heads']}"
        + (f" ({model['kv_heads']} kv)" if "kv_heads" in model else "") + f", mlp {model['mlp']}, "
        f"vocab {model['vocab']}" + (f" (table padded to {model['vocab_rows']})" if model["vocab_rows"] != model["vocab"] else "")
        + f", seq {model['seq_len']}: {model['params'] / 1e9:.3g} B params"
        + (f" ({moe['active_params'] / 1e9:.3g} B active)" if moe else "") + f", {model['dtype']}, remat {model['remat']}, "
        f"attention {est['attention']}",
        f"  mesh        {mesh} on {hw['name']} ({hw['gpus_per_node']} per node)",
        f"  precision   {est['precision']}",
        f"  strategy    {est['strategy']}" + (f", {est['schedule']} m={est['microbatches']}, stage remat "
                                              f"{est['stage_remat']}" if est["schedule"] else "")
        + f", micro-batch {est['micro_batch_size']} rows, {est['tokens_per_step']} tokens per step",
    ]
    if moe:
        where = (f"over {moe['expert_axes']}: {moe['experts_per_device']} per device" if moe["expert_axes"]
                 else "no expert axis: every device runs all of them")
        factor = "dropless" if moe["capacity_factor"] is None else f"factor {moe['capacity_factor']:g}"
        every = "every block" if moe["moe_every"] == 1 else f"{moe['moe_layers']} of the {model['layers']} blocks"
        lines.append(f"  experts     {moe['experts']} in {every}, top-{moe['top_k']}, capacity {moe['capacity']} slots per "
                     f"expert per row ({factor}): {moe['slots_per_token']:.3g} slots per token run for {moe['top_k']} "
                     f"routed (the experts' FLOPs ×{moe['slots_per_token'] / moe['top_k']:.3g}); {where} "
                     f"({format_bytes(moe['expert_param_bytes_per_device'], 2)} of expert params)")
    lines.append("memory per device")
    for key in ("params", "grads", "master", "optimizer", "accumulated", "gathered", "chunk_weights", "activations",
                "reduction", "batch"):
        if mem.get(key):
            lines.append(f"  {key:<14}{format_bytes(mem[key], 2):>12}")
        if key == "optimizer":
            lines.append(f"  {'(model state)':<14}{format_bytes(est['model_state_bytes'], 2):>12}  = params + grads + master + optimizer")
    lines.append(f"  {'total':<14}{format_bytes(mem['total'], 2):>12}  of {format_bytes(hw['hbm_bytes'], 2)} HBM"
                 + ("" if est["fits"] else "  DOES NOT FIT"))
    if est["stage_remat_trade"]:
        lines.append("  stage remat  " + ";  ".join(
            f"{mode}: activations {format_bytes(t['activations'], 2)}, pipeline work ×{t['work']:.2f}"
            for mode, t in est["stage_remat_trade"].items()) + "  (--stage-remat)")
    lines.append("communication per step (K bytes per device in its calls; time: each call's latency + bytes at the link's bandwidth)")
    for r in est["collectives"]:
        lines.append(f"  {r['kind']:<19}{r['axes']:<12}×{r['group']:<4}{format_bytes(r['bytes'], 2):>12}{r['calls']:>6} calls  "
                     f"{r['link']:<6}{r['seconds'] * 1e3:10.3f} ms")
    ratios = "  ".join(f"{k} {v:.3f}" for k, v in est["overlap_ratios"].items() if v is not None) or "none"
    lines += [
        f"  compute     {est['compute_s'] * 1e3:.3f} ms: "
        + ", ".join(f"{name.replace('_', '-')} {t * 1e3:.3f}" for name, t in est["compute_terms"].items() if t)
        + (f" ({est['flops_per_step']['run'] / est['flops_per_step']['model']:.3f}× the model FLOPs MFU counts)"
           if moe else ""),
        f"  overlap     t_comm/t_compute: {ratios}",
        f"  bubble      {est['bubble_fraction']:.3f}",
        f"  predicted   step {est['predicted_step_s'] * 1e3:.3f} ms, MFU {est['predicted_mfu'] * 100:.1f}%",
    ]
    lines += [f"warning: {w}" for w in est["warnings"]]
    return "\n".join(lines)
