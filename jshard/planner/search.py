"""`jshard plan --search`: every layout of a model over some devices, ranked by predicted step time.

For a model, a device count, a hardware profile and the rows a step trains on (the global batch,
fixed: it is the optimizer's choice, not the layout's), `layouts` enumerates

    strategy families (`FAMILIES`: data, ZeRO-1/3, with or without TP / SP and a pipeline; for
      rows of `LONG_CONTEXT` tokens or more, also ZeRO-3 with each context-parallel variant,
      `CONTEXT_FAMILIES`)
    × every way to factor the devices over the family's mesh axes (each axis at least 2)
    × remat (none, selective, full) × rows per micro-batch (powers of two)
    × for a pipeline, the schedule (1F1B, interleaved, ZB-H1), its micro-batches filling the
      rows; else gradient accumulation filling them,

pruned by what a step refuses (TP over more GPUs than a node, or not dividing the heads; more
stages than layers, uneven splits placed as the step places them; a pipeline with fewer
micro-batches than stages; a sequence that the context axis does not cut, or all-to-all CP
over more devices than each one's heads), then `estimate`s each
and keeps those that fit in memory. The ranking is by predicted step time (the tokens are the
same for every layout); each row says what bounds it (`bottleneck`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from jshard.layout import Layout
from jshard.mesh import default_mesh
from jshard.planner.estimate import PlanInput, estimate
from jshard.planner.hardware import Hardware
from jshard.placement import format_bytes
from jshard.rules import CONTEXT_PRESETS, ShardingError, preset

FAMILIES = tuple(base + tensor + pipe for base in ("dp", "zero1", "fsdp", "dp+zero1", "dp+fsdp")
                 for tensor in ("", "+tp", "+sp") for pipe in ("", "+pp"))
# Context parallelism for long rows: ZeRO-3 (its shards over the context axis too), alone or with
# data parallelism and SP, by each variant: ring, all-gathered K/V, all-to-all (docs/strategies.md).
CONTEXT_FAMILIES = tuple(f"{base}{tensor}+{cp}" for base in ("fsdp", "dp+fsdp") for tensor in ("", "+sp")
                         for cp in CONTEXT_PRESETS)
# From how many tokens a row the search tries them: Llama 3 trained its long-context stage with CP
# (and its 8k stage without); below this a row's activations rarely set a step's memory.
LONG_CONTEXT = 16384
REMAT = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved", "zb-h1")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout the search tried: its input, and its estimate or why it was refused."""

    plan: PlanInput
    estimate: dict | None = None
    refused: str | None = None

    @property
    def layout(self) -> Layout:
        return self.plan.layout

    @property
    def label(self) -> str:
        """Its layout's line (`Layout.parse` takes it back; `--layout` in plan, compile, train)."""
        return str(self.layout)


def factorizations(devices: int, axes: tuple[str, ...]) -> list[dict[str, int]]:
    """Every {axis: size} over `axes`, each at least 2, whose sizes multiply to `devices`."""
    if not axes:
        return [{}] if devices == 1 else []
    out = []
    for size in range(2, devices + 1):
        if devices % size == 0:
            out += [{axes[0]: size} | rest for rest in factorizations(devices // size, axes[1:])]
    return out


def _refusal(config, sizes: dict[str, int], hw: Hardware, family: str = "") -> str | None:
    tensor, stages, context = sizes.get("tensor", 1), sizes.get("stage", 1), sizes.get("context", 1)
    if tensor > hw.gpus_per_node:
        return f"tensor={tensor} spans nodes ({hw.gpus_per_node} GPUs a node)"
    if config.heads % tensor or getattr(config, "kv_heads", config.heads) % tensor:
        return f"tensor={tensor} does not divide the heads"
    if config.layers < stages:
        return f"stage={stages} is more than the {config.layers} layers"
    a2a = family.endswith("cp-a2a")
    if config.seq_len % (context * (1 if a2a else 2)) or config.seq_len % (context * tensor):
        return f"context={context} does not cut the sequence into equal chunks"
    if a2a and (config.heads // tensor) % context:
        return f"context={context} does not divide each device's {config.heads // tensor} heads"
    return None


def layouts(config, devices: int, hw: Hardware, batch_size: int, precision: str | None = None, reduce: str | None = None,
            families=FAMILIES, remats=REMAT) -> list[PlanInput]:
    """Every layout to estimate (module docstring), before memory is known; each at `precision`
    (a `jshard.precision` name) with gradients reduced in `reduce` (None: the precision's)."""
    out = []
    if config.seq_len >= LONG_CONTEXT and families is FAMILIES:
        families = FAMILIES + CONTEXT_FAMILIES
    for family in families:
        axes = tuple(default_mesh(preset(family), devices))
        # (one device: the one layout, unsplit, as plain data parallelism)
        for sizes in factorizations(devices, axes) if devices > 1 else [{}] * (family == "dp"):
            if _refusal(config, sizes, hw, family):
                continue
            shards = sizes.get("data", 1) * sizes.get("fsdp", 1)
            if batch_size % shards:
                continue
            rows, stages = batch_size // shards, sizes.get("stage", 1)
            for remat, mb in itertools.product(remats, (2**i for i in range(int(math.log2(rows)) + 1))):
                if rows % mb:
                    continue
                common = dict(remat=remat, micro_batch_size=mb, precision=precision, reduce=reduce)
                if stages == 1:
                    out.append(PlanInput(config, Layout.of(family, sizes, **common, grad_accum=rows // mb), hw))
                    continue
                m = rows // mb
                for schedule in SCHEDULES:
                    virtual = 2 if schedule == "interleaved" else None
                    if m < stages or (virtual and config.layers < stages * virtual):
                        continue
                    out.append(PlanInput(config, Layout.of(family, sizes, **common, schedule=schedule, microbatches=m,
                                                           virtual=virtual), hw))
    return out


def search(config, devices: int, hw: Hardware, batch_size: int, precision: str | None = None, reduce: str | None = None,
           **within) -> list[Candidate]:
    """Every layout estimated, best first: those that fit by predicted step time, then the rest."""
    done = []
    for plan in layouts(config, devices, hw, batch_size, precision, reduce, **within):
        try:
            done.append(Candidate(plan, estimate(plan)))
        except (ShardingError, ValueError) as e:  # a layout the step refuses: kept, with why
            done.append(Candidate(plan, refused=str(e).splitlines()[0]))
    return sorted(done, key=lambda c: (c.estimate is None or not c.estimate["fits"],
                                       c.estimate["predicted_step_s"] if c.estimate else math.inf))


def pick(config, devices: int, hw: Hardware, batch_size: int, precision: str | None = None, reduce: str | None = None,
         remat: str = "none") -> tuple[Candidate, str]:
    """`--strategy auto`'s layout: the search's first that fits at the run's own `remat`, and a line
    saying what was picked, of how many. Where none fits, one error naming the smallest and what
    to change."""
    found = search(config, devices, hw, batch_size, precision, reduce, remats=(remat,))
    fits = [c for c in found if c.estimate and c.estimate["fits"]]
    if not fits:
        least = min((c for c in found if c.estimate), key=lambda c: c.estimate["memory_bytes_per_device"]["total"],
                    default=None)
        raise ShardingError(
            f"Layout.strategy auto: no layout of {devices} {hw.name} devices fits this model and {batch_size} rows a "
            f"step at Layout.remat {remat}" + (f" (the smallest, {least.label}, needs "
            f"{format_bytes(least.estimate['memory_bytes_per_device']['total'])})" if least else " (every one refused)")
            + ". Fix: Layout.remat full, fewer rows a step (PlanInput.batch_size), or more devices.")
    best = fits[0]
    return best, (f"{best.label}: the first of {len(fits)} layouts that fit ({len(found)} planned on the {hw.name} "
                  f"profile; jshard plan --search ranks them all), predicted {best.estimate['predicted_step_s'] * 1e3:.1f} "
                  "ms a step")


HOST_PARTS = {"compute": "the host's compute, every device's", "recompute": "recompute (remat's, a stage's)",
              "collective_calls": "the collectives' rendezvous", "pipeline_ticks": "the pipeline's ticks",
              "activations": "activations beyond the host's caches"}  # `timing.host_step_seconds`' parts


def bottleneck(est: dict) -> str:
    """What bounds a layout's step, in words: its largest share, and the bubble where there is one
    (on fake CPU devices: the host's largest part)."""
    step = est["predicted_step_s"]
    if est["host"]:
        name, t = max(est["host"]["seconds"].items(), key=lambda kv: kv[1])
        return f"{HOST_PARTS[name]} {t / step:.0%}"
    # (a pipeline's sends are its collective-permute row below)
    shares = {f"{name.replace('_', '-')} work": t for name, t in est["compute_terms"].items() if name != "pipeline_sends"}
    for row in est["collectives"]:
        where = "over the network" if row["link"] == "inter" else "in the node"
        shares[f"{row['kind']} over {row['axes']} {where}"] = shares.get(
            f"{row['kind']} over {row['axes']} {where}", 0) + row["seconds"]
    name, t = max(shares.items(), key=lambda kv: kv[1])
    words = f"{name} {t / step:.0%}"
    if est["bubble_fraction"] > 0.05:
        words += f", bubble {est['bubble_fraction']:.0%}"
    return words


def table(found: list[Candidate], top: int = 10) -> str:
    """The ranked layouts that fit, and the fastest of those that did not (why they lost)."""
    fits = [c for c in found if c.estimate and c.estimate["fits"]]
    lines = [f"{'#':>3}  {'layout':<72} {'GiB':>6} {'step ms':>9} {'MFU':>6}  bound by"]
    for i, c in enumerate(fits[:top], 1):
        e = c.estimate
        lines.append(f"{i:>3}  {c.label:<72} {e['memory_bytes_per_device']['total'] / 2**30:>6.1f} "
                     f"{e['predicted_step_s'] * 1e3:>9.1f} {e['predicted_mfu']:>6.1%}  {bottleneck(e)}")
    faster = [c for c in found if c.estimate and not c.estimate["fits"]
              and (not fits or c.estimate["predicted_step_s"] < fits[0].estimate["predicted_step_s"])]
    for c in sorted(faster, key=lambda c: c.estimate["predicted_step_s"])[:3]:
        e = c.estimate
        lines.append(f"  rejected: {c.label}: {e['predicted_step_s'] * 1e3:.1f} ms but "
                     f"{e['memory_bytes_per_device']['total'] / 2**30:.1f} GiB > {e['hardware']['hbm_bytes'] / 2**30:.0f} GiB")
    return "\n".join(lines)
