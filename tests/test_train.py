"""`jshard train`: strategies, training features, checkpoints, and every bad input.

Every run is the tiny GPT for a few steps on 8 fake CPU devices, on the shipped corpus.
The strategies train the same model on the same data, so their losses must agree with DP's.
"""

import dataclasses
import gc
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import jshard
from jshard.app import data, optim
from jshard.app.checkpoint import Checkpoints
from jshard.cli import build_parser, main
from jshard.cli.train import config_from_args
from jshard import metrics
from jshard.metrics import device_memory
from jshard.models import GPT, gpt_loss
from jshard.parallel import abstract_batch, build_step
from jshard.placement import specs
from jshard.models import GPT_SIZES
from jshard.app.train_config import TrainConfig
from jshard.app.training import train

STEPS = 5
EVAL_EVERY = 2  # and at the end: steps 2, 4, 5
RUN = dict(model="tiny", steps=STEPS, batch_size=16, seq_len=32, lr=3e-3)
CLI = ["train", "--model", "tiny", "--steps", "2", "--batch-size", "16", "--seq-len", "32"]


def run(**overrides):
    return train(TrainConfig.of(**{**RUN, **overrides}))


@pytest.fixture(scope="module")
def dp(tmp_path_factory):
    """The DP run every other strategy is compared with; it also evaluates, writes metrics and a trace."""
    where = tmp_path_factory.mktemp("dp")
    result = run(strategy="dp", mesh="data=8", eval_every=EVAL_EVERY, metrics=str(where / "metrics.jsonl"),
                 profile=str(where / "trace"), tensorboard=str(where / "tb"))
    return result, where


def assert_falls(losses):
    assert losses[-1] < losses[0] - 0.3, losses


def test_dp_trains_and_reports_metrics_and_a_trace(dp):
    result, where = dp
    assert_falls(result.losses)
    rows = [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    every = {"step", "loss", "lr", "grad_norm", "step_s", "tokens_per_s", "mfu"}  # XLA:CPU reports no device memory
    evaluated = [r["step"] for r in rows if set(r) == every | {"eval_loss", "eval_perplexity"}]
    assert evaluated == [2, 4, 5] == sorted(result.eval_losses)
    assert all(set(r) == every for r in rows if r["step"] not in evaluated)
    # no warm-up at 5 steps (a tenth of them): cosine from lr to lr/10 over the 5 updates
    lr = RUN["lr"]
    assert [r["lr"] for r in rows] == pytest.approx([lr / 10 + (lr - lr / 10) * (1 + math.cos(math.pi * i / STEPS)) / 2
                                                     for i in range(STEPS)], rel=1e-6)
    assert [r["eval_loss"] for r in rows if r["step"] in evaluated] == [result.eval_losses[s] for s in evaluated]
    assert result.eval_losses[5] < result.eval_losses[2]  # held-out loss falls too
    assert [r["loss"] for r in rows] == result.losses and [r["grad_norm"] for r in rows] == result.grad_norms
    assert all(r["step_s"] > 0 and r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 for r in rows)
    traced = [f for _, _, files in os.walk(where / "trace") for f in files]
    assert any(f.endswith(".xplane.pb") for f in traced) and "perfetto_trace.json.gz" in traced, traced
    assert "loss        " in result.summary and "MFU" in result.summary and "measured" in result.summary


def test_tensorboard_holds_the_metrics_files_numbers(dp):
    """--tensorboard DIR: every number of the metrics file as a scalar at its step, as
    TensorBoard's own reader returns them (float32, as TensorBoard stores scalars)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, where = dp
    events = EventAccumulator(str(where / "tb"))
    events.Reload()
    rows = [json.loads(line) for line in (where / "metrics.jsonl").read_text().splitlines()]
    assert set(events.Tags()["scalars"]) == {name for r in rows for name in r} - {"step"}
    for name in events.Tags()["scalars"]:
        shown = [(e.step, e.value) for e in events.Scalars(name)]
        written = [(r["step"], r[name]) for r in rows if name in r]
        assert [s for s, _ in shown] == [s for s, _ in written], name
        assert [v for _, v in shown] == pytest.approx([v for _, v in written], rel=1e-6), name


def test_a_cpu_hosts_peak_is_the_highest_measured_and_kept(monkeypatch, tmp_path):
    """MFU on CPU: the matmul peak of this host, measured at every start, the highest measure
    kept and read (a shared machine's load only lowers a measure: a first one under load is not
    kept for good, and a later, lower one does not move MFU); per dtype; a damaged file measured
    anew."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    measures = iter([2e11, 1e11, 3e11, 5e10, 4e11, 7e11])  # each start's measure, in turn
    monkeypatch.setattr(metrics, "measured_matmul_flops", lambda device, dtype: next(measures))
    first, lower, higher = (metrics.device_peak(jax.devices(), np.float32) for _ in range(3))
    assert (first.flops, lower.flops, higher.flops) == (2e11, 2e11, 3e11)
    assert first.source.startswith("measured: a 1024² float32 matmul") and lower.source.startswith("the highest measured: ")
    assert higher.source.startswith("measured: ") and str(tmp_path / "jshard" / "cpu-peak.json") in lower.source
    assert metrics.device_peak(jax.devices(), np.float32).flops == 3e11  # (5e10: kept 3e11)
    assert metrics.device_peak(jax.devices(), jax.numpy.bfloat16).flops == 4e11  # its own dtype's
    (tmp_path / "jshard" / "cpu-peak.json").write_text("{not json")  # damaged: this start's measure, kept again
    assert metrics.device_peak(jax.devices(), np.float32).flops == 7e11
    assert json.loads((tmp_path / "jshard" / "cpu-peak.json").read_text()) == {metrics.peak_key(np.float32): 7e11}


def test_device_memory_is_the_backends_where_it_reports_it(monkeypatch):
    assert device_memory() == {}  # XLA:CPU reports none
    reported = {"bytes_in_use": 5 * 2**30, "peak_bytes_in_use": 9 * 2**30, "largest_alloc_size": 2**30}
    monkeypatch.setattr(jax, "local_devices", lambda: [type("GPU", (), {"memory_stats": lambda self: reported})()])
    assert device_memory() == {"memory_bytes": 5 * 2**30, "peak_memory_bytes": 9 * 2**30}


@pytest.mark.parametrize("strategy, mesh, schedule", [
    ("zero3+tp", "fsdp=4,tensor=2", None), ("pp+fsdp", "stage=2,fsdp=4", None), ("pp+fsdp", "stage=2,fsdp=4", "1f1b"),
    ("dp+cp", "data=2,context=4", None),
])
def test_strategy_trains_as_dp_does(dp, strategy, mesh, schedule, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run(strategy=strategy, mesh=mesh, schedule=schedule, eval_every=EVAL_EVERY)
    assert_falls(result.losses)
    assert os.listdir(tmp_path) == []  # no trace, metrics or checkpoints unless asked for
    np.testing.assert_allclose(result.losses, dp[0].losses, rtol=1e-4)
    np.testing.assert_allclose(result.grad_norms, dp[0].grad_norms, rtol=1e-4)  # summed over every shard
    # The held-out loss, forward only in this strategy's layouts (a pipeline's F ticks), as DP's.
    assert list(result.eval_losses) == list(dp[0].eval_losses)
    np.testing.assert_allclose(list(result.eval_losses.values()), list(dp[0].eval_losses.values()), rtol=1e-4)


def test_moe_trains_under_dp_ep_as_under_dp_and_reports_its_experts(tmp_path):
    """moe-tiny's per-step and held-out losses under dp+ep equal dp's; every logged step's
    metrics carry the router statistics: each layer's expert load, dropped choices, balance."""
    moe = dict(model="moe-tiny", eval_every=EVAL_EVERY, log_every=2)
    dp = run(strategy="dp", mesh="data=8", metrics=str(tmp_path / "dp.jsonl"), **moe)
    ep = run(strategy="dp+ep", mesh="data=2,expert=4", metrics=str(tmp_path / "ep.jsonl"), **moe)
    assert_falls(ep.losses)
    np.testing.assert_allclose(ep.losses, dp.losses, rtol=1e-4)
    np.testing.assert_allclose(list(ep.eval_losses.values()), list(dp.eval_losses.values()), rtol=1e-4)
    rows = {name: [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
            for name in ("dp", "ep")}
    routed = [r for r in rows["ep"] if "expert_load" in r]
    assert [r["step"] for r in routed] == [1, 2, 4, 5]
    for r, d in zip(routed, (r for r in rows["dp"] if "expert_load" in r)):
        load = np.asarray(r["expert_load"])
        assert load.shape == (2, 8) and np.allclose(load.sum(-1), 1, atol=1e-3)
        assert 0 < r["dropped"] < 1 and r["balance_loss"] > 0
        np.testing.assert_allclose(load, d["expert_load"], atol=2e-4)
    assert "experts     load per expert" in ep.summary and "of choices dropped" in ep.summary


def test_gradient_accumulation_and_remat_leave_the_losses_as_they_were(dp):
    # Two accumulated micro-batches of 8 rows each (inside the step) are one step of 16; remat recomputes, it
    # does not change.
    losses = run(strategy="dp", mesh="data=8", grad_accum=2, remat="full").losses
    np.testing.assert_allclose(losses, dp[0].losses, rtol=1e-4)


def test_bf16_compute_trains_near_fp32(dp):
    losses = run(strategy="zero3+tp", mesh="fsdp=4,tensor=2", precision="bf16", remat="selective").losses
    assert_falls(losses)
    np.testing.assert_allclose(losses, dp[0].losses, rtol=2e-2)


def test_mixed_precision_trains_near_fp32(dp):
    losses = run(strategy="zero2", mesh="fsdp=8", precision="mixed").losses
    assert_falls(losses)
    np.testing.assert_allclose(losses, dp[0].losses, rtol=2e-2)


def test_mixed_checkpoint_holds_the_fp32_master_and_moves_between_precisions(tmp_path):
    """Resumed under mixed it continues exactly; its params are the fp32 master, so fp32
    resumes from it too (its losses within bf16's round-off of the mixed run's)."""
    mixed = dict(strategy="zero3", mesh="fsdp=8", precision="mixed")
    saved = run(**mixed, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=3)
    copy_step((None, tmp_path / "a"), 3, tmp_path / "b")
    shutil.rmtree(tmp_path / "a" / "5")
    resumed = run(**mixed, checkpoint_dir=str(tmp_path / "a"), resume=True)
    assert resumed.first_step == 3 and resumed.losses == saved.losses[3:]  # bit for bit
    with Checkpoints(tmp_path / "b") as checkpoints:
        saved_params = checkpoints._manager.item_metadata(3).state["params"]
    assert {np.dtype(x.dtype) for x in jax.tree.leaves(saved_params)} == {np.dtype(np.float32)}
    as_fp32 = run(strategy="dp", mesh="data=8", precision="fp32", checkpoint_dir=str(tmp_path / "b"), resume=True)
    np.testing.assert_allclose(as_fp32.losses, saved.losses[3:], rtol=2e-2)


@pytest.mark.parametrize("field, value, message", [
    ("precision", "fp16", "unknown --precision 'fp16'; choose one of fp32, bf16, mixed"),
    ("grad_reduce", "fp8", "unknown --grad-reduce 'fp8'; choose one of fp32, bf16"),
])
def test_bad_precision_in_a_config_is_refused(field, value, message):
    from jshard.app.train_config import TrainError

    with pytest.raises(TrainError, match=message):
        run(**{field: value})


def test_remat_policies_cut_activation_memory():
    tokens = np.zeros((8, 33), np.int32)

    def temp_bytes(remat):  # only compiled: the params' shapes (`nnx.eval_shape`)
        graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(dataclasses.replace(GPT_SIZES["tiny"], remat=remat),
                                                               rngs=nnx.Rngs(0))))
        grad = jax.jit(jax.grad(lambda params: gpt_loss(nnx.merge(graphdef, params), tokens)))
        return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    none, selective, full = temp_bytes("none"), temp_bytes("selective"), temp_bytes("full")
    assert none > selective > full, (none, selective, full)


def test_remat_policies_cut_memory_under_zero3_too():
    """The ZeRO-3 step's own checkpoint (gather weights again) keeps the layers' policy."""
    mesh, rules = jshard.make_mesh(fsdp=8), jshard.preset("zero3")

    def temp_bytes(remat):
        # only compiled: built from shapes (`abstract`, the program of the step built on the devices)
        model = nnx.eval_shape(lambda: GPT(dataclasses.replace(GPT_SIZES["tiny"], remat=remat), rngs=nnx.Rngs(0)))
        step = build_step(model, optax.sgd(0.1), gpt_loss, jshard.Layout.of(rules, mesh), mesh, abstract=True)
        tokens = abstract_batch(step.plan, (16, 65), np.int32)
        return step.lower(step.state, tokens).compile().memory_analysis().temp_size_in_bytes

    none, selective, full = temp_bytes("none"), temp_bytes("selective"), temp_bytes("full")
    assert none > selective > full, (none, selective, full)


def test_global_norm_sums_over_the_shards():
    mesh, rules = jshard.make_mesh(fsdp=4, tensor=2), jshard.preset("zero3+tp")
    model = jshard.init(lambda: GPT(GPT_SIZES["tiny"], rngs=nnx.Rngs(0)), mesh, rules)
    step = build_step(model, optax.sgd(0.1), gpt_loss, jshard.Layout.of(rules, mesh), mesh)
    tokens = data.TextBatches(data.corpus_tokens(), 16, 0).rows(range(8))
    _, grads = step.value_and_grad(step.state, step.shard_batch(tokens))
    grad_specs = specs(grads, mesh, rules, "opt")
    sharded = jax.jit(jax.shard_map(optim.global_norm, mesh=mesh, in_specs=(grad_specs,), out_specs=jax.P()))
    np.testing.assert_allclose(sharded(grads), jax.jit(optax.tree.norm)(grads), rtol=1e-5)  # (jitted: one program)


# -- data --------------------------------------------------------------------------------


def test_data_order_is_fixed_by_seed_and_visits_every_window_each_epoch():
    stream = data.TextBatches(data.corpus_tokens(), 63, seed=3)
    epoch = stream.rows(range(stream.windows))
    assert len({row.tobytes() for row in epoch}) == stream.windows  # every window once
    np.testing.assert_array_equal(data.TextBatches(data.corpus_tokens(), 63, seed=3).rows([5, 7]), epoch[[5, 7]])
    assert not np.array_equal(data.TextBatches(data.corpus_tokens(), 63, seed=4).rows([5]), epoch[[5]])
    assert not np.array_equal(stream.rows([stream.windows]), epoch[[0]])  # the next epoch is reshuffled


def test_batch_is_built_from_the_rows_this_process_holds():
    stream = data.TextBatches(data.corpus_tokens(), 15, seed=0)
    sharding = NamedSharding(jshard.make_mesh(data=2, fsdp=2, tensor=2), jax.P(("data", "fsdp")))
    batch = stream.batch(40, 8, sharding)
    assert batch.sharding == sharding and batch.shape == (8, 16)
    np.testing.assert_array_equal(np.asarray(batch), stream.rows(range(40, 48)))


# -- checkpoints -------------------------------------------------------------------------


def test_checkpoint_round_trip_onto_another_layout(tmp_path):
    mesh = jshard.make_mesh(data=2, fsdp=2, tensor=2)
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    saved = {"w": jax.device_put(value, NamedSharding(mesh, jax.P("fsdp", "tensor")))}
    with Checkpoints(tmp_path) as checkpoints:
        checkpoints.save(7, saved, {"step": 7, "model": "m"})
    target = NamedSharding(mesh, jax.P(("data", "fsdp", "tensor")))
    with Checkpoints(tmp_path) as reopened:
        assert reopened.latest_step() == 7 and reopened.record(7) == {"step": 7, "model": "m"}
        restored = reopened.restore(7, {"w": jax.ShapeDtypeStruct((8, 8), np.float32, sharding=target)})
    assert restored["w"].sharding == target
    np.testing.assert_array_equal(np.asarray(restored["w"]), value)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An uninterrupted 5-step ZeRO-3 run on fsdp=8 with checkpoints at steps 3 and 5."""
    where = tmp_path_factory.mktemp("saved")
    result = run(strategy="zero3", mesh="fsdp=8", checkpoint_dir=str(where), checkpoint_every=3)
    return result, where


def copy_step(saved, step, to):
    shutil.copytree(saved[1] / str(step), to / str(step))
    return to


def test_checkpoint_holds_the_data_position_and_model(saved):
    with Checkpoints(saved[1]) as checkpoints:
        record = checkpoints.record(3)
    assert record["step"] == 3 and record["data_position"] == 3 * RUN["batch_size"]
    assert record["model"]["embed"] == GPT_SIZES["tiny"].embed and record["strategy"] == "zero3"


def test_interrupted_save_leaves_the_previous_checkpoint_and_resume_is_exact(saved, tmp_path, monkeypatch):
    from orbax.checkpoint._src.path import atomicity

    finalize = atomicity.AtomicRenameTemporaryPath.finalize

    async def killed_before_rename(self):
        if self.get_final().name == "5":  # every file of step 5 written, the rename never happens
            raise RuntimeError("killed")
        await finalize(self)

    monkeypatch.setattr(atomicity.AtomicRenameTemporaryPath, "finalize", killed_before_rename)
    with pytest.raises(Exception, match="killed"):
        run(strategy="zero3", mesh="fsdp=8", checkpoint_dir=str(tmp_path), checkpoint_every=3)
    monkeypatch.undo()
    assert "3" in os.listdir(tmp_path) and "5" not in os.listdir(tmp_path)
    assert any(ocp.path.atomicity.TMP_DIR_SUFFIX in name for name in os.listdir(tmp_path))
    resumed = run(strategy="zero3", mesh="fsdp=8", checkpoint_dir=str(tmp_path), resume=True)
    assert resumed.first_step == 3
    assert resumed.losses == saved[0].losses[3:]  # bit for bit
    assert not any(ocp.path.atomicity.TMP_DIR_SUFFIX in name for name in os.listdir(tmp_path))


def test_restore_onto_another_mesh_and_strategy_gives_the_same_loss(saved, tmp_path):
    # Saved under zero3 on fsdp=8 without accumulation; restored under dp+tp, accumulating two micro-batches.
    resumed = run(strategy="dp+tp", mesh="data=2,tensor=4", grad_accum=2,
                  checkpoint_dir=str(copy_step(saved, 3, tmp_path)), resume=True)
    assert resumed.first_step == 3
    np.testing.assert_allclose(resumed.losses, saved[0].losses[3:], rtol=1e-5)


def test_resuming_with_another_schedule_says_so(saved, tmp_path, capsys):
    """--resume --steps 8 continues the optimizer's count, under this run's schedule: it says so."""
    capsys.readouterr()
    resumed = run(strategy="zero3", mesh="fsdp=8", steps=8, checkpoint_dir=str(copy_step(saved, 5, tmp_path)),
                  resume=True)
    assert resumed.first_step == 5 and len(resumed.losses) == 3
    assert ("schedule    steps 5 -> 8, warmup 0 -> 0" not in (out := capsys.readouterr().out)
            and "schedule    steps 5 -> 8: from step 6 the learning rate follows this run's warm-up and cosine" in out), out


@pytest.mark.parametrize("model, pipeline", [
    (dict(model="small"), dict(strategy="pp+fsdp", mesh="stage=2,fsdp=4", schedule="interleaved")),
    (dict(model="tiny", layers=3), dict(strategy="dp+pp", mesh="data=4,stage=2")),  # uneven: 2 + 1 layers, padded
], ids=["interleaved", "uneven"])
def test_pipelined_checkpoint_restores_under_another_schedule(model, pipeline, tmp_path):
    """An interleaved step holds its layers permuted, an uneven one padded; checkpoints hold
    the model's layers in its order."""
    small = dict(**model, steps=3, seq_len=32)
    saved = run(**small, **pipeline, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    shutil.rmtree(tmp_path / "3")
    resumed = run(**small, strategy="dp", mesh="data=8", checkpoint_dir=str(tmp_path), resume=True)
    assert resumed.first_step == 2
    np.testing.assert_allclose(resumed.losses, saved.losses[2:], rtol=1e-5)


# -- bad input: one clear error, exit code 2, before any device work ---------------------


def refused(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err, captured.err
    assert "jshard train:" not in captured.out  # nothing placed, nothing trained
    return captured.err


@pytest.mark.parametrize("flags, message", [
    (["--strategy", "dp+fast"], "unknown strategy 'fast' in preset 'dp+fast'"),
    (["--mesh", "data=3"], "mesh data=3 needs 3 devices, but JAX sees 8"),
    (["--strategy", "dp", "--mesh", "data=8", "--batch-size", "12"],
     "--batch-size 12 does not split over 8 batch shards (data) × --grad-accum 1 = 8"),
    (["--strategy", "dp", "--mesh", "data=8", "--batch-size", "8", "--grad-accum", "2"],
     "--batch-size 8 does not split over 8 batch shards (data) × --grad-accum 2 = 16"),
    (["--strategy", "pp+fsdp", "--mesh", "stage=2,fsdp=4", "--batch-size", "8"],
     "over 4 batch shards (fsdp) × 4 pipeline micro-batches × --grad-accum 1 = 16"),
    (["--seq-len", "65"], "--seq-len 65 is longer than model 'tiny' takes (64"),
    (["--steps", "0"], "--steps must be a positive int, got 0"),
    (["--lr", "-1"], "--lr must be a positive number, got -1.0"),
    (["--resume"], "--resume and --checkpoint-every need --checkpoint-dir DIR"),
    (["--strategy", "dp", "--mesh", "data=8", "--schedule", "1f1b"], "no pipeline to feed"),
    (["--strategy", "dp+cp", "--mesh", "data=2,context=4", "--seq-len", "36"],
     "--seq-len 36: context parallelism over context = 4 cuts each sequence into 8 equal chunks"),
    (["--strategy", "dp+tp+sp", "--mesh", "data=2,tensor=4", "--seq-len", "30"],
     "--seq-len 30: sequence parallelism splits each sequence's tokens over tensor = 4"),
    (["--strategy", "cp+pp", "--mesh", "context=4,stage=2"], "Fix: all-gather them instead, preset 'pp+cp-gather'"),
    (["--strategy", "dp+ep", "--mesh", "data=2,expert=4"], "no param of the model has an 'experts' dim"),
    (["--model", "moe-tiny", "--strategy", "dp+cp", "--mesh", "data=2,context=4"], "Fix: a preset without cp"),
    (["--model", "moe-tiny", "--strategy", "ep", "--mesh", "expert=8", "--batch-size", "4"],
     "--batch-size 4 does not split over 8 batch shards (expert)"),
    (["--metrics", "/proc/no/m.jsonl"], "--metrics /proc/no/m.jsonl: cannot write into /proc/no (no such file"),
    (["--tensorboard", "/proc/no"], "--tensorboard /proc/no: cannot write into /proc/no (no such file"),
    (["--profile", "/proc/no"], "--profile /proc/no: cannot write into /proc/no (no such file"),
])
@pytest.mark.fast
def test_bad_flags_are_refused_before_device_work(capsys, flags, message):
    refused(capsys, CLI + flags, message)


def test_resume_with_nothing_to_resume(capsys, tmp_path):
    refused(capsys, CLI + ["--checkpoint-dir", str(tmp_path), "--resume"], "--resume: no checkpoint to resume in")


def test_checkpoint_dir_of_another_model_is_refused(capsys, saved, tmp_path):
    where = str(copy_step(saved, 3, tmp_path))
    err = refused(capsys, CLI + ["--model", "small", "--checkpoint-dir", where, "--resume"],
                  "holds a checkpoint (step 3) of another model")
    assert "model.embed: saved 64, this run 128" in err
    assert os.listdir(tmp_path) == ["3"]


def test_existing_checkpoints_are_not_overwritten_without_resume(capsys, saved, tmp_path):
    refused(capsys, CLI + ["--checkpoint-dir", str(copy_step(saved, 3, tmp_path))],
            "already holds checkpoints up to step 3; starting afresh would mix two runs. Fix: add --resume")


def test_resume_past_the_last_step_is_refused(capsys, saved, tmp_path):
    refused(capsys, CLI + ["--checkpoint-dir", str(copy_step(saved, 3, tmp_path)), "--resume"],
            "is at step 3, and --steps is 2: nothing to train")


@pytest.mark.parametrize("damage", ["partial", "corrupt"])
def test_partial_or_corrupt_checkpoint_is_refused(capsys, saved, tmp_path, damage):
    step = copy_step(saved, 3, tmp_path) / "3"
    if damage == "partial":
        shutil.rmtree(step / "state")
    else:
        (step / "state" / "_METADATA").write_text("{ not json")
    refused(capsys, CLI + ["--steps", "6", "--checkpoint-dir", str(tmp_path), "--resume"],
            f"checkpoint {step} cannot be read, it is corrupt, partial or of another layout")


# After a failed read, tensorstore still posts a callback to orbax's event loop, closed by
# then: a harmless "Event loop is closed". Waited for here, so the warning is this test's.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_array_data_is_refused_with_the_same_error(capsys, saved, tmp_path):
    step = copy_step(saved, 3, tmp_path) / "3"
    for root, _, files in os.walk(step / "state" / "d"):
        for name in files:
            with open(os.path.join(root, name), "r+b") as f:
                f.write(b"\0" * 64)
    assert main(CLI + ["--steps", "6", "--checkpoint-dir", str(tmp_path), "--resume"]) == 2
    assert f"checkpoint {step} cannot be read" in capsys.readouterr().err
    time.sleep(1)
    gc.collect()


def test_a_full_disk_stops_the_run_with_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """A disk that fills during an asynchronous save (a 2 MiB tmpfs holds one tiny checkpoint,
    not two): exit 2, one jshard line naming the step not written and the latest that was, no
    traceback from orbax's threads, no summary claiming a checkpoint; the one before is whole."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a 2 MiB tmpfs needs root: the full disk is made, not simulated")
    try:
        done = subprocess.run([sys.executable, "-m", "jshard.cli", "train", "--model", "tiny", "--steps", "6",
                               "--checkpoint-dir", str(disk / "run"), "--checkpoint-every", "1"],
                              capture_output=True, text=True, timeout=600)
        kept = sorted(os.listdir(disk / "run"))
    finally:
        subprocess.run(["umount", str(disk)])
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stdout + done.stderr and "summary of" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    line, = lines
    failed = int(re.search(r"checkpoint step (\d+) could not be written", line).group(1))
    assert f"the latest complete checkpoint is step {failed - 1}. Fix: free space" in line, line
    assert "No space left on device" in line and str(failed - 1) in kept, (line, kept)


# What a failed save leaves behind reports itself late and from anywhere: a write's asyncio task
# dropped by the main thread (CI's full-disk run on 2026-12-02 printed its traceback so), absl
# records and exceptions of orbax's threads. Each to the log, none to the terminal.
LATE_REPORTS = """
import asyncio, gc, sys, threading
from absl import logging as absl_logging
from jshard.app import checkpoint
checkpoint.reports_to_log()
async def write(): raise ValueError("No space left on device (a task)")
def background():
    loop = asyncio.new_event_loop()
    global task
    task = loop.create_task(write())
    loop.run_until_complete(asyncio.sleep(0.01))
    absl_logging.error("No space left on device (absl, a thread)")
    raise OSError("No space left on device (a thread)")
thread = threading.Thread(target=background)
thread.start()
thread.join()
del task
gc.collect()
print("the main thread's own", file=sys.stderr)
"""


def test_a_failed_saves_late_reports_go_to_the_log_from_any_thread(tmp_path):
    done = subprocess.run([sys.executable, "-c", LATE_REPORTS], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(tmp_path)})
    assert (done.returncode, done.stderr) == (0, "the main thread's own\n")
    log, = tmp_path.glob("jshard-checkpoint-*.log")
    for report in ["Task exception was never retrieved", "(a task)", "(absl, a thread)", "OSError: No space left on device (a thread)"]:
        assert report in log.read_text(), report


def test_a_config_may_give_the_mesh_as_an_object_and_the_strategy_as_a_list(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"mesh": {"data": 2, "tensor": 4}, "strategy": ["dp", "tp"], "steps": 3}))
    config = config_from_args(build_parser().parse_args(["train", "--config", str(path)]))
    assert (config.layout.mesh, config.layout.strategy, config.optimizer.steps) == ("data=2,tensor=4", "dp+tp", 3)


def test_config_file_is_mirrored_by_flags(capsys, tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"model": "tiny", "steps": 0}))
    refused(capsys, ["train", "--config", str(config)], "--steps must be a positive int, got 0")
    refused(capsys, ["train", "--config", str(config), "--steps", "2", "--seq-len", "99"], "--seq-len 99 is longer")
    config.write_text(json.dumps({"model": "tiny", "stesp": 2}))
    refused(capsys, ["train", "--config", str(config)], "unknown field(s) stesp")


def test_a_non_finite_loss_stops_the_run_and_saves_nothing_after_it(capsys, tmp_path):
    """--lr 1e6 diverges: the run stops at the first non-finite gradient norm or loss with one line,
    the checkpoints before it kept and finite, none after; the metrics file (in a folder it made)
    holds the steps that ran. (The gradients go non-finite a step before the loss: checked on
    the loss alone, the run saved that step's update, non-finite params, as its last checkpoint.)"""
    metrics = tmp_path / "runs" / "m.jsonl"
    assert main(CLI[:3] + ["--steps", "10", "--batch-size", "16", "--seq-len", "32", "--lr", "1e6",
                           "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "1",
                           "--metrics", str(metrics)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"step \d+: the gradients are not finite \(the loss, \S+, is\); their update "
                                       r"was not applied; training stopped", err[0]), err
    stopped = int(err[0].split("step ")[1].split(":")[0])
    saved = sorted(int(d) for d in os.listdir(tmp_path / "ck") if d.isdigit())
    assert saved and saved[-1] == stopped - 1 and f"the last checkpoint, step {stopped - 1}" in err[0]
    assert len(metrics.read_text().splitlines()) == stopped - 1
    kept = ocp.PyTreeCheckpointer().restore(str(tmp_path / "ck" / str(saved[-1]) / "state"))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(kept))


def test_skip_nonfinite_skips_those_updates_and_stops_after_n_in_a_row(capsys, tmp_path):
    """--skip-nonfinite 2: steps whose gradients are not finite are run but not applied (said on
    the step line, `skipped` and a null `grad_norm` in the metrics), up to 2 in a row; the third
    stops the run with one line."""
    metrics = tmp_path / "m.jsonl"
    assert main(CLI[:3] + ["--steps", "10", "--batch-size", "16", "--seq-len", "32", "--lr", "1e6", "--log-every", "1",
                           "--skip-nonfinite", "2", "--metrics", str(metrics)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and re.search(r"step (\d+): the gradients were not finite 3 steps in a row "
                                       r"\(--skip-nonfinite 2\); none of those updates was applied", err[0]), err
    stopped = int(err[0].split("step ")[1].split(":")[0])
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if r.get("skipped")] == [stopped - 2, stopped - 1]
    assert all(r["grad_norm"] is None for r in rows if r.get("skipped"))
    assert all(math.isfinite(r["grad_norm"]) for r in rows if not r.get("skipped"))
    assert sum("(gradients not finite: update skipped)" in line for line in captured.out.splitlines()) == 2


@pytest.mark.parametrize("clipped", [True, False], ids=["norm-of-the-clip", "norm-of-its-own"])
def test_an_update_of_non_finite_gradients_is_not_applied(clipped):
    """optim.skip_nonfinite: zero updates and the state kept for non-finite gradients, counted in a
    row; a finite step applies again and resets the count. It reads the norm a clip inside took,
    or takes its own."""
    tx = optim.adamw(optim.schedule(1e-2, 10, 0)) if clipped else optim.skip_nonfinite(optax.adam(1e-2))
    params = {"w": jnp.ones((3, 4))}
    state = tx.init(params)
    _, state = tx.update({"w": jnp.full((3, 4), 2.0)}, state, params)
    for in_a_row in (1, 2):
        updates, after = tx.update({"w": jnp.full((3, 4), jnp.nan)}, state, params)
        assert not np.asarray(updates["w"]).any() and int(optim.skipped(after)) == in_a_row
        assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.all(a == b)), after.inner, state.inner))
        state = after
    updates, state = tx.update({"w": jnp.ones((3, 4))}, state, params)
    assert np.asarray(updates["w"]).all() and int(optim.skipped(state)) == 0
    if clipped:
        assert float(optim.grad_norm(state)) == pytest.approx(np.sqrt(12))


@pytest.mark.parametrize("config, message", [
    ({"resume": "false"}, 'resume is "false", not true or false. Fix: e.g. "resume": false.'),
    ({"mesh": {"data": "8"}}, 'mesh is {"data": "8"}, not a string ("data=2,tensor=4"), an object of axis sizes '
                              '({"data": 2, "tensor": 4}) or null. Fix: e.g. "mesh": "data=2,fsdp=2,tensor=2".'),
    ({"strategy": ["dp", 2]}, 'strategy is ["dp", 2], not a string ("dp+tp") or a list of strings (["dp", "tp"]). '
                              'Fix: e.g. "strategy": "dp+fsdp+tp".'),
    ({"seed": "1", "steps": 2.5}, 'steps is 2.5, not an integer; seed is "1", not an integer or null. '
                                  'Fix: e.g. "steps": 400, "seed": 1.'),
])
def test_a_config_value_of_the_wrong_type_gets_one_line(capsys, tmp_path, config, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    refused(capsys, ["train", "--config", str(path)], message)


def test_a_rotary_model_takes_a_seq_len_past_its_named_one(capsys):
    """llama-tiny is named with seq_len 64, but rotary positions are computed, not a table: 128
    trains (the GPT's learned table keeps its limit: test_bad_flags_are_refused_before_device_work)."""
    result = train(TrainConfig.of(model="llama-tiny", seq_len=128, steps=1, batch_size=8, strategy="dp", mesh="data=8"))
    assert np.isfinite(result.losses[0]) and "batch       8 rows × 128 tokens" in capsys.readouterr().out
