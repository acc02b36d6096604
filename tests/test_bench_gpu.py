"""`jshard bench gpu` (`make gpu-check`) on CPU: its dry run end to end, its refusals, the trace
summary and kernel counts it reports; and the planner against what one H100 measured
(docs/results/, written by `jshard bench gpu` and `jshard bench step` on a lent GPU)."""

import gzip
import json
import pathlib

import pytest

from gpu_compiler import gpu_compile
from jshard import aot, hlo
from jshard.bench import gpu, trace
from jshard.cli import main

RESULTS = pathlib.Path(__file__).parent.parent / "docs" / "results"
XLA_SOFTMAX_CHECK = RESULTS / "gpu-check-h100-jax0.11.2-2026-11-26-softmax.json"


@pytest.mark.slow
def test_dry_run_writes_every_case(tmp_path, capsys):
    """Every case run on this CPU, the first profiled; where XLA:GPU is not installed (CI's first
    pass) each case says so instead of a deviceless program, not faked."""
    assert main(["bench", "gpu", "--dry", "--out", str(tmp_path), "--repeats", "2"]) == 0
    result = json.loads((tmp_path / "gpu-check.json").read_text())
    assert [c["case"] for c in result["cases"]] == [gpu.case_name(c) for c in gpu.DRY_CASES]
    for case in result["cases"]:
        assert case["step_s"] > 0 and case["plain_step_s"] > 0 and case["device_memory"] > 0
        if reason := aot.gpu_compiler_missing():
            assert case["deviceless"] == reason
    profiled = result["cases"][0]["profile"]
    assert profiled["device_events"] == 0 and set(profiled["steps"]) == set(trace.STEPS)  # annotations found, no kernels
    assert "no device kernels in the trace" in capsys.readouterr().out


@gpu_compile
def test_a_dry_case_is_compiled_for_an_h100_in_a_process_of_its_own(tmp_path):
    """Where XLA:GPU is installed (CI's second pass): the dry run's deviceless compile of a case
    (FP8's), in its own process with JAX on the CPU, read as the device's own program is."""
    case = gpu.DRY_CASES[-1]
    compiled = gpu.compile_deviceless([case], aot.target("h100x1"), gpu.DRY["seq"], lambda _: gpu.DRY["rows"],
                                      tmp_path)[gpu.case_name(case)]
    assert "error" not in compiled, compiled
    program = compiled["compiled"]
    assert program["attention"] == "xla" and program["kernels"]["fusion"] > 0
    assert program["memory"]["total"] > 0 and compiled["plan"]["predicted_step_s"] > 0


@pytest.mark.parametrize("flags, message", [
    ([], "JAX runs on cpu, not a GPU"),
    (["--dry", "--profile", "gpt-1b-bf16-cudnn"], "--profile gpt-1b-bf16-cudnn: not a case of this run"),
    (["--cases", "llama-3.2-1b-bf16-cudnn", "--profile", "gpt-1b-bf16-cudnn"], "not a case of this run"),
    (["--cases", "gpt-2"], "gpt-2: not a case"),
])
def test_bad_flags_are_one_line(flags, message, capsys):
    try:
        code = main(["bench", "gpu", *flags])
    except SystemExit as e:  # argparse's own refusals (a --cases name it does not know)
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def _trace(tmp_path, events) -> str:
    folder = tmp_path / "plugins" / "profile" / "run"
    folder.mkdir(parents=True)
    (folder / "host.trace.json.gz").write_bytes(gzip.compress(json.dumps({"traceEvents": events}).encode()))
    return str(tmp_path)


def test_trace_summary_gives_each_kernel_to_its_step(tmp_path):
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}}]
    steps = [{"ph": "X", "pid": 2, "name": "jshard step", "ts": 0, "dur": 100},
             {"ph": "X", "pid": 2, "name": "plain step", "ts": 200, "dur": 50}]
    kernels = [(0, 40, "nvjet_sm90_tst_128x256"), (30, 20, "loop_add_fusion"),  # overlapping: busy 50, not 60
               (60, 10, "cudnn_generated_fort_native_sdpa_sm90_flash_fprop"), (90, 5, "ncclDevKernel_AllReduce"),
               (210, 30, "gemm_fusion_dot_3"), (245, 10, "loop_convert_fusion"),  # runs 5 past its window's end
               (150, 10, "memcpy128")]  # in no step: dropped
    events = meta + steps + [{"ph": "X", "pid": 1, "name": n, "ts": ts, "dur": d} for ts, d, n in kernels]
    summary = trace.summarize(_trace(tmp_path, events))
    mine, plain = summary["steps"]["jshard step"], summary["steps"]["plain step"]
    assert summary["device_events"] == 7
    assert mine["kinds"] == {"matmul": 40e-6, "fusion": 20e-6, "attention": 10e-6, "collective": 5e-6}
    assert (mine["wall_s"], mine["busy_s"], mine["idle_s"], mine["kernels_per_step"]) == (100e-6, 65e-6, 35e-6, 4)
    assert plain["kinds"] == {"matmul": 30e-6, "fusion": 10e-6}
    assert plain["busy_s"] == 35e-6 and plain["idle_s"] == 15e-6  # the late kernel's busy time clipped at the close
    assert "device busy 65%" in trace.report(summary)


def test_a_folder_without_a_trace_is_one_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no \\*.trace.json.gz"):
        trace.summarize(str(tmp_path))


def test_kernel_counts_read_launches_by_kind():
    text = "\n".join([
        '%fusion.1 = bf16[4,8]{1,0} fusion(%p0), kind=kLoop, calls=%fused_computation',
        '%gemm = (bf16[8,8]{1,0}, s8[0]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"',
        '%fmha = (bf16[1,2]{1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax"',
        '%flash = f32[4]{0} custom-call(%q), custom_call_target="__gpu$xla.gpu.triton", backend_config={name = "f"}',
        '%sort = f32[4]{0} custom-call(%x), custom_call_target="my_sort"',
        '%add = f32[4]{0} add(%x, %y)',
    ])
    assert hlo.kernel_counts(text) == dict(fusion=1, cublas=1, cublas_fp8=0, cudnn=1, triton=1, other=1)


# -- the planner against the H100 ----------------------------------------------------------


# XLA's attention on one H100 (`jshard.nn.attn.xla_attention`, 2026-11-26): its score bytes are the mean of
# the two bf16 steps' (`timing.XLA_SCORE_BYTES`); the planner's other constants and the cuDNN
# steps: tests/test_step_time.py.
PREDICTION_TOLERANCE = 0.10


def _predicted(tmp_path, flags: list[str]) -> float:
    out = tmp_path / "plan.json"
    assert main(["plan", *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())["predicted_step_s"]


@pytest.mark.parametrize("case", json.loads(XLA_SOFTMAX_CHECK.read_text())["cases"], ids=lambda c: c["case"])
def test_planner_predicts_the_measured_h100_step_with_xlas_attention(case, tmp_path):
    model, precision, attention = case["case"].rsplit("-", 2)
    predicted = _predicted(tmp_path, ["--model", model, "--seq-len", str(case["seq"]), "--devices", "1",
                                      "--micro-batch-size", str(case["batch"]), "--precision", precision,
                                      "--attention", attention, "--hardware", "h100"])
    assert abs(case["step_s"] / predicted - 1) <= PREDICTION_TOLERANCE, (case["step_s"], predicted)
