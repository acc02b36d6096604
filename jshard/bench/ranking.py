"""`jshard bench search`: the planner's ranking of layouts against the same layouts measured.

For a model and the rows a step trains on, `plan.search` ranks every layout of this host's
devices on their profile (fake CPU devices: the `cpu` one; an H100: `h100`); this bench takes
`count` of the layouts that fit, spread evenly over the ranking (the first, the last and those
between; or with `seed`, drawn at random: the sample the CPU profile's constants are fitted
to), builds each step as `jshard train` would (`build_step` with the layout, whole) and
times them all in `rounds`: each round runs every layout in turn, keeping its fastest of
`repeats` steps (contention on a shared host only ever slows a step), and a layout's time is
the median of its rounds' (a burst of load on the host lands on one round of every layout, not
on one layout). Measured against itself this way, two runs of the small GPT's 16 layouts rank
them alike to 0.9+ where medians of 5 steps, one layout after the other, did to 0.74
(docs/planning.md). It prints predicted against measured step time per layout, the Spearman
rank correlation of the two, how far the planner's pick is from the measured best, and how
alike the run ranks the layouts against itself (`repeatability`: half its rounds against the
other half), the most any model of the step could be expected to agree with it. On fake CPU
devices each step's process CPU time is kept beside its wall time: `busy`, the share of the
host's cores its step kept busy (the devices' threads share them; what a step leaves idle,
waiting in its collectives' rendezvous with fewer threads runnable than cores, is not work
the FLOPs or bytes of any device can tell).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

from jshard.layout import Layout
from jshard.models import DecoderConfig, decoder, gpt_loss
from jshard.parallel import build_step
from jshard.planner import search
from jshard.app.config import MODEL_FIELDS, model_config
from jshard.planner.estimate import PlanInput, estimate
from jshard.planner.hardware import Hardware


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


def ranks(values) -> np.ndarray:
    """Each value's rank from 0, tied values sharing the mean of their ranks (the planner ties
    layouts that differ only in what it does not charge: their order is not its prediction)."""
    values = np.asarray(values)
    order = np.empty(len(values))
    order[np.argsort(values, kind="stable")] = np.arange(len(values))
    _, tie, counts = np.unique(values, return_inverse=True, return_counts=True)
    return (np.bincount(tie, order) / counts)[tie]


def spearman(a, b) -> float:
    """Spearman's rank correlation of two sequences: Pearson's of their `ranks`."""
    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def rank_again(result: dict, hw: Hardware) -> tuple[float, float]:
    """A `run` result ranked again on profile `hw`: the Spearman of its predicted step times
    against the measured ones, and the measured time of the layout it predicts fastest over the
    measured best."""
    predicted = np.array([estimate(p)["predicted_step_s"] for p in plans_of(result, hw)])
    measured = np.array([r["measured_s"] for r in result["rows"]])
    return spearman(predicted, measured), float(measured[np.argmin(predicted)] / measured.min())


def repeatability(rounds_s: list[list[float]]) -> float | None:
    """How alike a run ranks its layouts against itself: the rounds split in two halves (every
    way to take half of them, rounded down), each layout's median over either half, the
    Spearman of the two halves' times, their mean over the splits. A model of the step can
    agree with the measurement no better than the measurement agrees with itself (on this
    2-core host it fell to 0.75 in a run whose rounds were 11% apart). None under two rounds."""
    times = np.asarray(rounds_s)
    n = times.shape[1]
    if n < 2:
        return None
    halves = [list(a) for a in itertools.combinations(range(n), n // 2)]
    return float(np.mean([spearman(np.median(times[:, a], 1), np.median(np.delete(times, a, 1), 1)) for a in halves]))


class Timed:
    """A candidate layout's step built as `jshard train` builds it, compiled once, its state
    carried from one timing to the next (a step donates its state)."""

    def __init__(self, candidate: search.Candidate, batch: np.ndarray):
        p = candidate.plan
        step = build_step(decoder(p.model, nnx.Rngs(0)), optax.adamw(1e-3), gpt_loss, p.layout)
        self.tokens = step.shard_batch(batch)
        self.compiled, self.state = step.lower(step.state, self.tokens).compile(), step.state

    def best(self, repeats: int) -> tuple[float, float]:
        """The fastest of `repeats` steps (after one untimed): its wall and the process's CPU seconds."""

        def once():
            # The whole step, its update too: a step's collectives that need no state (a lookup's
            # ids gathered) would otherwise start beside the last step's, and two multi-device
            # runs at once can deadlock in XLA:CPU's rendezvous (jax 0.10.2).
            self.state, loss = self.compiled(self.state, self.tokens)
            jax.block_until_ready((self.state, loss))

        once()
        timed = []
        for _ in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            once()
            timed.append((time.perf_counter() - wall, time.process_time() - cpu))
        return min(timed)


def measure(candidates: list, batch: np.ndarray, repeats: int, rounds: int) -> list[list[tuple[float, float]]]:
    """Each candidate's fastest of `repeats` steps in each of `rounds` (wall and CPU seconds),
    the layouts taking turns within each round (its step time: their median)."""
    built = [Timed(c, batch) for c in candidates]
    times = [[] for _ in built]
    for _ in range(rounds):
        for timed, mine in zip(built, times):
            mine.append(timed.best(repeats))
    return times


def busy(rounds: list[tuple[float, float]], cores: int) -> float:
    """The share of the host's `cores` a layout's steps kept busy: the median over its rounds of
    CPU seconds over wall seconds × cores."""
    return statistics.median(cpu / (wall * cores) for wall, cpu in rounds)


def drawn(ranked: list, count: int, seed: int) -> list:
    """`count` items of `ranked` drawn at random with `seed` (all, if fewer), in its order."""
    if len(ranked) <= count:
        return list(ranked)
    return [ranked[i] for i in sorted(np.random.default_rng(seed).choice(len(ranked), count, replace=False))]


def run(config: DecoderConfig, hw: Hardware, batch_size: int, precision: str, reduce: str | None = None, count: int = 12,
        repeats: int = 3, rounds: int = 3, seed: int | None = None) -> dict:
    """Search, measure `count` layouts (spread over the ranking, or drawn at random with `seed`),
    compare; printed as it goes and returned as a dict."""
    found = search.search(config, jax.device_count(), hw, batch_size, precision, reduce)
    fits = [c for c in found if c.estimate and c.estimate["fits"]]
    chosen = spread(fits, count) if seed is None else drawn(fits, count, seed)
    batch = np.random.default_rng(0).integers(0, config.vocab, (batch_size, config.seq_len + 1))
    device = jax.devices()[0]
    print(f"# jshard bench search: {jax.device_count()} × {device.device_kind} ({device.platform}), {hw.name} profile; "
          f"{config.family} layers={config.layers} embed={config.embed} seq={config.seq_len}, {batch_size} rows a step; "
          f"{len(fits)} of {len(found)} layouts fit, {len(chosen)} measured (the median over {rounds} rounds of the "
          f"fastest of {repeats} steps)")
    host = device.platform == "cpu"  # the devices' threads share this host's cores
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{'rank':>5}  {'layout':<72}{'predicted ms':>13}{'measured ms':>12}" + (f"{'host busy':>10}" if host else ""))
    rows = []
    for c, timed in zip(chosen, measure(chosen, batch, repeats, rounds)):
        rounds_s = [wall for wall, _ in timed]
        rows.append(dict(rank=fits.index(c) + 1, layout=c.label, predicted_s=c.estimate["predicted_step_s"],
                         measured_s=statistics.median(rounds_s), rounds_s=rounds_s))
        if host:
            rows[-1].update(rounds_cpu_s=[cpu for _, cpu in timed], busy=busy(timed, cores))
        print(f"{rows[-1]['rank']:>5}  {c.label:<72}{rows[-1]['predicted_s'] * 1e3:>13.2f}"
              f"{rows[-1]['measured_s'] * 1e3:>12.2f}" + (f"{rows[-1]['busy']:>10.0%}" if host else ""), flush=True)
    predicted, measured = [r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]
    best, pick = min(measured), min(rows, key=lambda r: r["rank"])  # (rank 1, but for a random draw)
    result = dict(device=f"{jax.device_count()} x {device.device_kind}", profile=hw.name, cores=cores if host else None,
                  model=dataclasses.asdict(config) | {"dtype": str(config.dtype), "kind": config.family},
                  precision=precision, batch_size=batch_size,
                  searched=len(found), fit=len(fits), selection="spread" if seed is None else f"random, seed {seed}",
                  rows=rows, spearman=spearman(predicted, measured), pick_over_best=pick["measured_s"] / best,
                  repeatability=repeatability([r["rounds_s"] for r in rows]))
    print(f"# Spearman rank correlation, predicted vs measured: {result['spearman']:.2f}; the planner's pick "
          f"(rank {pick['rank']}) measured {result['pick_over_best']:.2f} x the measured best")
    if result["repeatability"] is not None:
        print(f"# the measurement against itself (half its rounds against the other half, Spearman): "
              f"{result['repeatability']:.2f}")
    return result
