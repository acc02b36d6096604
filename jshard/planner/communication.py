"""Communication per device: the bytes of each collective kind over each group of mesh axes in a
step (K, as `jshard/hlo.py` counts them), as the compiler for the platform combines them: the
gradients' and weights' (`param_traffic`), TP and SP's (`tensor_traffic`), context
parallelism's (`context_traffic`), a mixture of experts' (`expert_traffic`), ZeRO-3's lookup
(`lookup_traffic`) and the pipeline's sends (`sends`); `traffic` sums them. `communication` gives
each one's calls (`calls`) and time at the bandwidth of the link its group falls on.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jshard.mesh import STANDARD_AXES as AXES
from jshard.models import DecoderConfig
from jshard.moe import capacity
from jshard.parallel.step_plan import Plan
from jshard.planner import physics
from jshard.planner.planned_step import PlannedStep, cached_program, computed, shards, stage_layers_run
from jshard.planner.counts import input_projections
from jshard.planner.hardware import link, nodes
from jshard.planner.memory import XLA_GPU_COMBINE_BYTES


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
    return frozenset(p.path for p in plan.params if "norm" in p.path and not p.stacked
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
    (XLA:GPU's collective pipeliner computes the next layer's once more, for its early gather;
    remat's forward in the backward loop as many times again).
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
            again = p.stacked_kernel or (p.stacked and (remat or p.path.endswith("norm/scale")))
            _add(out, "all-gather", in_mesh_order(in_param), size * (2 if again else 1))
            scattered = p.scattered_bytes // shards(p.param, sizes, skip=in_param)
            _add(out, "reduce-scatter", in_mesh_order(in_param), scattered * (2 if tied else 1))
            if p.fp8:  # its e4m3 shards share one scale, the max of theirs: a float32 all-reduce a layer
                layers = p.shape[0] if p.stacked else 1
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
    all-to-alls once more; the ring's sends too on GPUs, but for the first, which XLA shares
    with the backward's ring (there each later send waits for the block before it,
    `nn.context_parallel`, so the two rings differ from there); on a CPU, where the sends are
    not so ordered, XLA merges the two rings (measured). (A stack of one layer, whose scan XLA
    unrolls, sends K and V n-1 times in all: XLA merges the backward's sends with the forward's;
    not modelled.)"""
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
        if platform == "gpu" and config.remat != "none":  # the recomputed forward's, but the first
            sends += 2 * block * (n - 2) * itemsize
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


def per_pass(plan: Plan, kind: str, axes: str) -> bool:
    """Whether a param collective runs once per forward-backward pass rather than once per step
    under gradient accumulation: ZeRO-3's gathers and reduce-scatters (the weights are gathered
    for each pass; each pass's gradients scattered onto their shards), ZeRO-2's reduce-scatters
    (its gradients are held on their shards). Plain all-reduces and ZeRO-1's reduce-scatter
    reduce the accumulated gradient once; the updated params are gathered once."""
    zero = plan.rules.zero
    return bool(set(axes.split("+")) <= set(plan.zero_axes)) and (zero == 3 or (zero == 2 and kind == "reduce-scatter"))


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
    remat = config.remat != "none"
    # An FP8 kernel's scale: once a layer (XLA:GPU's pipeliner once more, for its early gather),
    # and all of that again where remat runs the layer's forward again in the backward loop
    # (measured: XLA:CPU 1 and 2, XLA:GPU 2 and 4)
    comm = param_traffic(plan, remat=remat, tied_head=config.tied_head, combined=platform == "gpu", folded=folded,
                         scale_reductions=(2 if platform == "gpu" else 1) * (1 + remat), looked_up=bool(lookup))
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
    program = cached_program(schedule)
    return (int(program.sends_forward.sum() + program.late_forward.sum()),
            int(program.sends_backward.sum() + program.late_backward.sum()))


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
            stacked = sum(1 for p in step.params if p.stacked)
            per_pass = stacked * layers + len(step.params) - stacked
            return max(1, (2 if kind == "all-gather" else 1) * per_pass * passes)
        return max(1, (2 if kind == "all-gather" else 1) * layers * passes)
    if platform == "cpu" and kind in ("all-gather", "reduce-scatter"):
        return len(step.params)
    return max(1, math.ceil(nbytes / XLA_GPU_COMBINE_BYTES))


def communication(planned: PlannedStep) -> list[dict]:
    """Each collective of the step (`traffic`, and the pipeline's sends) as one row: its kind,
    axes, group size, bytes per device, calls (`calls`), the link its group falls on, and its
    time there (`physics.collective_seconds`), in order of kind and axes."""
    config, hw, step, sizes = planned.config, planned.hw, planned.step, planned.sizes
    schedule, rows, m, accum = step.schedule, planned.rows, planned.microbatches, planned.grad_accum
    comm = traffic(config, step, rows * m, config.seq_len, hw.platform, accum, call_rows=rows)
    if schedule:
        a_mb = rows * planned.local_seq * config.embed * jnp.dtype(config.dtype).itemsize
        forward, backward = sends(schedule)
        _add(comm, "collective-permute", (step.stage_axis,), (forward + backward) * a_mb * accum)
    collectives = []
    for (kind, axes), nbytes in sorted(comm.items()):
        n = math.prod(sizes[a] for a in axes.split("+"))
        bw, where = link(axes, sizes, hw)
        count = calls(kind, axes, nbytes, step, planned.layers_local, m * accum,
                      schedule and sum(sends(schedule)) * accum, hw.platform)
        t = count * physics.collective_seconds(kind, nbytes / count, n, where, bw, nodes(axes, sizes, hw))
        collectives.append(dict(kind=kind, axes=axes, group=n, bytes=int(nbytes), calls=count, link=where, seconds=t))
    return collectives
