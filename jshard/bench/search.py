"""`jshard bench search`: the planner's ranking of layouts against the same layouts measured.

For a model and the rows a step trains on, `plan.search` ranks every layout of this host's
devices on their profile (fake CPU devices: the `cpu` one; an H100: `h100`); this bench takes
`count` of the layouts that fit, spread evenly over the ranking (the first, the last and those
between), builds each step as `jshard train` would (`build_step` with the layout's strategy,
mesh, remat, schedule, micro-batches and accumulation) and times it (median of `repeats`,
after a compile). It prints predicted against measured step time per layout, the Spearman rank
correlation of the two, and how far the planner's pick is from the measured best.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
from flax import nnx

from jshard.layout import Layout
from jshard.metrics import median_step_seconds
from jshard.models import DecoderConfig, decoder, gpt_loss
from jshard.parallel import build_step
from jshard.plan import search
from jshard.config import MODEL_FIELDS, model_config
from jshard.plan.estimate import Hardware, PlanInput


def plans_of(result: dict, hw: Hardware) -> list:
    """The `PlanInput` of each measured row of a `run` result, on profile `hw` (to plan again:
    `bench.fit.fit_host`): its layout line, at the run's precision where the line names none."""
    model = result["model"]
    config = model_config("llama-small" if model["kind"] == "Llama" else "small",
                          {k: model[k] for k in MODEL_FIELDS if k in model and k != "experts"}, seq_len=model["seq_len"])
    plans = []
    for row in result["rows"]:
        layout = Layout.parse(row["layout"])
        plans.append(PlanInput(config, dataclasses.replace(layout, precision=layout.precision or result["precision"]), hw))
    return plans


def spread(ranked: list, count: int) -> list:
    """`count` items of `ranked` at even steps from its first to its last (all, if fewer)."""
    if len(ranked) <= count:
        return list(ranked)
    return [ranked[round(i * (len(ranked) - 1) / (count - 1))] for i in range(count)]


def spearman(a, b) -> float:
    """Spearman's rank correlation of two sequences (no ties expected: times are real numbers)."""
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1])


def measure(candidate: search.Candidate, batch: np.ndarray, repeats: int) -> float:
    """The median step time of a candidate layout, built as `jshard train` builds its step."""
    p = candidate.plan
    step = build_step(decoder(p.model, nnx.Rngs(0)), optax.adamw(1e-3), gpt_loss, p.layout)
    tokens = step.shard_batch(batch)
    return median_step_seconds(step, tokens, repeats, step.lower(step.state, tokens).compile())


def run(config: DecoderConfig, hw: Hardware, batch_size: int, precision: str, reduce: str | None = None, count: int = 12,
        repeats: int = 5) -> dict:
    """Search, measure `count` layouts, compare; printed as it goes and returned as a dict."""
    found = search.search(config, jax.device_count(), hw, batch_size, precision, reduce)
    fits = [c for c in found if c.estimate and c.estimate["fits"]]
    chosen = spread(fits, count)
    batch = np.random.default_rng(0).integers(0, config.vocab, (batch_size, config.seq_len + 1))
    device = jax.devices()[0]
    print(f"# jshard bench search: {jax.device_count()} × {device.device_kind} ({device.platform}), {hw.name} profile; "
          f"{config.family} layers={config.layers} embed={config.embed} seq={config.seq_len}, {batch_size} rows a step; "
          f"{len(fits)} of {len(found)} layouts fit, {len(chosen)} measured (median of {repeats})")
    print(f"{'rank':>5}  {'layout':<64}{'predicted ms':>13}{'measured ms':>12}")
    rows = []
    for c in chosen:
        measured = measure(c, batch, repeats)
        rows.append(dict(rank=fits.index(c) + 1, layout=c.label, predicted_s=c.estimate["predicted_step_s"], measured_s=measured))
        print(f"{rows[-1]['rank']:>5}  {c.label:<64}{rows[-1]['predicted_s'] * 1e3:>13.2f}{measured * 1e3:>12.2f}",
              flush=True)
    predicted, measured = [r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]
    best = min(measured)
    result = dict(device=f"{jax.device_count()} x {device.device_kind}", profile=hw.name, model=dataclasses.asdict(config)
                  | {"dtype": str(config.dtype), "kind": config.family}, precision=precision, batch_size=batch_size, searched=len(found), fit=len(fits), rows=rows,
                  spearman=spearman(predicted, measured), pick_over_best=measured[0] / best)
    print(f"# Spearman rank correlation, predicted vs measured: {result['spearman']:.2f}; the planner's pick "
          f"(rank 1) measured {result['pick_over_best']:.2f} x the measured best")
    return result
