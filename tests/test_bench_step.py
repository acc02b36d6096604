"""`jshard bench step` on CPU: the JSON it writes, the plain model it compares against, and
the XLA flags it sets on GPUs."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jshard import mesh
from jshard.bench import step_time
from jshard.cli import main
from jshard.bench.plain import plain_from, plain_loss
from jshard.models import GPT, GPT_SIZES, SIZES, decoder, gpt_loss

TINY = ["--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--repeats", "2"]


def _bench(tmp_path, *flags) -> dict:
    out = tmp_path / "step.json"
    assert main(["bench", "step", *TINY, *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_json_on_one_cpu_device(tmp_path, capsys):
    result = _bench(tmp_path)
    assert list(result) == list(step_time.JSON_KEYS)
    assert result["device"] == "1 x cpu"
    params = nnx.state(GPT(GPT_SIZES["tiny"], rngs=nnx.Rngs(0)), nnx.Param)
    assert result["model_params"] == sum(x.size for x in nnx.to_flat_state(params).leaves)
    for key in ("tokens_per_s", "tflops", "plain_step_s", "step_s", "overhead_ratio", "matmul_tflops", "copy_gbps"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["mfu_datasheet"] is None  # no datasheet for a CPU
    assert 0 < result["mfu_measured_peak"] <= 1
    assert result["overhead_ratio"] == pytest.approx(result["step_s"] / result["plain_step_s"])
    text = capsys.readouterr().out
    assert "MFU is against the measured matmul peak only" in text
    jshard_loss, plain_loss = re.search(r"first-step loss jshard ([\d.]+), plain ([\d.]+)", text).groups()
    # Both start from the same weights: fp32 parity, to rounding in the printed 6th decimal.
    assert float(jshard_loss) == pytest.approx(float(plain_loss), rel=1e-6, abs=1e-6)


def test_two_devices_copy_between_them_and_a_profile(tmp_path, capsys):
    result = _bench(tmp_path, "--mesh", "data=2", "--profile", str(tmp_path / "trace"))
    assert result["device"] == "2 x cpu" and result["copy_gbps"] > 0
    assert "device 0 -> device 1" in capsys.readouterr().out
    assert list((tmp_path / "trace").rglob("*.xplane.pb"))


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("tied_head", [True, False])
def test_plain_model_is_jshards_model(name, tied_head):
    config = dataclasses.replace(SIZES[name], tied_head=tied_head)
    model = decoder(config, nnx.Rngs(1))
    tokens = np.random.default_rng(0).integers(0, config.vocab, (4, 33))
    np.testing.assert_allclose(float(plain_loss(plain_from(model, jnp.float32), tokens)), float(gpt_loss(model, tokens)), rtol=1e-6)


def test_bad_seq_len_is_refused(capsys):
    assert main(["bench", "step", "--model", "tiny", "--seq-len", "65"]) == 2
    assert "takes 1..64 tokens per row" in capsys.readouterr().err


def _xla_starts(flags: str) -> bool:
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    code = "import jax; jax.numpy.ones(2).block_until_ready()"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True).returncode == 0


def test_gpu_xla_flags_are_known_to_this_xla():
    # XLA parses every flag (GPU ones too) at start-up and aborts on one it does not know.
    assert _xla_starts(" ".join(mesh.GPU_XLA_FLAGS + mesh.DEVICELESS_XLA_FLAGS))
    assert not _xla_starts("--xla_gpu_no_such_flag=true")


@pytest.mark.parametrize("flags, message", [
    ("--xla_no_such_flag=1", "Unknown flag in XLA_FLAGS: --xla_no_such_flag=1."),
    ("--xla_gpu_enable_latency_hiding_scheduler=maybe",
     "Couldn't interpret value maybe for flag xla_gpu_enable_latency_hiding_scheduler."),
    ("xla_dump_to=/tmp/dump", 'Could not open file "xla_dump_to=/tmp/dump"'),
])
def test_xla_flags_xla_would_abort_on_are_one_line(monkeypatch, capsys, flags, message):
    """XLA aborts the process on such XLA_FLAGS (a bad value with ~90 lines of its usage): every
    command tries them first and says so in one line, before JAX starts."""
    monkeypatch.setenv("XLA_FLAGS", flags)
    monkeypatch.delenv("JSHARD_XLA_FLAGS_CHECKED", raising=False)
    assert main(["plan", "--strategy", "zero3", "--devices", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"jshard plan: XLA_FLAGS='{flags}': XLA rejects it: ")
    assert message in err and "Fix: correct or remove that flag" in err


def test_xla_flags_xla_reads_pass_the_check(monkeypatch):
    flags = "--xla_dump_to=/tmp/jshard-dump --xla_gpu_enable_pipelined_all_gather=false"
    monkeypatch.setenv("XLA_FLAGS", flags)
    monkeypatch.delenv("JSHARD_XLA_FLAGS_CHECKED", raising=False)
    mesh.check_xla_flags()  # tried in a child process, accepted, and remembered for child processes
    assert os.environ["JSHARD_XLA_FLAGS_CHECKED"] == flags
    monkeypatch.setattr(subprocess, "run", None)  # not tried again; nor jshard's own flags and the device count
    mesh.check_xla_flags()
    monkeypatch.setenv("XLA_FLAGS", " ".join((*mesh.GPU_XLA_FLAGS, "--xla_force_host_platform_device_count=8")))
    mesh.check_xla_flags()


def test_gpu_xla_flags_only_on_gpu_beside_the_users_whose_values_win(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert not mesh.use_gpu_xla_flags()  # the suite runs on CPU
    assert "XLA_FLAGS" not in os.environ
    monkeypatch.setattr(mesh, "_gpu_expected", lambda: True)
    assert mesh.use_gpu_xla_flags() == list(mesh.GPU_XLA_FLAGS)
    assert os.environ["XLA_FLAGS"] == " ".join(mesh.GPU_XLA_FLAGS)
    assert mesh.use_gpu_xla_flags() == []  # a second call adds nothing
    # an unrelated flag of the user's keeps jshard's beside it; one jshard sets keeps the user's value
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/mine --xla_gpu_enable_pipelined_all_gather=false")
    added = mesh.use_gpu_xla_flags()
    assert "--xla_gpu_enable_pipelined_all_gather=true" not in added and len(added) == len(mesh.GPU_XLA_FLAGS) - 1
    assert os.environ["XLA_FLAGS"].split() == ["--xla_dump_to=/tmp/mine", "--xla_gpu_enable_pipelined_all_gather=false",
                                                *added]
    assert mesh.xla_flags_line() == os.environ["XLA_FLAGS"]


def test_a_compile_with_no_gpu_here_does_not_autotune(monkeypatch):
    """XLA:GPU compiling with no GPU present gets the deviceless flags after jshard's; on a GPU
    machine its autotuner keeps its say; a user's own level wins."""
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    assert mesh.use_gpu_xla_flags(compiling_for_gpu=True) == [*mesh.GPU_XLA_FLAGS, *mesh.DEVICELESS_XLA_FLAGS]
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setattr(mesh, "_gpu_expected", lambda: True)
    assert mesh.use_gpu_xla_flags(compiling_for_gpu=True) == list(mesh.GPU_XLA_FLAGS)
    monkeypatch.setattr(mesh, "_gpu_expected", lambda: False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_autotune_level=2")
    assert mesh.use_gpu_xla_flags(compiling_for_gpu=True) == list(mesh.GPU_XLA_FLAGS)
    assert os.environ["XLA_FLAGS"].split()[0] == "--xla_gpu_autotune_level=2"
