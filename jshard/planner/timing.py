"""The step's time on one device: its compute by term (`compute_terms`: the GEMMs, attention,
the memory-bound work between them, launches, the optimizer; `physics`), the ring's overlap
condition (`context_overlap`), what fake CPU devices cost their shared host (`host_work`,
`host_step_seconds`), and `step_time`: compute, the bubble and the communication the overlap
leaves exposed, as a step time and MFU.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp

from jshard import metrics
from jshard.models import DecoderConfig
from jshard.parallel.tick_program import work as pipeline_work
from jshard.parallel.step_plan import Plan
from jshard.planner import physics
from jshard.planner.planned_step import PlannedStep, local
from jshard.planner.counts import fp8_cast_widths, is_moe, slots_per_token
from jshard.planner.hardware import Hardware, link
from jshard.planner.lockstep import accumulate_bytes, lockstep, moved_bytes
from jshard.planner.memory import state_bytes


# XLA's attention (not cuDNN's fused kernel) computes the seq × seq scores in HBM: masking,
# softmax and their gradients in fp32. Bytes per score element (one query, key, head and layer):
# a step with XLA's attention less the rest of its prediction (its QK^T and PV as batched GEMMs
# on the sweep), over its scores, at the streaming bandwidth: 25 (Llama-3.2-1B), 19 (GPT-1B),
# measured on one H100 with `nn.xla_attention` (docs/results/gpu-check-h100-jax0.11.2-2026-11-26-
# softmax.json), their mean.
XLA_SCORE_BYTES = 22
# FP8 (`nn.fp8`): each cast reads its bf16 operand twice (its max, then the cast) and writes one
# byte: activations and gradients per token (`counts.fp8_cast_widths`), the weights forward and
# again in backward. Counted from the bytes, not fitted (docs/planning.md).
FP8_CAST_BYTES = 5


PHASES = ("F", "B", "W")  # a forward; backward's input gradient; its weights' gradient
TERMS = ("gemms", "attention", "memory_bound", "launches")


def phase_terms(config: DecoderConfig, step: Plan, hw: Hardware, rows: int, seq: int, layers: int, tensor: int,
                sp: bool, fused: bool) -> dict[str, dict[str, dict[str, float]]]:
    """One micro-batch of `rows` rows of `seq` tokens through one device's pieces of the model,
    in seconds, by piece ("layers": `layers` layers of the stack; "head": the head and the loss),
    phase (`PHASES`) and term (`TERMS`; `physics`). The forward the model's remat runs again is
    backward's (B's). On a GPU also the memory-bound work between the GEMMs (bytes per element,
    measured: `ELEMENTWISE_*`; a forward moves a third of a layer's, its backward reads what the
    forward wrote and the output's gradient and writes the input's: the rest), kernel launches
    and the layers' loops; XLA:CPU runs the elementwise work beside its matmuls (measured: none
    to add)."""
    tokens, gpu = rows * seq, hw.platform == "gpu"
    dtype = "bf16" if jnp.dtype(config.dtype) == jnp.bfloat16 else "f32"
    gemm_dtype = "fp8" if step.fp8 else dtype
    # remat full runs the forward again; selective, attention's core
    forwards = 2.0 if config.remat == "full" else 1.0
    core_forwards = 2.0 if config.remat != "none" else 1.0
    moe_layers = config.moe_layers * layers // config.layers if is_moe(config) else 0
    shapes = physics.projections(config, tensor)
    zero = dict.fromkeys(TERMS, 0.0)
    pieces = {piece: {phase: dict(zero) for phase in PHASES} for piece in ("layers", "head")}
    stack, head = pieces["layers"], pieces["head"]

    def projections(into, shapes, tokens, dtype, times, forwards=1.0):  # each forward, and backward's two GEMMs
        for k, n in shapes:
            into["F"]["gemms"] += times * physics.gemm_seconds(tokens, n, k, dtype, hw)
            into["B"]["gemms"] += times * ((forwards - 1) * physics.gemm_seconds(tokens, n, k, dtype, hw)
                                           + physics.gemm_seconds(tokens, k, n, dtype, hw))
            into["W"]["gemms"] += times * physics.gemm_seconds(k, n, tokens, dtype, hw)

    projections(stack, shapes[:-2], tokens, gemm_dtype, layers, forwards)
    projections(stack, shapes[-2:], tokens, gemm_dtype, layers - moe_layers, forwards)
    if moe_layers:  # each slot through an expert's MLP: the tokens' slots, spread over the experts
        projections(stack, shapes[-2:], math.ceil(tokens * slots_per_token(config)), dtype, moe_layers, forwards)
    projections(head, [(config.embed, config.vocab // tensor)], tokens, dtype, 1)
    if fused:  # a flash kernel (cuDNN's; jshard's Pallas kernel under cp, unmeasured: charged as cuDNN's)
        core = layers * physics.attention_seconds(config, tokens, config.seq_len, tensor, hw, forwards=1.0) / 3
        stack["F"]["attention"], stack["B"]["attention"] = core, (core_forwards + 1) * core
    else:  # QK^T and PV per head as batched GEMMs: forward two, backward four
        hd, keys, batch = config.head_dim, config.seq_len, rows * config.heads // tensor
        core = layers * batch * (physics.gemm_seconds(seq, keys, hd, dtype, hw)
                                 + physics.gemm_seconds(seq, hd, keys, dtype, hw))
        stack["F"]["attention"], stack["B"]["attention"] = core, core_forwards * core
    if not gpu:  # XLA:CPU runs the elementwise work beside its matmuls; a host's ops: `host_step_seconds`
        return pieces
    recompute = forwards  # (the fitted bytes: a layer's twice under remat full)
    width = config.embed / (tensor if sp else 1) + config.mlp / tensor
    per_element = jnp.dtype(config.dtype).itemsize / 2
    memory = hw.elementwise_layer_bytes * per_element * tokens * layers * width
    if step.fp8:
        memory += FP8_CAST_BYTES * tokens * layers * fp8_cast_widths(config) / tensor
    if not fused:  # XLA's kernel, or XLA's blocks under cp: each local query's scores over the sequence
        memory += XLA_SCORE_BYTES * layers * config.heads / tensor * rows * seq * config.seq_len
    stack["F"]["memory_bound"] = memory / 3 / hw.stream_bw
    stack["B"]["memory_bound"] = (recompute - 1 / 3) * memory / hw.stream_bw
    logits = hw.elementwise_logit_bytes * tokens * config.vocab / tensor / hw.stream_bw  # (fp32 in any compute dtype)
    head["F"]["memory_bound"], head["B"]["memory_bound"] = logits / 3, 2 * logits / 3
    launches = physics.launch_seconds(layers, hw)
    stack["F"]["launches"] = launches / 3 + physics.loop_seconds(layers, hw)
    stack["B"]["launches"] = 2 * launches / 3 + physics.loop_seconds(layers, hw)
    return pieces


def compute_terms(config: DecoderConfig, step: Plan, hw: Hardware, rows: int, seq: int, passes: int, layers: int,
                  tensor: int, sp: bool, fused: bool, optimizer_traffic: float, stage_recompute: bool) -> dict:
    """One device's compute in a step, by term: `passes` forward-backward passes (micro-batches ×
    accumulation) through its `layers` and the head (`phase_terms`; a pipeline stage that
    recomputes its chunk, its layers' forward once more), then the optimizer once (AdamW's pass
    over the state, and FP8's casts of the weights each pass)."""
    pieces = phase_terms(config, step, hw, rows, seq, layers, tensor, sp, fused)
    runs = {("layers", "F"): 2.0 if stage_recompute else 1.0}
    terms = {term: passes * sum(runs.get((piece, phase), 1.0) * pieces[piece][phase][term]
                                for piece in pieces for phase in PHASES) for term in TERMS}
    terms["optimizer"] = 0.0
    if hw.platform == "gpu":
        fp8_weights = sum(local(p.elements, p.param, step.mesh_sizes) for p in step.params if p.fp8)
        terms["optimizer"] = (optimizer_traffic + FP8_CAST_BYTES * 2 * fp8_weights * passes) / hw.stream_bw
    return terms


def host_work(planned: PlannedStep, collectives: list[dict], activations: float) -> dict:
    """What fake CPU devices' program costs their host beyond its FLOPs, counted over every
    device: its collectives' calls (each a rendezvous of its group's device threads on the host's
    few cores; ZeRO-3's one a param, XLA:CPU combining none), its pipeline ticks (every device runs
    each tick of the table, once for each accumulated micro-batch group), and its `activations`
    (bytes a device holds, `memory.memory_per_device`) as long as the host takes to move them
    beyond what it would in its caches (`Hardware.spill_seconds`)."""
    schedule, hw = planned.step.schedule, planned.hw
    devices = math.prod(planned.sizes.values())
    return dict(calls=devices * sum(c["calls"] for c in collectives),
                ticks=devices * len(schedule.table()) * planned.grad_accum if schedule else 0,
                activation_spill_s=devices * hw.spill_seconds(activations))


def host_step_seconds(terms: dict, recompute: float, host: dict, hw: Hardware, devices: int) -> dict[str, float]:
    """A step of fake CPU devices, by part: they share the host's cores, so the host runs every
    device's compute (the step costs their sum; an idle pipeline stage costs nothing: no bubble),
    `recompute_share` of what its recomputed FLOPs (remat's and a pipeline stage's: `recompute`
    seconds a device) would take,
    `call_s` a device's call of a collective, `tick_s` a device's tick and `activation_traffic`
    times its activations' spill (`host_work`; measured: `jshard bench search`, fitted:
    `bench.fit.fit_host`)."""
    return {"compute": devices * sum(terms.values()), "recompute": devices * recompute * hw.recompute_share,
            "collective_calls": host["calls"] * hw.call_s, "pipeline_ticks": host["ticks"] * hw.tick_s,
            "activations": host["activation_spill_s"] * hw.activation_traffic}


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


def adamw_traffic(state: dict[str, int]) -> int:
    """AdamW's pass over the state once a step (`memory.state_bytes`, as held): reads and writes
    params, master and moments, reads the gradients."""
    return 2 * (state["params"] + state.get("master", 0) + state["optimizer"]) + state["grads"]


def step_time(planned: PlannedStep, collectives: list[dict], activations: float) -> dict:
    """The step's FLOPs, compute (`compute_terms`), overlap ratios, bubble and predicted time and
    MFU, with `collectives` (`communication.communication`) exposed where they do not hide behind
    compute; on fake CPU devices, the host's time (`host_step_seconds`, with the `activations` a
    device holds)."""
    config, hw, step, sizes = planned.config, planned.hw, planned.step, planned.sizes
    rules, schedule, stage_remat = step.rules, step.schedule, step.stage_remat
    batch_axes, data_shards, context, cp = step.batch_axes, step.data_shards, step.context_axes, step.context_shards
    tensor_axes, sp, tensor, stage_axis = step.tensor_axes, step.sequence_parallel, planned.tensor, step.stage_axis
    rows, local_seq, m, accum = planned.rows, planned.local_seq, planned.microbatches, planned.grad_accum
    layers_local, fused = planned.layers_local, planned.fused
    n_devices = math.prod(sizes.values())
    optimizer_traffic = adamw_traffic(state_bytes(step, config.layers, hw.platform, config.remat))
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
    terms = compute_terms(config, step, hw, rows, local_seq, m * accum, layers_local, tensor, sp, fused,
                          optimizer_traffic, stage_recompute=bool(schedule) and stage_remat == "full")
    t_compute = sum(terms.values())
    times = {(r["kind"], r["axes"]): r["seconds"] for r in collectives}

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
        "cp": context_overlap(config, cp, peak * hw.matmul_efficiency, link("+".join(context), sizes, hw)[0])
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
    critical = t_tp - t_ring + t_ep + t_lookup + t_cp_exposed
    if schedule and hw.platform == "gpu":  # the tick table as the executor runs it: in lockstep (`lockstep`)
        sends = next((r for r in collectives if r["kind"] == "collective-permute" and r["axes"] == stage_axis), None)
        chunk = functools.cache(lambda n: phase_terms(config, step, hw, rows, local_seq, n, tensor, sp, fused))
        ticks = lockstep(schedule, step.stage_layers, stage_remat, chunk,
                         tuple(b / hw.stream_bw for b in accumulate_bytes(step)),
                         sends["seconds"] / sends["calls"] if sends else 0.0, hw,
                         scale=1 + critical / (t_compute - terms["optimizer"]), moved=moved_bytes(planned))
        pipelined = accum * ticks.seconds
        terms = {term: accum * t for term, t in ticks.terms.items()} | {"optimizer": terms["optimizer"]}
        t_compute, bubble = sum(terms.values()), ticks.bubble
        # Within the ticks ZeRO-3's gathers and scatters and the collective matmuls' rings hide behind
        # the actions; the reductions of the accumulated gradients (DP's all-reduce, ZeRO-1/2's
        # scatter and gather) follow the last tick, beside the optimizer only.
        inside = t_ring + (t_zero if rules.zero == 3 else 0.0)
        after = t_dp + (t_zero if rules.zero < 3 else 0.0)
        step_s = (pipelined + terms["optimizer"] + max(0.0, inside - pipelined)
                  + max(0.0, after - terms["optimizer"]))
    else:  # (fake CPU devices' pipelines too: replaced by the host's time below)
        # The optimizer runs once, after the pipeline drains: the bubble stretches the rest.
        step_s = ((t_compute - terms["optimizer"]) / (1 - bubble) + terms["optimizer"] + critical
                  + max(0.0, t_dp + t_zero + t_pp + t_ring - t_compute))
    host = None
    if hw.platform == "cpu":
        host = host_work(planned, collectives, activations)
        # XLA:CPU runs a recompute (remat's, a pipeline stage's) beside work the host waits on
        # anyway: it costs a share of its FLOPs' time (`Hardware.recompute_share`)
        recomputes = config.remat != "none" or (bool(schedule) and stage_remat == "full")
        host_terms = compute_terms(dataclasses.replace(config, remat="none"), step, hw, rows, local_seq, m * accum,
                                   layers_local, tensor, sp, fused, optimizer_traffic, stage_recompute=False
                                   ) if recomputes else terms
        recompute = sum(terms.values()) - sum(host_terms.values())
        host["seconds"] = host_step_seconds(host_terms, recompute, host, hw, n_devices)
        step_s = sum(host["seconds"].values())
    mfu = flops_model / (step_s * n_devices * peak)
    return dict(tokens_per_step=tokens, flops_per_step=dict(model=flops_model, run=flops_run), compute_s=t_compute,
                compute_terms=terms, host=host, overlap_ratios=ratios, bubble_fraction=bubble, predicted_step_s=step_s,
                predicted_mfu=mfu)
