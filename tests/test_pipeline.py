"""The pipeline executor, every schedule: against the unpipelined single-device reference,
alone and with FSDP, TP and SP on the other axes; its buffers and sends counted; bad input."""

import functools
import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import jshard
from jshard import hlo
from jshard.models import DeepMLP, MLPConfig, gpt_loss, mlp_loss
from jshard.parallel import build_step
from jshard.parallel import pipelining, tick_branches
from jshard.parallel.pipelining import SEND_SCOPES
from jshard.parallel.tick_program import compile_program
from jshard.planner.hardware import HARDWARE
from jshard.planner.schedule import timeline
from jshard.parallel.schedules import SCHEDULES, ScheduleError, make_schedule
import decoders
from parity import (OPTIMIZER, TOLERANCE, assert_gradients_close, assert_trains_like_one_device,
                    one_device_gradients, recording, train_on_one_device)
from seed import SEED

MLP_CONFIG = MLPConfig(dim=32, layers=8)


def assert_matches_one_device(make, loss_fn, batch, preset, sizes, microbatches, schedule, steps=0):
    """Loss and gradients of the pipelined step equal one device's; then `steps` AdamW steps (the
    gradient then read off the first: one program, `parity.recording`)."""
    layout = jshard.Layout.of(preset, sizes, microbatches=microbatches, schedule=schedule)
    if steps:
        step = build_step(make(), recording(OPTIMIZER), loss_fn, layout)
        assert_trains_like_one_device(step, train_on_one_device(make(), OPTIMIZER, loss_fn, [batch] * steps),
                                      first_gradient=True)
    else:
        step = build_step(make(), OPTIMIZER, loss_fn, layout)
        assert_gradients_close(step, batch, *one_device_gradients(make(), loss_fn, batch))


@pytest.mark.parametrize("schedule, stages, per_stage", [
    pytest.param(schedule, stages, per_stage, id=f"{per_stage}-{stages}-{schedule}",
                 marks=[pytest.mark.fast] * ((schedule, stages, per_stage) == ("1f1b", 2, 4)))  # the fast tier's
    for per_stage in (1, 4) for stages in (2, 4) for schedule in SCHEDULES])
def test_schedule_mlp(schedule, stages, per_stage):
    microbatches = per_stage * stages  # m in {p, 4p}
    batch = np.random.default_rng(SEED).standard_normal((8 * microbatches, MLP_CONFIG.dim), dtype=np.float32)
    # Gradients on every schedule; the update after them is schedule-independent, so 2 steps of
    # it on one schedule for each stage count.
    steps = 2 if per_stage == 1 and schedule == "1f1b" else 0
    assert_matches_one_device(lambda: DeepMLP(MLP_CONFIG, rngs=nnx.Rngs(SEED)), mlp_loss, batch, "dp+pp",
                              dict(data=8 // stages, stage=stages), microbatches, schedule, steps)


PIPELINED = [
    ("fsdp+tp+pp", dict(fsdp=2, tensor=2, stage=2), 2),  # ZeRO-3 × TP × PP on one 2×2×2 mesh
    ("dp+tp+sp+pp", dict(data=2, tensor=2, stage=2), 4),
    ("zero2+pp", dict(fsdp=4, stage=2), 2),
]
# The GPT on every schedule under ZeRO-3 × TP × PP, every preset under 1F1B, and each
# zero-bubble schedule under what its split backward most touches (ZeRO-2's per-layer scatter,
# interleaved chunks of sequence-parallel blocks); the Llama with context parallelism in its
# stages. (The Llama under ZeRO-3 × TP × PP is left out: what differs between the decoders is
# inside a stage, not the schedule, and its GQA under ZeRO-3 × TP is test_strategies'.)
_GPT = {(s, "fsdp+tp+pp") for s in SCHEDULES} | {("1f1b", p) for p, *_ in PIPELINED} | {
    ("zb-h1", "zero2+pp"), ("interleaved", "dp+tp+sp+pp")}
CASES = [("gpt", schedule, *case) for schedule in SCHEDULES for case in PIPELINED if (schedule, case[0]) in _GPT] + [
    # context parallelism inside the stages (all-gathered K/V or all-to-all heads: a ring's sends cannot run in
    # one stage's tick)
    ("llama", "zb-h1", "dp+cp-gather+pp", dict(data=2, context=2, stage=2), 2),
    ("llama", "gpipe", "dp+cp-a2a+pp", dict(data=2, context=2, stage=2), 2)]


@pytest.mark.parametrize("model, schedule, preset, sizes, microbatches", CASES,
                         ids=[f"{m}-{s}-{p}" for m, s, p, *_ in CASES])
def test_schedule_decoder_with_other_strategies(model, schedule, preset, sizes, microbatches):
    batch = np.random.default_rng(SEED).integers(0, decoders.CONFIGS[model].vocab, (16, 17))
    make = functools.partial(decoders.make, model, SEED, layers=4)
    steps = 1 if schedule == "1f1b" else 0  # the update itself is schedule-independent: one is enough
    assert_matches_one_device(make, gpt_loss, batch, preset, sizes, microbatches, schedule, steps)


# Uneven stages: layers that stages × virtual does not divide, on every schedule (interleaved
# where its chunks have a layer each): 6 layers on 4 stages run (1, 2, 2, 1), 7 on 2 (4, 3).
UNEVEN = [(6, 4, s, None) for s in ("gpipe", "1f1b", "zb-h1")] + [
    (7, 2, s, None) for s in ("gpipe", "1f1b", "zb-h1")] + [(7, 2, "interleaved", 2)]


@functools.cache
def uneven_step(layers, stages, schedule, virtual):
    """DeepMLP(32, `layers`) under dp+pp at m = p, and its state's abstract values (for `lower`:
    the parity test's call donates `.state`), so the FLOPs test shares its compilation."""
    model = DeepMLP(MLPConfig(dim=MLP_CONFIG.dim, layers=layers), rngs=nnx.Rngs(SEED))
    step = build_step(model, OPTIMIZER, mlp_loss,
                      jshard.Layout.of("dp+pp", dict(data=8 // stages, stage=stages), microbatches=stages,
                                       schedule=schedule, virtual=virtual))
    return step, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), step.state)


def uneven_batch(stages):
    return np.random.default_rng(SEED).standard_normal((8 * stages, MLP_CONFIG.dim), dtype=np.float32)


@pytest.mark.parametrize("layers, stages, schedule, virtual", UNEVEN, ids=[f"{n}-on-{p}-{s}" for n, p, s, _ in UNEVEN])
def test_uneven_stages_train_like_one_device(layers, stages, schedule, virtual):
    """Losses and params after 2 AdamW steps equal one device's; the step holds the stack padded
    to equal chunks, and the padding stays zero (params and optimizer state: no gradient reaches
    it); what it hands out has exactly the model's layers, and its conversions are exact."""
    step, _ = uneven_step(layers, stages, schedule, virtual)
    make = lambda: DeepMLP(MLPConfig(dim=MLP_CONFIG.dim, layers=layers), rngs=nnx.Rngs(SEED))  # noqa: E731
    assert sum(p.elements for p in step.plan.params) == sum(x.size for x in jax.tree.leaves(nnx.state(make())))
    state = assert_trains_like_one_device(step, train_on_one_device(make(), OPTIMIZER, mlp_loss, [uneven_batch(stages)] * 2),
                                          f"{layers} layers on {stages} stages, {schedule}")
    slots = pipelining.held_slots(step.plan.stage_layers, stages, step.schedule.virtual)
    held = [x for x in jax.tree.leaves((state.params, state.opt_state)) if np.ndim(x) and x.shape[0] == len(slots)]
    assert held and all(not np.asarray(x)[slots < 0].any() for x in held)
    portable = step.to_model_order(state)  # what a checkpoint holds
    assert all(x.shape[0] == layers for x in jax.tree.leaves(portable.params))
    for have, want in zip(jax.tree.leaves(step.from_model_order(portable)), jax.tree.leaves(state)):
        np.testing.assert_array_equal(have, want)
        assert have.sharding == want.sharding


def test_uneven_stages_skip_their_padding():
    """A padding row costs no FLOPs: per stage, the compiled step's matmuls follow its layers
    (4 and 3 on 2 stages, each holding 4 rows), counted from the program's conditionals."""
    step, state = uneven_step(7, 2, "1f1b", None)
    text = step.lower(state, step.shard_batch(uneven_batch(2))).compile().as_text()
    flops = tick_branches.matmul_flops(step.schedule, text, step.stage_remat, step.plan.stage_layers)
    assert step.plan.stage_layers == (4, 3) and step.plan.layer_slots == 4
    assert flops[0] / flops[1] == pytest.approx(4 / 3, rel=1e-9)


@functools.cache
def mlp_step(schedule, stages, microbatches, dim=MLP_CONFIG.dim, stage_remat=None):
    """DeepMLP(dim, 8 layers) under dp+pp. One step object per program, so that the tests lowering
    the same one (the flops and the sends of each schedule) share its compilation: JAX keeps a
    jitted function's lowering and executable. Only lowered or differentiated, never called (a
    call would donate its `.state`)."""
    model = DeepMLP(MLPConfig(dim=dim, layers=8), rngs=nnx.Rngs(0))
    return build_step(model, OPTIMIZER, mlp_loss,
                      jshard.Layout.of("dp+pp", dict(data=8 // stages, stage=stages), microbatches=microbatches,
                                       schedule=schedule, stage_remat=stage_remat))


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_stage_recompute_matches_one_device(schedule):
    """stage_remat="full" (keep the stage input, recompute the chunk's forward in backward)."""
    batch = np.random.default_rng(SEED).standard_normal((8 * 4, MLP_CONFIG.dim), dtype=np.float32)
    step = mlp_step(schedule, 2, 4, stage_remat="full")
    assert_gradients_close(step, batch, *one_device_gradients(DeepMLP(MLP_CONFIG, rngs=nnx.Rngs(0)), mlp_loss, batch))


def _flops(step, batch):
    """Matmul FLOPs per device of the compiled step: the pipeline's per stage, averaged."""
    text = step.lower(step.state, step.shard_batch(batch)).compile().as_text()
    if step.schedule is None:
        return hlo.matmul_flops(text)
    return float(np.mean(tick_branches.matmul_flops(step.schedule, text, step.stage_remat)))


def test_flops_of_every_schedule():
    """Counted from the compiled programs: keeping the residuals, every schedule does the
    unpipelined step's matmuls (ZB-H1's B + W split the backward, adding nothing); recomputing
    the stage's forward adds a third; ZB-H1 recomputing for B and for W, two thirds."""
    stages, microbatches = 2, 4
    batch = np.ones((8 * microbatches, MLP_CONFIG.dim), np.float32)
    flat = build_step(DeepMLP(MLP_CONFIG, rngs=nnx.Rngs(0)), OPTIMIZER, mlp_loss, jshard.Layout.of("dp", dict(data=8)))
    # Per device the same work: 1/8 of the rows through every layer, or 1/4 through half of them.
    unpipelined = _flops(flat, batch)
    for schedule in SCHEDULES:
        kept = _flops(mlp_step(schedule, stages, microbatches), batch) / unpipelined
        recomputed = _flops(mlp_step(schedule, stages, microbatches, stage_remat="full"), batch) / unpipelined
        assert kept == pytest.approx(1.0, abs=1e-9), schedule
        assert recomputed == pytest.approx(5 / 3 if schedule == "zb-h1" else 4 / 3, rel=1e-9), schedule


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sends_one_activation_per_tick_only_when_needed(schedule):
    """Each ppermute carries one micro-batch's activation: forward and backward, each in the
    tick that computed it or, where no stage reads it in the next tick, late, in that next tick
    (beside its compute). Every forward that feeds another stage is sent exactly once."""
    stages, microbatches = 2, 4
    step = mlp_step(schedule, stages, microbatches)
    batch = np.ones((8 * microbatches, MLP_CONFIG.dim), np.float32)
    compiled = step.lower(step.state, step.shard_batch(batch)).compile()
    permutes = [c for c in hlo.collectives(compiled.as_text()) if c.kind == "collective-permute"]
    activation = batch.shape[0] // (8 // stages) // microbatches * MLP_CONFIG.dim * 4
    program, s = compile_program(step.schedule), step.schedule
    lates = int(program.late_forward.any()) + int(program.late_backward.any())
    assert [c.bytes for c in permutes] == [activation] * (2 + lates)
    sent = program.sends_forward | np.append(program.late_forward[1:], False)  # a late send, in the tick it left
    assert not (program.sends_forward & np.append(program.late_forward[1:], False)).any()
    for tick, row in enumerate(s.table()):  # a send, exactly where a non-final forward ran
        forwards = [a for stage, a in enumerate(row) if a and a.kind == "F" and s.work(a, stage)[2] < stages * s.virtual - 1]
        assert sent[tick] == bool(forwards)
    # Read with the tick table (each send's cond found by its scope in the compiled program), a
    # permute runs on the ticks that send, counted and timed alike; without it, on every tick.
    ticks = tick_branches.TickBranches.of(s)
    sends = sum(int(getattr(program, flag).sum()) for flag in SEND_SCOPES if getattr(program, flag).any())
    weighted = [c for c in hlo.collectives(compiled.as_text(), branch_weights=ticks.weights) if c.kind == "collective-permute"]
    assert sum(c.count for c in weighted) == pytest.approx(sends) and sum(c.count for c in permutes) == len(permutes) * s.ticks
    timed = timeline(compiled.as_text(), dict(data=8 // stages, stage=stages), HARDWARE["h100"], ticks)
    assert sum(r.executions for r in timed.collectives.values() if r.kind == "collective-permute") == sends


def _shapes_in(text: str, scope: str, op: str, dtype: str) -> list[tuple[int, ...]]:
    """The result shapes of the HLO instructions `op` of `dtype` traced in `scope` (their op_name)."""
    found = []
    for line in text.splitlines():
        m = hlo.INSTRUCTION.match(line)
        if m and m["op"] == op and f"/{scope}/" in line and m["type"].startswith(f"{dtype}["):
            found.append(hlo.dims_of(m["type"][len(dtype) + 1:m["type"].index("]")]))
    return found


def test_a_backward_adds_only_the_gradients_it_computed():
    """A backward adds into the step's gradient sums what it computed: an interleaved chunk its
    rows of the layer stack (the SPMD program's gradient of the rest is zeros, and adding them
    read and wrote the whole stack each backward), the params outside the stack only at the first
    and last positions, in a cond the tick table decides (`tick_branches`: each stage's backwards
    are half at an end, half in the middle, on 2 stages of 2 chunks)."""
    step = mlp_step("interleaved", 2, 4)  # 8 layers: 4 rows of the stack a device, 2 a chunk
    text = step.lower(step.state, step.shard_batch(np.ones((32, MLP_CONFIG.dim), np.float32))).compile().as_text()
    sums = _shapes_in(text, "pipeline_BW", "add", "f32")
    assert sums and {dims[0] for dims in sums if len(dims) == 3} == {2}, sums
    gpt = build_step(decoders.make("gpt", SEED, layers=4), OPTIMIZER, gpt_loss,
                     jshard.Layout.of("dp+pp", dict(data=4, stage=2), microbatches=2, schedule="interleaved"))
    batch = np.zeros((16, decoders.CONFIGS["gpt"].seq_len + 1), np.int32)
    text = gpt.lower(gpt.state, gpt.shard_batch(batch)).compile().as_text()
    ticks = tick_branches.TickBranches.of(gpt.schedule)
    ends = [line for line in text.splitlines() if ticks.chooses(line) == ("ends", "BW")]
    assert ends and all(ticks.weights(line, stage).tolist() == [0.5, 0.5] for line in ends for stage in (0, 1))


def test_late_sends_wait_for_no_compute():
    """Where the tick table allows (ZB-H1's input gradients mostly wait for a W), a tick's sends
    go out in the next tick, and the compiled loop body's late collective-permutes read only the
    loop's carry: nothing of that tick's compute, so a GPU runs them beside it."""
    s = make_schedule("zb-h1", 4, 16)
    program = compile_program(s)
    assert program.late_backward.sum() == 35 and program.sends_backward.sum() == 10  # of 45 backward sends
    step = mlp_step("zb-h1", 2, 8)
    text = step.lower(step.state, step.shard_batch(np.ones((64, MLP_CONFIG.dim), np.float32))).compile().as_text()
    waits = hlo.permutes_waiting_for_matmuls(text)
    assert waits.count(False) == 2 and waits.count(True) == 2  # late ones: forward and backward


# ZB-H1 with sp in its stages, the bench's GPT and Llama: on XLA:CPU (jax 0.10.2 and 0.12.0.1) the
# GPT's step with its collectives unordered (`Plan.collectives_ordered` False, a GPU's) deadlocked
# in a collective's rendezvous in its first steps in every run, its devices waiting on different
# collectives (an all-gather over `tensor` inside an action, the stage axis' permute); XLA then
# aborts the process, so each runs in one of its own.
DEADLOCKED = """
import sys, dataclasses
import jshard
jshard.use_fake_cpu_devices(8)
import jax, numpy as np, optax
from flax import nnx
from jshard.models import SIZES, decoder, gpt_loss
from jshard.parallel import build_step
config = dataclasses.replace(SIZES[sys.argv[1]], remat="selective")
step = build_step(decoder(config, nnx.Rngs(0)), optax.adamw(1e-3), gpt_loss,
                  jshard.Layout.parse("dp+sp+pp data=2,stage=2,tensor=2 schedule=zb-h1 m=8"))
assert step.plan.collectives_ordered
batch = step.shard_batch(np.random.default_rng(0).integers(0, config.vocab, (16, config.seq_len + 1)))
state = step.state
for _ in range(12):
    state, loss = step(state, batch)
    jax.block_until_ready((state, loss))
print("trained", float(loss))
"""


@pytest.mark.parametrize("model", ["small", "llama-small"])
def test_a_zero_bubble_step_with_sp_runs_on_fake_cpu_devices(model):
    """On XLA:CPU each tick's collectives run in one order (`pipelining._after`): the program that
    deadlocked unordered trains its 12 steps."""
    run = subprocess.run([sys.executable, "-c", DEADLOCKED, model], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "trained" in run.stdout, run.stderr[-2000:]


def test_collectives_ordered_or_not_train_alike():
    """The tick's collectives ordered by data (fake CPU devices) or left to XLA (a GPU's way) give
    the same loss and gradients, where XLA:CPU runs both (a zero-bubble MLP: residual and
    crossover slots, late sends)."""
    step = mlp_step("zb-h1", 2, 8)
    assert step.plan.collectives_ordered  # fake CPU devices
    batch = np.random.default_rng(SEED).standard_normal((64, MLP_CONFIG.dim), dtype=np.float32)
    reference = one_device_gradients(DeepMLP(MLPConfig(dim=MLP_CONFIG.dim, layers=8), rngs=nnx.Rngs(0)), mlp_loss, batch)
    assert_gradients_close(step, batch, *reference)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(step.plan), "collectives_ordered", property(lambda plan: False))
        unordered = mlp_step.__wrapped__("zb-h1", 2, 8)
        assert not unordered.plan.collectives_ordered
        assert_gradients_close(unordered, batch, *reference)


@pytest.mark.fast
@pytest.mark.parametrize("done", [np.float32(np.nan), np.float32(np.inf), np.float32(-3.0)])
def test_a_value_made_to_wait_is_unchanged(done):
    """`pipelining._after` adds a zero read from what it waits for: the value is the same whatever
    that holds (a NaN or an infinity too)."""
    value = np.arange(4, dtype=np.float32)
    got = jax.jit(pipelining._after)(value, {"a": np.full(3, done)})
    np.testing.assert_array_equal(got, value)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_buffers_sized_by_peak_in_flight(schedule):
    """Activation slots hold a stage input from its arrival to its last backward: never more
    than the schedule keeps in flight (position 0 recomputes its input from the batch)."""
    for stages, microbatches in [(2, 8), (4, 16)]:
        s = make_schedule(schedule, stages, microbatches)
        assert 1 <= compile_program(s).act_slots <= s.peak_in_flight()


def test_one_f_one_b_needs_less_memory_than_gpipe():
    """At m = 4p, GPipe holds m stage inputs per device and 1F1B p: recomputing the stage, the
    compiled step's temporary memory differs by the buffer slots saved, one activation each. Keeping the residuals, 1F1B's memory does not grow with m, GPipe's does."""
    stages, microbatches, dim = 2, 8, 256
    batch = np.ones(((8 // stages) * microbatches * 64, dim), np.float32)  # 64 rows per micro-batch and device
    temp, slots = {}, {}
    for schedule in ("gpipe", "1f1b"):
        step = mlp_step(schedule, stages, microbatches, dim, stage_remat="full")
        compiled = step.lower(step.state, step.shard_batch(batch)).compile()
        temp[schedule] = compiled.memory_analysis().temp_size_in_bytes
        program = compile_program(step.schedule, "full")
        slots[schedule] = program.act_slots + program.grad_slots
    activation = 64 * dim * 4
    assert slots["gpipe"] - slots["1f1b"] == microbatches - stages
    # (XLA keeps a few scalars more for one schedule than the other: 72 B here, under 1 KiB.)
    assert abs(temp["gpipe"] - temp["1f1b"] - (slots["gpipe"] - slots["1f1b"]) * activation) < 1024

    def kept(schedule, m):  # the same micro-batch (64 rows per device), m of them
        step = mlp_step(schedule, stages, m, dim)
        rows = np.ones(((8 // stages) * m * 64, dim), np.float32)
        return step.lower(step.state, step.shard_batch(rows)).compile().memory_analysis().temp_size_in_bytes

    assert abs(kept("1f1b", 4) - kept("1f1b", 16)) < 1024  # flat: what grows is a few per-tick scalars (192 B)
    assert kept("gpipe", 16) > kept("gpipe", 4)


@pytest.mark.parametrize("schedule", ["interleaved", "1f1b"])
def test_model_comes_back_in_model_order(schedule):
    """The interleaved step stores chunks d, p+d, ... on device d; what it hands out is in model order."""
    make = lambda: DeepMLP(MLPConfig(dim=8, layers=8), rngs=nnx.Rngs(3))  # noqa: E731
    step = build_step(make(), OPTIMIZER, mlp_loss,
                      jshard.Layout.of("dp+pp", dict(data=4, stage=2), microbatches=4, schedule=schedule))
    expected = dict(nnx.to_flat_state(nnx.state(make())))
    for path, param in nnx.to_flat_state(nnx.state(step.model(step.state))):
        np.testing.assert_array_equal(param.get_value(), expected[path].get_value(), err_msg=str(path))
    portable = step.to_model_order(step.state)  # what a checkpoint holds
    for path, param in nnx.to_flat_state(portable.params):
        np.testing.assert_array_equal(param.get_value(), expected[path].get_value(), err_msg=str(path))
    back = step.from_model_order(portable)
    for have, want in zip(jax.tree.leaves(back), jax.tree.leaves(step.state)):
        np.testing.assert_array_equal(have, want)
        assert have.sharding == want.sharding


def make_mlp():
    return DeepMLP(MLP_CONFIG, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "preset, sizes, loss_fn, microbatches, fragment",
    [
        ("dp+pp", dict(data=2, stage=4), mlp_loss, None, r"needs Layout.microbatches.*Fix: Layout.microbatches=4"),
        ("dp+pp", dict(data=2, stage=4), lambda m, b: mlp_loss(m, b), 4, "StagedLoss"),
        ("dp", dict(data=8), mlp_loss, 4, "no pipeline to feed"),
    ],
)
def test_bad_pipeline_input(preset, sizes, loss_fn, microbatches, fragment):
    model = DeepMLP(MLPConfig(dim=32, layers=8), rngs=nnx.Rngs(0))
    with pytest.raises(jshard.ShardingError, match=fragment):
        build_step(model, OPTIMIZER, loss_fn, jshard.Layout.of(preset, sizes, microbatches=microbatches))


@pytest.mark.parametrize("preset, sizes, stage_remat, fragment", [
    ("dp+pp", dict(data=2, stage=4), "half", r"stage_remat='half'. Fix: 'none' .* or 'full'"),
    ("dp", dict(data=8), "full", "stage_remat='full' but rules 'dp' put no layers on a stage axis"),
])
def test_bad_stage_remat(preset, sizes, stage_remat, fragment):
    with pytest.raises(jshard.ShardingError, match=fragment):
        build_step(make_mlp(), OPTIMIZER, mlp_loss,
                   jshard.Layout.of(preset, sizes, microbatches=4 if "pp" in preset else None,
                                    stage_remat=stage_remat))


def test_batch_not_divisible_by_microbatches():
    step = build_step(make_mlp(), OPTIMIZER, mlp_loss, jshard.Layout.of("dp+pp", dict(data=2, stage=4), microbatches=4))
    with pytest.raises(jshard.ShardingError, match=r"batch size 12 does not split over 2 batch shards \(data\) × 4 pipeline micro-batches = 8"):
        step.shard_batch(np.ones((12, MLP_CONFIG.dim), np.float32))


@pytest.mark.parametrize(
    "layers, sizes, microbatches, schedule, virtual, fragment",
    [
        (8, dict(data=2, stage=4), 2, "zb-h1", None, r"m >= p.*got m=2 with p=4"),
        (8, dict(data=2, stage=4), 2, "interleaved", None, r"m >= p"),
        (8, dict(data=2, stage=4), 4, "interleaved", 3, r"8 layers on stages=4 x virtual=3 = 12 model chunks: a "
                                                           r"chunk needs at least one layer. Fix: stages x virtual at most 8"),
        (6, dict(stage=8), 8, "1f1b", None, r"6 layers on stages=8 x virtual=1 = 8 model chunks"),
        (8, dict(data=2, stage=4), 4, "1f1b", 2, "virtual=2 applies to the interleaved schedule only"),
        (8, dict(data=2, stage=4), 4, "pipedream", None, "unknown schedule 'pipedream'"),
    ],
)
def test_bad_schedule_input(layers, sizes, microbatches, schedule, virtual, fragment):
    """Each refused before any device work, with the sizes and a fix."""
    model = DeepMLP(MLPConfig(dim=32, layers=layers), rngs=nnx.Rngs(0))
    with pytest.raises(ScheduleError, match=fragment):
        build_step(model, OPTIMIZER, mlp_loss,
                   jshard.Layout.of("dp+pp", sizes, microbatches=microbatches, schedule=schedule, virtual=virtual))


def test_schedule_without_pipeline():
    with pytest.raises(jshard.ShardingError, match="schedule='1f1b' but rules 'dp'.*no pipeline to feed"):
        build_step(make_mlp(), OPTIMIZER, mlp_loss, jshard.Layout.of("dp", dict(data=8), schedule="1f1b"))


@pytest.mark.slow
def test_bench_pipeline_rows(tmp_path):
    from jshard.cli import main

    out = tmp_path / "rows.json"
    argv = ["bench", "pipeline", "--layers", "2", "--embed", "32", "--mlp", "128", "--batch-size", "16", "--seq-len", "16",
            "--microbatches", "2", "--repeats", "1", "--schedules", "1f1b,zb-h1", "--json", str(out)]
    assert main(argv) == 0
    rows = json.loads(out.read_text())
    assert [r["schedule"] for r in rows] == ["1f1b", "zb-h1"]
    for row in rows:
        program = compile_program(make_schedule(row["schedule"], 2, 2))
        assert row["slots"] == program.act_slots + program.grad_slots
        assert row["parity_rel_err"] <= TOLERANCE and row["temp_bytes"] > 0 and row["step_s"] > 0
