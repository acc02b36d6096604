"""Every strategy as an explicit shard_map step, against one device, and counted from HLO.

Parity (tests/parity.py): loss and gradients of one step, then loss and params over 3 AdamW
steps, equal the single-device reference to 1e-5 relative (Frobenius norm per param).
Counts: the collectives XLA compiled, by kind and bytes, equal the textbook (docs/strategies.md).
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

import jshard
from jshard import hlo
from jshard.models import GPT, DeepMLP, GPTConfig, MLPConfig, gpt_loss, mlp_loss
from jshard.parallel import build_step
from jshard.mesh import format_mesh
import decoders
from meshes import EXPERT_STRATEGIES, STRATEGIES
from parity import (OPTIMIZER, OneDeviceRun, assert_gradients_close, assert_trains_like_one_device,
                    one_device_gradients, recording, train_on_one_device)
from seed import SEED
from traffic import assert_context_bytes_are_the_planners, collective_bytes

PLANS = STRATEGIES + [("dp+zero1+tp", dict(data=2, fsdp=2, tensor=2)), ("dp+zero2+sp", dict(data=2, fsdp=2, tensor=2)),
                      # context parallelism over 2 (and 4, 8: the example meshes), with ZeRO and SP, all-gathering K/V
                      # (dp+cp on data=4, context=2 is left out: dp+cp on context=4 runs its branches, and the
                      # ring over 2 runs in dp+cp+tp)
                      ("fsdp+cp+sp", dict(fsdp=2, context=2, tensor=2)),
                      ("zero2+cp-gather", dict(fsdp=2, context=4)),
                      # all-to-all attention (its ZeRO-3 over fsdp and context, with SP)
                      ("fsdp+cp-a2a+sp", dict(fsdp=2, context=2, tensor=2)),
                      # collective matmuls with ZeRO-3 and context parallelism (dp+tp+sp-overlap: an example mesh)
                      ("fsdp+cp+sp-overlap", dict(fsdp=2, context=2, tensor=2))]
# Expert parallelism over 8, 4 (the example meshes) and 2, with DP, ZeRO-2/3, TP and SP; and a
# mixture of experts without it (every device computes every expert for its rows). (dp+ep on
# data=4, expert=2 is left out: dp+ep on expert=4 runs its branches, and ep=2 is in dp+ep+tp.)
EXPERT_PLANS = [("dp", dict(data=8))] + EXPERT_STRATEGIES + [
    ("zero2+ep", dict(fsdp=2, expert=4)), ("dp+ep+tp+sp", dict(data=2, expert=2, tensor=2)),
    ("dp+ep+tp+sp-overlap", dict(data=2, expert=2, tensor=2))]

MODELS = {
    "mlp": (lambda seed: DeepMLP(MLPConfig(dim=32, layers=3), rngs=nnx.Rngs(seed)), mlp_loss,
            lambda rng: rng.standard_normal((16, 32), dtype=np.float32)),
    **{name: (functools.partial(decoders.make, name), gpt_loss, lambda rng: rng.integers(0, 64, (8, 17)))
       for name in decoders.CONFIGS},
}


@functools.cache
def reference(model_name: str) -> OneDeviceRun:
    """3 AdamW steps on one device, shared by every strategy's case of the model."""
    make, loss_fn, make_batch = MODELS[model_name]
    rng = np.random.default_rng(SEED)
    return train_on_one_device(make(SEED), OPTIMIZER, loss_fn, [make_batch(rng) for _ in range(3)])


# The Llama where it differs from the GPT under a strategy: its grouped KV heads split over
# tensor, ZeRO-3's gathers, sequence parallelism; rotary positions of context parallelism's chunks;
# zero3's lookup of its untied token table without gathering it (`nn.Embed`: the GPT's is its head).
# (fsdp+tp is left out: dp+fsdp+tp+sp runs its branches, ZeRO-3 gathering grouped heads.)
LLAMA_PLANS = ("dp+tp", "zero3", "dp+fsdp+tp+sp", "dp+zero2+sp", "cp", "dp+cp+tp", "fsdp+cp+sp", "dp+tp+sp-overlap")
# The GPT and MLP cases left out: their step and gradients run no jshard branch that the kept
# cases do not (coverage of their lowering), so their compiles would check nothing new.
LEFT_OUT = {
    # The MLP names no `seq`: with sp it lowers to the very programs of dp+tp-mlp and dp+fsdp+tp-mlp.
    ("mlp", "dp+tp+sp"), ("mlp", "dp+tp+sp-overlap"), ("mlp", "dp+fsdp+tp+sp"),
    ("gpt", "fsdp+tp"),  # dp+fsdp+tp-gpt runs its branches
    ("gpt", "dp+fsdp"),  # dp+fsdp+tp-gpt runs its branches, but for the loss over a whole vocab: zero3-gpt's
}
# The MLP has no sequence to split (context parallelism refuses it: test_context.py).
CASES = [(model, preset, sizes) for model in MODELS if model != "moe" for preset, sizes in PLANS
         if (model != "llama" or preset in LLAMA_PLANS) and (model != "mlp" or "cp" not in preset)
         and (model, preset) not in LEFT_OUT] + [("moe", preset, sizes) for preset, sizes in EXPERT_PLANS]


# The fast tier's cases: one per strategy family (also the newest JAX's, on CI's second pass).
FAST = {("gpt", "dp", "data=8"), ("gpt", "zero1", "fsdp=8"), ("gpt", "zero2", "fsdp=8"), ("gpt", "zero3", "fsdp=8"),
        ("gpt", "dp+tp+sp", "data=2,tensor=4"), ("gpt", "dp+cp", "data=2,context=4"), ("moe", "dp+ep", "data=2,expert=4")}
# Context parallelism's cases whose compiled collectives are also counted (test_context.py's check:
# the planner's bytes, the ring's by hand), on the step compiled here anyway.
# zero2+cp-gather: its K/V gathered once, kept for backward though the context axis is a ZeRO axis.
BYTES_COUNTED = {("gpt", "cp", "context=8"), ("llama", "dp+cp+tp", "data=2,context=2,tensor=2"),
                 ("gpt", "fsdp+cp+sp", "fsdp=2,context=2,tensor=2"), ("gpt", "fsdp+cp-a2a+sp", "fsdp=2,context=2,tensor=2"),
                 ("gpt", "zero2+cp-gather", "fsdp=2,context=4")}


def case(model, preset, sizes):
    marks = [pytest.mark.fast, pytest.mark.newest] if (model, preset, format_mesh(sizes)) in FAST else []
    return pytest.param(model, preset, sizes, marks=marks,
                        id=f"{preset}-{model}" + ("" if (preset, sizes) in EXPERT_STRATEGIES or model != "moe"
                                                  else "-" + format_mesh(sizes)))


@pytest.mark.parametrize("model_name, preset, sizes", [case(*c) for c in CASES])
def test_matches_one_device(model_name, preset, sizes):
    """The gradient of the first step, then the losses and state of 3 steps, are one device's; in
    BYTES_COUNTED's cases the step's collectives are the planner's too (counted first: training
    then reuses that compile)."""
    make, loss_fn, _ = MODELS[model_name]
    run = reference(model_name)
    step = build_step(make(SEED), recording(OPTIMIZER), loss_fn, jshard.Layout.of(preset, sizes))
    if (model_name, preset, format_mesh(sizes)) in BYTES_COUNTED:
        assert_context_bytes_are_the_planners(step, decoders.CONFIGS[model_name], run.batches[0], preset, sizes)
    assert_trains_like_one_device(step, run, first_gradient=True)


# -- counted from the compiled step ------------------------------------------------------


def sharded_step(make, loss_fn, preset, sizes, devices=None):
    return build_step(make(), OPTIMIZER, loss_fn, jshard.Layout.of(preset, sizes), jshard.make_mesh(devices=devices, **sizes))


@functools.cache
def counted_step(make, loss_fn, preset, sizes: tuple, devices: tuple | None):
    """One step per program whose collectives tests count: a second count (other filters) reuses its compile."""
    return sharded_step(make, loss_fn, preset, dict(sizes), devices)


def traffic(make, loss_fn, batch, preset, sizes, devices=None, min_bytes=8, inside_loop_of=None) -> dict[str, int]:
    """Bytes per kind the step moves, leaving out scalars (the loss)."""
    step = counted_step(make, loss_fn, preset, tuple(sizes.items()), devices and tuple(devices))
    return collective_bytes(step, batch, min_bytes, inside_loop_of)


def param_bytes(make) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(make())))


MLP_CONFIG = MLPConfig(dim=64, layers=4)


def make_mlp():
    return DeepMLP(MLP_CONFIG, rngs=nnx.Rngs(0))


MLP_BATCH = np.ones((16, MLP_CONFIG.dim), np.float32)


@pytest.mark.parametrize(
    "preset, sizes, expected",
    [
        ("dp", dict(data=8), {"all-reduce": 1}),
        ("zero1", dict(fsdp=8), {"reduce-scatter": 1, "all-gather": 1}),
        ("zero2", dict(fsdp=8), {"reduce-scatter": 1, "all-gather": 1}),
        ("zero3", dict(fsdp=8), {"reduce-scatter": 1, "all-gather": 2}),
    ],
)
@pytest.mark.fast
def test_data_parallel_traffic_is_textbook(preset, sizes, expected):
    """Ψ = param bytes: DP all-reduces Ψ (ring cost 2Ψ); ZeRO-1/2 reduce-scatter Ψ and
    all-gather Ψ; ZeRO-3 all-gathers Ψ twice (forward, backward) and reduce-scatters Ψ."""
    psi = param_bytes(make_mlp)
    assert traffic(make_mlp, mlp_loss, MLP_BATCH, preset, sizes) == {kind: n * psi for kind, n in expected.items()}


def test_zero2_scatters_each_layer_in_the_backward_loop():
    layer_bytes = param_bytes(make_mlp) // MLP_CONFIG.layers
    assert traffic(make_mlp, mlp_loss, MLP_BATCH, "zero2", dict(fsdp=8), inside_loop_of=MLP_CONFIG.layers) == {
        "reduce-scatter": MLP_CONFIG.layers * layer_bytes}


def test_lecture_mlp_tensor_parallel_gathers_each_layer():
    """The lecture's TP: each layer's output all-gathered (forward), reduce-scattered (backward)."""
    activation = MLP_BATCH.nbytes
    assert traffic(make_mlp, mlp_loss, MLP_BATCH, "tp", dict(tensor=8)) == {"all-gather": MLP_CONFIG.layers * activation, "reduce-scatter": MLP_CONFIG.layers * activation}


GPT_CONFIG = GPTConfig(vocab=64, seq_len=16, embed=32, heads=4, mlp=64, layers=2)
GPT_BATCH = np.ones((8, 17), np.int32)


def make_gpt():
    return GPT(GPT_CONFIG, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "preset, expected",
    [
        ("tp", {"all-reduce": 4}),  # per block: attention and MLP, forward and backward
        ("tp+sp", {"all-gather": 4, "reduce-scatter": 4}),  # each all-reduce as a pair
    ],
)
def test_tensor_parallel_block_traffic_is_textbook(preset, expected):
    activation = GPT_BATCH.shape[0] * (GPT_BATCH.shape[1] - 1) * GPT_CONFIG.embed * 4  # (batch, seq, embed) f32
    per_layer = traffic(make_gpt, gpt_loss, GPT_BATCH, preset, dict(tensor=4), devices=jax.devices()[:4],
                        min_bytes=activation - 1, inside_loop_of=GPT_CONFIG.layers)
    assert per_layer == {kind: n * activation * GPT_CONFIG.layers for kind, n in expected.items()}


@pytest.mark.parametrize("preset, sizes, in_loop", [
    ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2), True),  # beside the next layer's backward
    ("dp+fsdp", dict(data=2, fsdp=4), False),  # after the backward: XLA:GPU hides the scatters there
])
def test_zero3_sums_layer_gradients_over_data_in_the_backward_loop_under_tensor_parallelism(preset, sizes, in_loop):
    """HSDP's data-parallel all-reduce: under tensor parallelism each stacked layer's weight
    gradient is summed over `data` inside the layer loop, once a layer, its block's bytes; the
    weights outside the stack (embedding, head, final norm) after the backward."""
    step = counted_step(make_gpt, gpt_loss, preset, tuple(sizes.items()), None)
    lowered = step.lower(step.state, step.shard_batch(GPT_BATCH))
    summed = {}
    for c in hlo.collectives(lowered.compile().as_text(), lowered.as_text()):
        if c.kind == "all-reduce" and c.bytes > 8 and hlo.group_axes(c.line, sizes) == ("data",):
            where = "loop" if c.count == GPT_CONFIG.layers else "after"
            summed[where] = summed.get(where, 0) + c.bytes * c.count
    stacked = sum(p.placement.bytes_per_device for p in step.plan.params if p.placement.names[0] == "layers")
    others = sum(p.placement.bytes_per_device for p in step.plan.params if p.placement.names[0] != "layers")
    assert summed == ({"loop": stacked, "after": others} if in_loop else {"after": stacked + others})


def test_collective_matmul_sends_sequence_parallels_bytes_as_permutes():
    """tp+sp-overlap: each of SP's 4 gathers and 4 reduce-scatters a block is n - 1 = 3 permutes
    of a quarter of the activation: 6 activations a block (tp+sp's 8 × (n - 1) / n), and no
    gather or reduce-scatter left in the layer loop."""
    activation = GPT_BATCH.shape[0] * (GPT_BATCH.shape[1] - 1) * GPT_CONFIG.embed * 4
    per_layer = traffic(make_gpt, gpt_loss, GPT_BATCH, "tp+sp-overlap", dict(tensor=4), devices=jax.devices()[:4],
                        min_bytes=activation // 4 - 1, inside_loop_of=GPT_CONFIG.layers)
    assert per_layer == {"collective-permute": 6 * activation * GPT_CONFIG.layers}


def test_memory_falls_with_each_zero_stage():
    """Per device: DP > ZeRO-1 > ZeRO-2 > ZeRO-3, and ZeRO-3 within 10% of its textbook size."""
    config = MLPConfig(dim=256, layers=8)
    batch = np.ones((16, config.dim), np.float32)

    def make():
        return DeepMLP(config, rngs=nnx.Rngs(0))

    def per_device(preset, sizes):
        step = sharded_step(make, mlp_loss, preset, sizes)
        memory = step.lower(step.state, step.shard_batch(batch)).compile().memory_analysis()
        return memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes + memory.temp_size_in_bytes

    sizes = [per_device("dp", dict(data=8))] + [per_device(f"zero{s}", dict(fsdp=8)) for s in (1, 2, 3)]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4, sizes
    psi, layer, n = param_bytes(make), config.dim**2 * 4, 8
    # params, grads and Adam's two moments split 8 ways; two gathered layers alive at once
    # (one in use, the next being gathered); each layer's saved input and pre-activation.
    activations = config.layers * 2 * (batch.shape[0] // n) * config.dim * 4
    textbook = 4 * psi / n + 2 * layer + activations
    assert abs(sizes[3] - textbook) <= 0.1 * textbook, (sizes[3], textbook)


@pytest.mark.slow
def test_bench_strategies_rows(tmp_path):
    from jshard.cli import main

    out = tmp_path / "rows.json"
    argv = ["bench", "strategies", "--strategies", "zero3@fsdp=8;dp+tp", "--layers", "2", "--embed", "32", "--mlp", "128",
            "--seq-len", "8", "--batch-size", "8", "--repeats", "1", "--json", str(out)]
    assert main(argv) == 0
    rows = __import__("json").loads(out.read_text())
    assert [r["strategy"] for r in rows] == ["zero3", "dp+tp"]
    for row in rows:
        assert set(row) == {"strategy", "mesh", "comm_bytes", "textbook_bytes", "comm_ratio", "memory_bytes_per_device",
                            "textbook_memory_bytes", "parity_rel_err", "step_s", "xla_comm_bytes",
                            "xla_parity_rel_err", "gspmd_step_s", "speed_ratio"}
        assert row["parity_rel_err"] < 1e-5 and row["comm_bytes"] == row["textbook_bytes"] and row["comm_ratio"] == 1.0
        assert row["xla_parity_rel_err"] < 1e-5 and row["xla_comm_bytes"] > 0  # the compiler-placed step


def test_bench_strategies_default_leaves_out_what_the_model_cannot_run():
    """No flags: every preset without a pipeline, and without expert parallelism for a model
    without experts (it would stop at its first ep row)."""
    from jshard.bench.strategies import strategies

    dense = [p for p, _ in strategies(None, 8, experts=False)]
    assert dense and not any("ep" in p.split("+") or "pp" in p.split("+") for p in dense)
    assert {"ep", "dp+ep"} <= {p for p, _ in strategies(None, 8, experts=True)}


class UserMLP(nnx.Module):
    """A user's own module: jshard.nn layers, its own loss; params named via the layers."""

    def __init__(self, rngs: nnx.Rngs):
        self.up = jshard.nn.Linear(16, 64, in_names="embed", out_names="mlp", rngs=rngs)
        self.down = jshard.nn.Linear(64, 16, in_names="mlp", out_names="embed", rngs=rngs)
        self.norm = jshard.nn.LayerNorm(16)

    def __call__(self, x):
        return self.down(jax.nn.relu(self.up(self.norm(x), ("batch", "embed"))), ("batch", "mlp"))


def user_loss(model, batch):
    x, y = batch
    return ((model(x) - y) ** 2).mean()


@pytest.mark.parametrize("preset", ["dp+zero2+tp", "dp+fsdp+tp"])
def test_user_module_matches_one_device(preset):
    rng = np.random.default_rng(SEED)
    batch = (rng.standard_normal((16, 16), dtype=np.float32), rng.standard_normal((16, 16), dtype=np.float32))
    step = build_step(UserMLP(nnx.Rngs(SEED)), OPTIMIZER, user_loss,
                      jshard.Layout.of(preset, dict(data=2, fsdp=2, tensor=2)))
    assert_gradients_close(step, batch, *one_device_gradients(UserMLP(nnx.Rngs(SEED)), user_loss, batch))


@pytest.mark.fast
def test_batch_not_divisible_by_batch_shards():
    step = build_step(make_mlp(), OPTIMIZER, mlp_loss, jshard.Layout.of("dp", dict(data=8)))
    with pytest.raises(jshard.ShardingError, match=r"batch size 12 does not split over 8 batch shards \(data\) = 8"):
        step.shard_batch(np.ones((12, MLP_CONFIG.dim), np.float32))


def test_train_refuses_bad_strategies_before_placing(capsys):
    from jshard.cli import main

    assert main(["train", "--strategy", "dp", "--mesh", "data=2,stage=4"]) == 2
    captured = capsys.readouterr()
    assert "mesh axis 'stage' has size 4, but no rule" in captured.err and "per device" not in captured.out


# -- gradient accumulation inside the step ---------------------------------------------------

# (preset, sizes, grad_accum, collectives): one case per family; each micro-batch is one row per
# batch shard. ZeRO-1 beside DP and TP on one mesh; a pipeline (2 micro-batches of its own per
# accumulated one); the compiler-placed step.
ACCUMULATED = [("dp", dict(data=8), 2, "explicit"), ("dp+zero1+tp", dict(data=2, fsdp=2, tensor=2), 4, "explicit"),
               ("zero2", dict(fsdp=8), 2, "explicit"), ("zero3", dict(fsdp=8), 2, "explicit"),
               ("dp+pp", dict(data=4, stage=2), 2, "explicit"), ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2), 4, "compiler")]
ACCUMULATED_TOLERANCE = 1e-6  # fp32: a sum over micro-batches in another order than one device's


@functools.cache
def whole_batches() -> OneDeviceRun:
    """2 AdamW steps on one device, each on a whole batch of 16 rows: what accumulating its micro-batches must give."""
    rng = np.random.default_rng(SEED)
    return train_on_one_device(decoders.make("gpt", SEED), OPTIMIZER, gpt_loss,
                               [rng.integers(0, 64, (16, 17)) for _ in range(2)])


@pytest.mark.parametrize("preset, sizes, grad_accum, collectives",
                         [pytest.param(*c, id=f"{c[0]}-{c[3]}-x{c[2]}", marks=[pytest.mark.fast] * (c[0] == "dp"))
                          for c in ACCUMULATED])
def test_accumulated_micro_batches_train_like_the_whole_batch_on_one_device(preset, sizes, grad_accum, collectives):
    step = build_step(decoders.make("gpt", SEED), OPTIMIZER, gpt_loss,
                      jshard.Layout.of(preset, sizes, microbatches=2 if "stage" in sizes else None,
                                       grad_accum=grad_accum), collectives=collectives)
    assert_trains_like_one_device(step, whole_batches(), f"{preset} grad_accum={grad_accum}", ACCUMULATED_TOLERANCE)


@pytest.mark.parametrize("preset, sizes, expected", [
    ("dp", dict(data=8), {"all-reduce": 1}),  # once per step, on the sum
    ("zero1", dict(fsdp=8), {"reduce-scatter": 1, "all-gather": 1}),  # once per step, on the sum
    ("zero2", dict(fsdp=8), {"reduce-scatter": 4, "all-gather": 1}),  # per micro-batch, onto the sharded sum
    ("zero3", dict(fsdp=8), {"reduce-scatter": 4, "all-gather": 8}),  # per micro-batch, onto the sharded sum
])
def test_accumulation_reduces_what_its_strategy_says_when(preset, sizes, expected):
    """grad_accum=4, in Ψ (param bytes): DP and ZeRO-1 reduce once per step, as without
    accumulation; ZeRO-2 and ZeRO-3 reduce-scatter per micro-batch (ZeRO-3 gathers forward and
    backward per micro-batch too); the update's all-gather once."""
    batch = np.ones((32, MLP_CONFIG.dim), np.float32)  # 4 rows per batch shard: micro-batches of 1
    step = build_step(make_mlp(), OPTIMIZER, mlp_loss, jshard.Layout.of(preset, sizes, grad_accum=4))
    psi = param_bytes(make_mlp)
    assert collective_bytes(step, batch, min_bytes=8) == {kind: n * psi for kind, n in expected.items()}
    if preset == "dp":  # the bytes of the step without accumulation (counted once in the traffic tests)
        assert traffic(make_mlp, mlp_loss, MLP_BATCH, preset, sizes) == {"all-reduce": psi}
