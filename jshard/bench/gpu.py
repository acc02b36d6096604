"""`jshard bench gpu`: jshard on the GPU it runs on, checked end to end in one command.

For each case (model × precision × attention kernel, `CASES`):

  1. deviceless   the step compiled for this kind of GPU on the CPU, as on a machine with no
                  GPU (`deviceless_program`: what `jshard compile --target <kind>x1` compiles, in
                  a process of its own with JAX on the CPU): memory per device, kernels by
                  kind, attention's kernel, and `jshard plan`'s predicted step time
  2. on device    `bench.step_time.measure`: jshard's step against the plain Flax NNX + optax step,
                  timed in alternation; MFU against the datasheet and a measured matmul; both
                  programs as this device compiled them
  3. side by side deviceless memory / device memory, kernels and attention's kernel; measured
                  step time / predicted; jshard / plain step time; which of `TARGETS` it misses

One case is also profiled (`--profile`, the first by default): where its step's time went on
the device, by kernel kind (`bench.trace`). Everything lands in `<out>/gpu-check.json`; the
table is printed. A measurement, not a test: a missed target is reported, and the command
fails only where a case could not run.

`--dry` runs the same path on whatever JAX runs on here (a CPU in CI): tiny models, two
repeats; the deviceless compile where XLA's GPU compiler is installed, else noted as skipped.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import jax
import optax
from flax import nnx

from jshard import aot
from jshard.bench import step_time, trace
from jshard.app.config import model_config
from jshard.layout import Layout
from jshard.mesh import use_gpu_xla_flags
from jshard.models import decoder, gpt_loss
from jshard.planner.estimate import PlanInput, estimate
from jshard.planner.hardware import HARDWARE
from jshard.precision import precision as precision_policy

SEQ = 2048
# Rows per step, by attention kernel. The device holds both steps' states at once (they
# alternate): at 8 rows a 1B model's step alone compiles to 68 GiB of an H100's 80 (`jshard
# compile`), so 4. XLA's attention also keeps its f32 scores for backward (a Llama-3.2-1B's at
# 2 rows: 16 layers × 2 × 32 heads × 2048² × 4 B = 16 GiB; its step 66 GiB, out of memory on an
# H100 beside the plain step's state, as the deviceless compile foresaw), so 1.
ROWS = {"cudnn": 4, "xla": 1}
CASES = tuple((model, precision, attention) for model in ("llama-3.2-1b", "gpt-1b")
              for precision in ("bf16", "mixed", "fp8") for attention in ("cudnn", "xla"))
DRY_CASES = (("llama-tiny", "fp32", "xla"), ("tiny", "mixed", "xla"), ("tiny", "fp8", "xla"))
DRY = dict(seq=32, rows=8, repeats=2)
# The targets of a run (issue 38): device MFU of the datasheet at least, jshard / plain at most,
# |deviceless memory / device memory - 1| and |measured / predicted step - 1| at most.
TARGETS = dict(mfu_datasheet=0.50, overhead_ratio=1.02, memory_rel_err=0.05, prediction_rel_err=0.25)
# A device's kind, as JAX names it, to its one-GPU compile target (the SXM parts they describe).
KINDS = {"NVIDIA H100 80GB HBM3": "h100x1", "NVIDIA H200": "h200x1"}


def target_for(device) -> aot.Target | None:
    """The one-GPU compile target of this device's kind, None where jshard has none (a CPU)."""
    return aot.TARGETS.get(KINDS.get(device.device_kind, ""))


def case_name(case) -> str:
    """model-precision-attention, as `--cases` takes it."""
    return "-".join(case)


def deviceless_program(case, target: aot.Target, seq: int, rows: int) -> dict:
    """`case`'s step compiled for `target` by XLA's GPU compiler, beside the plan of the same step
    on its hardware: {"plan": `estimate`'s dict, "compiled": `GpuProgram.as_json()`}. JAX must
    be on the CPU (`aot.use_cpu_for_jax`): `compile_deviceless` runs it in a process of its own."""
    model, precision, attention = case
    config, policy = model_config(model, dict(attention=attention), seq_len=seq), precision_policy(precision)
    layout = Layout("dp", micro_batch_size=rows, precision=policy)
    plan = estimate(PlanInput(config, layout, HARDWARE[target.hardware]))
    program = aot.compile_step(nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0))), optax.adamw(1e-4), gpt_loss,
                               layout, target, (rows, seq + 1))
    return dict(plan=plan, compiled=program.as_json())


def compile_deviceless(cases, target: aot.Target, seq: int, rows, out: pathlib.Path) -> dict:
    """{case name: `deviceless_program`'s dict, or {"error": its process's last line}}: all cases
    at once, each in a process of its own with JAX on the CPU (as on a machine with no GPU) and
    this run's XLA_FLAGS, before any timing starts."""
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    running, results = {}, {}
    for case in cases:
        name = case_name(case)
        path, log = out / f"compile-{name}.json", out / f"compile-{name}.log"
        with open(log, "w") as f:
            command = [sys.executable, "-m", "jshard.bench.gpu", name, target.name, str(seq), str(rows(case)), str(path)]
            running[name] = (subprocess.Popen(command, env=env, stdout=f, stderr=subprocess.STDOUT), path, log)
    for name, (proc, path, log) in running.items():
        if proc.wait() == 0:
            results[name] = json.loads(path.read_text())
        else:
            lines = log.read_text().strip().splitlines()
            results[name] = dict(error=lines[-1] if lines else f"exit {proc.returncode}")
    return results


def _failure(e: Exception, deviceless: dict) -> str:
    """One line for a case that failed; out of memory with what the deviceless compile foresaw."""
    line = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if "RESOURCE_EXHAUSTED" in line and "compiled" in deviceless:
        memory = deviceless["compiled"]["memory"]
        line = (f"out of memory: jshard's step needs {memory['temporaries'] / 2**30:.2f} GiB of temporaries, "
                f"{memory['total'] / 2**30:.2f} GiB in all (the deviceless compile), beside the plain step's "
                f"state; fewer rows would fit ({line})")
    return line


def side_by_side(measured: dict, deviceless: dict) -> dict:
    """The device's figures beside the deviceless compile's and the plan's (module docstring, 3)."""
    device = measured["programs"]["jshard"]
    row = dict(device_memory=device["memory"]["total"], device_kernels=device["kernels"],
               device_attention=device["attention"])
    if "error" in deviceless:
        return row | dict(deviceless=deviceless["error"], targets_missed=_missed(measured, None, None))
    program, plan = deviceless["compiled"], deviceless["plan"]
    memory_rel_err = program["memory"]["total"] / device["memory"]["total"] - 1
    measured_over_predicted = measured["step_s"] / plan["predicted_step_s"]
    return row | dict(
        deviceless_memory=program["memory"]["total"], memory_rel_err=memory_rel_err,
        deviceless_kernels=program["kernels"], deviceless_attention=program["attention"],
        predicted_step_s=plan["predicted_step_s"], measured_over_predicted=measured_over_predicted,
        planned_memory=plan["memory_bytes_per_device"]["total"],
        targets_missed=_missed(measured, memory_rel_err, measured_over_predicted))


def _missed(measured: dict, memory_rel_err, measured_over_predicted) -> list[str]:
    """The `TARGETS` a case misses (those it has no figure for are not judged)."""
    checks = dict(mfu_datasheet=measured["mfu_datasheet"] is not None and measured["mfu_datasheet"] < TARGETS["mfu_datasheet"],
                  overhead_ratio=measured["overhead_ratio"] > TARGETS["overhead_ratio"],
                  memory_rel_err=memory_rel_err is not None and abs(memory_rel_err) > TARGETS["memory_rel_err"],
                  prediction_rel_err=measured_over_predicted is not None
                  and abs(measured_over_predicted - 1) > TARGETS["prediction_rel_err"])
    return [name for name, missed in checks.items() if missed]


def run(out: str, dry: bool = False, cases=None, repeats: int = 10, profile: str | None = "first") -> dict:
    """Every case (`cases`: names from CASES, default all), written to `<out>/gpu-check.json`;
    `profile`: the case also traced ("first": the first run; None: none)."""
    out_dir = pathlib.Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    chosen = DRY_CASES if dry else tuple(c for c in CASES if not cases or case_name(c) in cases)
    seq, repeats = (DRY["seq"], DRY["repeats"]) if dry else (SEQ, repeats)

    def rows_of(case) -> int:
        return DRY["rows"] if dry else ROWS[case[2]]

    device = jax.devices()[0]
    target = aot.TARGETS["h100x1"] if dry else target_for(device)
    started = time.perf_counter()
    if target and not aot.gpu_compiler_missing():
        deviceless = compile_deviceless(chosen, target, seq, rows_of, out_dir)
    else:
        reason = aot.gpu_compiler_missing() or f"no compile target for a {device.device_kind}"
        deviceless = {case_name(c): dict(error=reason) for c in chosen}
    compile_s = time.perf_counter() - started

    done = []

    def result():
        return dict(jax=jax.__version__, device=f"{device.device_kind} ({device.platform})", dry=dry, seq=seq,
                    repeats=repeats, target=target and target.name, deviceless_compile_s=compile_s,
                    targets=TARGETS, cases=done)

    for i, case in enumerate(chosen):
        model, precision, attention = case
        config = model_config(model, dict(attention=attention))
        traced = profile == case_name(case) or (profile == "first" and i == 0)
        trace_dir = str(out_dir / "profile") if traced else None
        try:
            measured = step_time.measure({"data": 1}, "dp", model, config, seq, rows_of(case), precision_policy(precision),
                                    repeats, trace_dir)
        except Exception as e:  # one case's failure (out of memory, say) must not lose the others
            foreseen = deviceless[case_name(case)].get("compiled", {}).get("memory")
            done.append(dict(case=case_name(case), batch=rows_of(case), error=_failure(e, deviceless[case_name(case)]),
                             deviceless_memory=foreseen))
            print(f"# {case_name(case)}: FAILED: {done[-1]['error']}", flush=True)
            continue
        row = dict(case=case_name(case), **{k: measured[k] for k in step_time.JSON_KEYS}, seq=seq, batch=rows_of(case))
        row |= side_by_side(measured, deviceless[case_name(case)])
        if trace_dir:
            row["profile"] = trace.summarize(trace_dir)
        done.append(row)
        print(case_report(row), flush=True)
        _write(out_dir, result())  # after each case: a run cut short keeps what it measured
    _write(out_dir, result())
    print(table(result()))
    return result()


def _write(out_dir: pathlib.Path, result: dict) -> None:
    (out_dir / "gpu-check.json").write_text(json.dumps(result, indent=1, default=str))


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def case_report(r: dict) -> str:
    lines = [f"# {r['case']}: {r['step_s'] * 1e3:.1f} ms/step, {r['tokens_per_s'] / 1e3:.1f} k tok/s, "
             f"MFU {_pct(r['mfu_datasheet'])} of datasheet, {_pct(r['mfu_measured_peak'])} of the measured "
             f"{r['matmul_tflops']:.3g} TFLOP/s matmul; jshard/plain {r['overhead_ratio']:.3f}"]
    if "deviceless_memory" in r:
        lines.append(f"  memory device {r['device_memory'] / 2**30:.2f} GiB, deviceless {r['deviceless_memory'] / 2**30:.2f} GiB "
                     f"({r['memory_rel_err']:+.1%}); kernels device {r['device_kernels']}, deviceless "
                     f"{r['deviceless_kernels']}; attention {r['device_attention']} / {r['deviceless_attention']}; "
                     f"step measured / predicted {r['measured_over_predicted']:.3f}")
    else:
        lines.append(f"  memory device {r['device_memory'] / 2**30:.2f} GiB; deviceless compile: {r['deviceless']}")
    if "profile" in r:
        lines.append(trace.report(r["profile"]))
    return "\n".join(lines)


def table(result: dict) -> str:
    head = (f"# jshard bench gpu: {result['device']}, jax {result['jax']}, seq {result['seq']}, "
            f"median of {result['repeats']}; targets: MFU >= {TARGETS['mfu_datasheet']:.0%}, jshard/plain <= "
            f"{TARGETS['overhead_ratio']}, memory within {TARGETS['memory_rel_err']:.0%}, prediction within "
            f"{TARGETS['prediction_rel_err']:.0%}")
    lines = [head, f"{'case':<26}{'rows':>5}{'ms':>9}{'MFU':>8}{'MFU/mm':>8}{'j/plain':>9}{'mem err':>9}"
                   f"{'meas/pred':>10}  missed"]
    for r in result["cases"]:
        if "error" in r:
            lines.append(f"{r['case']:<26}  FAILED: {r['error']}")
            continue
        pred = f"{r['measured_over_predicted']:.3f}" if "measured_over_predicted" in r else "-"
        mem = f"{r['memory_rel_err']:+.1%}" if "memory_rel_err" in r else "-"
        lines.append(f"{r['case']:<26}{r['batch']:>5}{r['step_s'] * 1e3:>9.1f}{_pct(r['mfu_datasheet']):>8}"
                     f"{_pct(r['mfu_measured_peak']):>8}{r['overhead_ratio']:>9.3f}{mem:>9}{pred:>10}  "
                     f"{', '.join(r['targets_missed']) or 'none'}")
    return "\n".join(lines)


if __name__ == "__main__":  # `compile_deviceless`'s worker: CASE TARGET SEQ ROWS OUT.json, JAX on the CPU
    name, target_name, seq, rows, out = sys.argv[1:]
    use_gpu_xla_flags(compiling_for_gpu=True)  # beside the run's own XLA_FLAGS (a flag it sets keeps its value)
    aot.use_cpu_for_jax()
    case = next(c for c in CASES + DRY_CASES if case_name(c) == name)
    pathlib.Path(out).write_text(json.dumps(deviceless_program(case, aot.target(target_name), int(seq), int(rows)),
                                            default=str))
