"""The planner against the compiler: predicted per-device memory within 10% of
compiled.memory_analysis(), predicted collective bytes equal to the compiled HLO's; and its
plans of a mixture of experts (Mixtral 8x7B)."""

import dataclasses
import json

import jax.numpy as jnp
import pytest

from jshard.layout import Layout
from jshard import moe
from jshard import planner
from jshard.rules import ShardingError
from jshard.planner import physics
from jshard.cli import main
from jshard.models import GPT_SIZES, SIZES
from jshard.parallel.schedules import make_schedule


# The GPT on every validation row; the Llama (whose every row `jshard plan --validate` prints,
# docs/planning.md) on one per kind of formula: DP, ZeRO-3's gathers, TP+SP with and without
# remat, a pipeline, mixed precision, FP8, context parallelism (grouped KV heads round the ring);
# the mixture of experts on every MoE row (ep on each of its example meshes, and under remat).
LLAMA_ROWS = {("dp", None, None, "none"), ("zero3", None, None, "none"), ("dp+tp+sp", None, None, "none"),
              ("dp+tp+sp", None, None, "full"), ("dp+tp+sp-overlap", None, None, "none"), ("dp+pp", 4, "1f1b", "none"),
              ("zero3", None, None, "none", "example", "mixed"), ("zero3", None, None, "none", "example", "fp8"),
              ("zero3", None, None, "full", "example", "fp8"),
              ("dp+cp+tp", None, None, "none", "example", "fp32", None, 8)}
CASES = ([(case, "gpt") for case in planner.VALIDATION] + [(case, "llama") for case in planner.VALIDATION if case in LLAMA_ROWS]
         + [(case, "moe") for case in planner.MOE_VALIDATION])


@pytest.mark.parametrize("case, model", CASES, ids=["/".join(map(str, c)) + f"-{m}" for c, m in CASES])
def test_estimate_matches_compiler(case, model):
    r = planner.validate_one(*case, model=planner.VALIDATION_MODELS[model])
    assert r["comm_predicted"] == r["comm_compiled"]  # bytes per collective kind: exact
    assert abs(r["memory_rel_err"]) <= planner.MEMORY_TOLERANCE, r


# (ZeRO-3 is left out: XLA:CPU hoists the gathers of the weights outside the layer stack out of
# the accumulation loop, once a step where the planner charges each micro-batch, as XLA:GPU runs
# them: `test_gpu_compile.py`'s accumulating 8B.)
@pytest.mark.parametrize("strategy", ["dp", "zero2"])
def test_accumulated_gradients_are_planned(strategy):
    """Accumulating 2 micro-batches holds their gradients' sum (ZeRO-2: each device's shard) in
    the reduction dtype beside one micro-batch's activations: memory within 10% of the
    compiler's (dp without the sum: 15% under), bytes exact."""
    r = planner.validate_one(strategy, None, None, "none", grad_accum=2)
    assert r["comm_predicted"] == r["comm_compiled"] and abs(r["memory_rel_err"]) <= planner.MEMORY_TOLERANCE, r


@pytest.mark.fast
def test_plan_cli_json_and_warnings(tmp_path, capsys):
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", "llama-3.1-70b", "--kv-heads", "16", "--mesh", "stage=4,tensor=16", "--strategy", "tp+pp",
            "--schedule", "1f1b", "--microbatches", "2", "--hbm-gib", "40", "--json", str(out)]
    assert main(argv) == 0
    est = json.loads(out.read_text())
    for key in ("memory_bytes_per_device", "comm_bytes_per_step", "overlap_ratios", "bubble_fraction",
                "predicted_step_s", "predicted_mfu"):
        assert key in est
    mem = est["memory_bytes_per_device"]
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    assert est["bubble_fraction"] >= 3 / 5  # 1F1B's own, (p-1)/(m+p-1), and what lockstep adds to it
    text = capsys.readouterr().out
    assert "does not fit" in text and "TP axis spans nodes" in text and "m < p" in text
    assert "all-reduce         tensor" in text and "inter" in text


@pytest.mark.fast
def test_plan_formulas_scale_as_the_textbook():
    # ZeRO-3 on 8 devices keeps 1/8 of the 16 bytes per param; DP all-reduces every param once.
    config = GPT_SIZES["gpt-125m"]
    sizes = {"data": 1, "stage": 1, "fsdp": 8, "tensor": 1}
    est = planner.estimate(planner.PlanInput(config, Layout.of("fsdp", sizes)))
    n = est["model"]["params"]
    mem = est["memory_bytes_per_device"]
    assert mem["params"] + mem["grads"] + mem["optimizer"] == pytest.approx(16 * n / 8, rel=1e-3)
    dp = planner.estimate(planner.PlanInput(config, Layout.of("dp", sizes | {"fsdp": 1, "data": 8})))
    assert dp["comm_bytes_per_step"]["all-reduce"] == 4 * n + 4
    assert est["comm_bytes_per_step"]["all-gather"] < 2 * 4 * n  # norms and embeddings: gathered once


@pytest.mark.parametrize("model, strategy, mesh, precision, reduction", [
    # 2 x 4 B a param: the f32 gradients concatenated and the all-reduced copy (under 30 MiB: one buffer)
    ("tiny", "dp", {"data": 8}, "fp32", lambda n: 2 * 4 * n),
    # ZeRO-2 scatters onto the optimizer's eighths: the concatenated gradients and one eighth
    ("tiny", "zero2", {"fsdp": 8}, "mixed", lambda n: 4 * n + 4 * n / 8),
    # over 30 MiB, one combined buffer of 30 MiB beside the f32 all-reduced gradients
    ("gpt-125m", "dp", {"data": 8}, "mixed", lambda n: 30 * 2**20 + 4 * n),
    ("gpt-125m", "zero3", {"fsdp": 8}, "fp32", lambda n: 0),  # reduced layer by layer inside the stack
])
def test_gpu_gradient_reduction_is_a_peak_beside_backwards(model, strategy, mesh, precision, reduction):
    config = dataclasses.replace(GPT_SIZES[model], remat="full")
    sizes = {"data": 1, "stage": 1, "fsdp": 1, "tensor": 1} | mesh
    est = planner.estimate(planner.PlanInput(config, Layout.of(strategy, sizes, precision=precision), planner.HARDWARE["h100"]))
    mem, n = est["memory_bytes_per_device"], est["model"]["params"]
    # the larger of backward's peak (gradients and activations) and the reduction's
    assert mem["grads"] + mem["activations"] + mem.get("reduction", 0) == pytest.approx(
        max(mem["grads"] + mem["activations"], reduction(n)), rel=1e-4)
    cpu = planner.estimate(planner.PlanInput(config, Layout.of(strategy, sizes, precision=precision), planner.HARDWARE["cpu"]))
    assert "reduction" not in cpu["memory_bytes_per_device"]  # XLA:CPU: not seen in its programs


def test_collective_matmuls_take_sps_transfers_off_the_critical_path():
    """tp+sp: the step is compute plus every tensor collective's time; tp+sp-overlap moves the
    same tokens' bytes as permutes (the embedding's gather and reduce-scatter stay) and counts
    them beside compute, so its step is compute plus what is left on the critical path."""
    config = SIZES["llama-3.1-8b"]
    sizes = {"data": 1, "stage": 1, "fsdp": 1, "tensor": 8}
    est = {s: planner.estimate(planner.PlanInput(config, Layout.of(s, sizes, precision="mixed"), planner.HARDWARE["h100"]))
           for s in ("tp+sp", "tp+sp-overlap")}
    seconds = {s: {r["kind"]: r["seconds"] for r in e["collectives"]} for s, e in est.items()}
    sp, overlap = est["tp+sp"], est["tp+sp-overlap"]
    assert sp["predicted_step_s"] == pytest.approx(sp["compute_s"] + sum(seconds["tp+sp"].values()))
    ring = seconds["tp+sp-overlap"]["collective-permute"]
    assert ring < overlap["compute_s"]
    assert overlap["predicted_step_s"] == pytest.approx(overlap["compute_s"] + sum(seconds["tp+sp-overlap"].values()) - ring)
    assert overlap["memory_bytes_per_device"] == sp["memory_bytes_per_device"]


def test_bad_plan_exits_2(capsys):
    assert main(["plan", "--mesh", "tensor=3", "--strategy", "tp"]) == 2
    assert "does not divide by tensor=3" in capsys.readouterr().err


@pytest.mark.parametrize("name, stages, microbatches, virtual", [
    ("gpipe", 4, 8, None), ("1f1b", 4, 8, None), ("zb-h1", 4, 8, None), ("1f1b", 2, 4, None),
    ("interleaved", 4, 8, 2), ("interleaved", 2, 4, 2), ("interleaved", 2, 4, 3),
])
def test_planner_counts_the_sends_of_the_tick_table(name, stages, microbatches, virtual):
    """A tick sends forward when some stage runs F on a model position before the last
    (chunk c on stage s is position c·p + s), backward when some stage runs a backward on a
    position after the first. Read here from the table itself, not from the executor's program."""
    schedule = make_schedule(name, stages, microbatches, virtual)
    positions = stages * schedule.virtual
    forward = backward = 0
    for row in schedule.table():
        at = [(a.kind, a.virtual * stages + s) for s, a in enumerate(row) if a is not None]
        forward += any(kind == "F" and position < positions - 1 for kind, position in at)
        backward += any(kind in ("B", "BW") and position > 0 for kind, position in at)
    assert planner.sends(schedule) == (forward, backward)  # was (29, 29) for interleaved p=4 m=8 v=2


# -- a mixture of experts -------------------------------------------------------------------------

MIXTRAL = dataclasses.replace(SIZES["mixtral-8x7b"], dtype=jnp.bfloat16)  # as `jshard plan` builds it


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_mixtral_expert_params_per_device_fall_as_one_over_ep(ep):
    """dp+ep on 64 H100s: each device holds 8/ep experts' weights and the rest whole; the
    all-to-all of the dispatch buffer (4 per layer, of rows · E · C · embed) puts (ep-1)/ep of it on
    the node's links, and the predicted step waits for it."""
    est = planner.estimate(planner.PlanInput(MIXTRAL, Layout.of("dp+ep", {"data": 64 // ep, "expert": ep}, precision="bf16")))
    experts, n = est["moe"], est["model"]["params"]
    assert experts["experts_per_device"] == 8 // ep and experts["active_params"] < 0.3 * n
    assert experts["expert_param_bytes_per_device"] == experts["expert_params"] * 4 // ep  # fp32 params
    assert est["memory_bytes_per_device"]["params"] == (n - experts["expert_params"]) * 4 + experts["expert_params"] * 4 // ep
    slots = moe.capacity(MIXTRAL.seq_len, 8, 2, MIXTRAL.capacity_factor)
    all_to_all = [r for r in est["collectives"] if r["kind"] == "all-to-all"]
    if ep == 1:
        assert not all_to_all and est["overlap_ratios"]["ep"] is None
        return
    [row] = all_to_all
    assert row["bytes"] == MIXTRAL.layers * 4 * 8 * slots * MIXTRAL.embed * 2 and row["axes"] == "expert"
    # each of its calls (4 a layer: `communication.calls`) pays the link's latency once per step of its n - 1
    latency = 4 * MIXTRAL.layers * (ep - 1) * physics.LINK_LATENCY["intra"]
    assert row["link"] == "intra" and row["calls"] == 4 * MIXTRAL.layers
    assert row["seconds"] == pytest.approx(row["bytes"] * (ep - 1) / ep / 450e9 + latency)
    assert est["predicted_step_s"] >= est["compute_s"] + row["seconds"]


@pytest.mark.parametrize("capacity_factor", [1.0, 1.25, None])
def test_compute_counts_the_slots_the_experts_run(capacity_factor):
    """Model FLOPs (and MFU) count top_k experts a token; the compute time counts every slot
    of the buffer, E · C per row, filled or not (dropless: C = seq)."""
    config = dataclasses.replace(SIZES["moe-tiny"], capacity_factor=capacity_factor)
    est = planner.estimate(planner.PlanInput(config, Layout.of("ep", {"expert": 8}), planner.HARDWARE["cpu"]))
    slots = 8 * moe.capacity(config.seq_len, 8, 2, capacity_factor) / config.seq_len
    padding = 6 * 3 * config.embed * config.mlp * config.layers * (slots - 2) * est["tokens_per_step"]
    assert est["flops_per_step"]["run"] - est["flops_per_step"]["model"] == pytest.approx(padding)
    assert est["moe"]["slots_per_token"] == slots


@pytest.mark.parametrize("argv, fits", [
    (["--strategy", "fsdp+ep", "--mesh", "fsdp=8,expert=8", "--remat", "full"], True),
    (["--strategy", "dp+ep", "--mesh", "data=8,expert=8", "--remat", "full"], False),
])
def test_mixtral_plan(argv, fits, capsys):
    assert main(["plan", "--model", "mixtral-8x7b", *argv]) == 0
    text = capsys.readouterr().out
    assert "46.7 B params (12.9 B active)" in text and "experts     8 in every block, top-2, capacity 10240" in text
    assert "all-to-all         expert      ×8" in text and ("DOES NOT FIT" in text) != fits


@pytest.mark.fast
@pytest.mark.parametrize("strategy, mesh", [("cp", "context=8"), ("dp+cp+ep", "data=2,context=2,expert=2"),
                                            ("cp-gather+ep", "context=2,expert=4")])
def test_context_parallel_moe_is_refused(strategy, mesh, capsys):
    assert main(["plan", "--model", "moe-tiny", "--strategy", strategy, "--mesh", mesh]) == 2
    err = capsys.readouterr().err
    assert "but the model has a mixture of experts" in err and "Fix: a preset without cp" in err  # the step's own check


@pytest.mark.fast
def test_context_parallel_blocks_are_planned_as_the_kernel_that_runs_them():
    """On a GPU the ring's and cp-gather's blocks run jshard's flash kernel: attention charged as
    a flash kernel's (no score bytes streamed, none held), and at 32k over context=4 the ring is
    planned at >= 35% MFU (issue 55); `--attention xla` plans XLA's blocks (scores streamed, and
    under cp-gather held). On the CPU profile the blocks are XLA's."""
    config = dataclasses.replace(SIZES["llama-3.1-8b"], seq_len=32768, remat="full")
    sizes = {"fsdp": 2, "context": 4}

    def plan(strategy, attention="auto", hardware="h100"):
        model = dataclasses.replace(config, attention=attention)
        layout = Layout.of(strategy, sizes, precision="mixed", micro_batch_size=1)
        return planner.estimate(planner.PlanInput(model, layout, planner.HARDWARE[hardware]))

    for strategy in ("zero3+cp", "zero3+cp-gather"):
        flash, xla = plan(strategy), plan(strategy, "xla")
        assert "flash kernel blocks" in flash["attention"] and "XLA blocks" in xla["attention"]
        assert flash["compute_terms"]["memory_bound"] < xla["compute_terms"]["memory_bound"] / 10
        assert flash["memory_bytes_per_device"]["total"] <= xla["memory_bytes_per_device"]["total"]
    assert plan("zero3+cp")["predicted_mfu"] >= 0.35
    assert plan("zero3+cp-gather", "xla")["memory_bytes_per_device"]["total"] > 80 * 2**30  # the scores
    assert "XLA blocks" in plan("zero3+cp", hardware="cpu")["attention"]
    with pytest.raises(ShardingError, match="attention cudnn: attention 'cudnn' cannot run a ring's"):
        plan("zero3+cp", "cudnn")
