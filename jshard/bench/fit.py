"""The planner's two fitted GPU constants from measured steps (`jshard bench fit RUNS.json`).

A step's time in the planner is linear in its memory-bound bytes per element (`Hardware.
elementwise_layer_bytes`, per token, layer and element of embed + mlp; `elementwise_logit_bytes`,
per token and vocabulary entry): everything else (GEMMs on the measured sweep, attention, the
optimizer's pass, launches) comes from `plan.physics` and datasheets. So the two are fitted by
least squares over measured steps (a `jshard bench step` results file: `{"runs": [{"plan_command",
"result": {"step_s"}}]}`), and each step is then predicted by a fit that left it out: the check
that the model predicts what it was not fitted on.

Given a `jshard bench search --json` result instead, the CPU profile's five host constants
(`HOST_FIELDS`: what fake CPU devices' steps cost their shared host, `timing.host_step_seconds`)
by least squares over its layouts (`fit_host`); `--check OTHER.json ...` ranks other search
results with them (Spearman against measured, the pick over the measured best): the check on
layouts the fit did not see.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jshard.planner.estimate import PlanInput, estimate

FIELDS = ("elementwise_layer_bytes", "elementwise_logit_bytes")


def _predict(plan: PlanInput, **constants) -> float:
    return estimate(dataclasses.replace(plan, hardware=dataclasses.replace(plan.hardware, **constants)))["predicted_step_s"]


def features(plans: list[PlanInput], measured: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(X, y): per step, the seconds one byte of each constant adds to its prediction, and the
    measured step less what the planner predicts with both at zero."""
    zero = {f: 0.0 for f in FIELDS}
    base = np.array([_predict(p, **zero) for p in plans])
    x = np.array([[_predict(p, **zero | {f: 1.0}) for f in FIELDS] for p in plans]) - base[:, None]
    return x, measured - base


def fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.linalg.lstsq(x, y, rcond=None)[0]


def left_out(x: np.ndarray, y: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """measured / predicted for each step by the constants fitted on the others."""
    out = []
    for i in range(len(y)):
        keep = np.arange(len(y)) != i
        out.append(measured[i] / (measured[i] - y[i] + x[i] @ fit(x[keep], y[keep])))
    return np.array(out)


def report(names: list[str], plans: list[PlanInput], measured: np.ndarray) -> str:
    x, y = features(plans, measured)
    constants = fit(x, y)
    lines = [f"# fitted over {len(plans)} steps: " + ", ".join(f"{f} = {c:.1f}" for f, c in zip(FIELDS, constants)),
             f"{'step':<96} {'measured ms':>11} {'fitted':>7} {'left out':>9}"]
    for name, m, all_in, out in zip(names, measured, measured / (measured - y + x @ constants), left_out(x, y, measured)):
        lines.append(f"{name:<96} {m * 1e3:>11.1f} {all_in:>7.3f} {out:>9.3f}")
    return "\n".join(lines)


# --- fake CPU devices: the host's constants -------------------------------------------------

HOST_FIELDS = ("matmul_efficiency", "recompute_share", "call_s", "tick_s", "activation_traffic")


def host_features(plans: list[PlanInput]) -> np.ndarray:
    """Per layout the five things its step is linear in (`timing.host_step_seconds`): its compute
    and remat's recompute at the host's peak (matmul efficiency 1), its devices' collective calls
    and pipeline ticks, and the spill of their activations (`Hardware.spill_seconds`)."""
    rows = []
    for p in plans:
        bare = dataclasses.replace(p.hardware, matmul_efficiency=1.0, recompute_share=1.0)
        host = estimate(dataclasses.replace(p, hardware=bare))["host"]
        rows.append([host["seconds"]["compute"], host["seconds"]["recompute"], host["calls"], host["ticks"],
                     host["activation_spill_s"]])
    return np.array(rows, dtype=float)


def fit_host(plans: list[PlanInput], measured: np.ndarray) -> dict:
    """The CPU profile's `HOST_FIELDS` by least squares over measured layouts (`jshard bench
    search --json` rows), each layout's error relative to its time (a ranking compares ratios):
    the compute's coefficient is 1 / the host's matmul efficiency, the recompute's that over the
    compute's (`recompute_share`, at the same efficiency)."""
    features = host_features(plans)
    compute, recompute, call_s, tick_s, traffic = np.linalg.lstsq(features / measured[:, None],
                                                                  np.ones(len(measured)), rcond=None)[0]
    return dict(matmul_efficiency=1 / compute, recompute_share=recompute / compute, call_s=call_s, tick_s=tick_s,
                activation_traffic=traffic)
