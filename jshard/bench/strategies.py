"""`jshard bench strategies`: each strategy's explicit step against the textbook and XLA.

For every strategy and combination, on the current devices (8 fake CPU devices when no
accelerator is present), one GPT training step (AdamW) gives one row:

    comm_bytes         collectives compiled into the explicit step (HLO), K bytes per device, in
                       the program's dtypes (XLA:CPU widens bf16 collectives to f32: `jshard.hlo`)
    textbook_bytes     what the planner's formulas say the strategy moves (`jshard.planner.traffic`; under
                       --grad-accum N what runs per micro-batch N times: ZeRO-2/3's gradient
                       reduce-scatters, ZeRO-3's gathers, activations' collectives)
    memory_bytes_per_device  compiled.memory_analysis(): arguments + outputs - donated + temporaries
    textbook_memory_bytes    the planner's training state: params, grads and Adam's two moments in
                       their layouts, plus two gathered layers under ZeRO-3 (no activations)
    parity_rel_err     worst per-param relative error of the explicit step's gradients vs one device
    xla_comm_bytes     collectives compiled into the compiler-placed step (`build_step(...,
                       collectives="compiler")`: plain jax.jit, the same layouts, XLA's
                       partitioner choosing the collectives), counted as comm_bytes is
    xla_parity_rel_err as parity_rel_err, for the compiler-placed step's gradients
                       (the xla_ columns are empty under --precision mixed: that step holds
                       params as the model does)
    step_s             median time of the explicit step (jit of shard_map)
    gspmd_step_s       median time of the compiler-placed step
    speed_ratio        step_s / gspmd_step_s
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jshard
from jshard import hlo
from jshard import planner
from jshard.layout import Layout
from jshard.mesh import format_mesh, mesh_shape, parse_axis_sizes
from jshard.metrics import median_step_seconds
from jshard.models import DecoderConfig, decoder, gpt_loss
from jshard.parallel import ShardedStep, build_step
from jshard.precision import Precision
from jshard.planner.validate import EXAMPLE_MESHES, example_mesh

COLUMNS = ("strategy", "mesh", "comm_bytes", "textbook_bytes", "comm_ratio", "memory_bytes_per_device",
           "textbook_memory_bytes", "parity_rel_err", "xla_comm_bytes", "xla_parity_rel_err", "step_s",
           "gspmd_step_s", "speed_ratio")


def textbook_bytes(step: ShardedStep, config: DecoderConfig, batch_shape) -> int:
    """Bytes per device per step that the planner's formulas give for this step (`jshard.planner.traffic`)."""
    accum = step.plan.grad_accum  # what runs per micro-batch moves `accum` times (`planner.traffic`)
    local_rows = batch_shape[0] // step.data_shards // accum
    comm = planner.traffic(config, step.plan, local_rows, batch_shape[1] - 1, accum=accum)
    return sum(comm.values())


def textbook_memory(step: ShardedStep, config: DecoderConfig) -> int:
    """The planner's training state per device (`jshard.planner.state_bytes`): no activations."""
    return sum(planner.state_bytes(step.plan, config.layers, "cpu", config.remat).values())


def comm_bytes(lowered) -> int:
    """K bytes per device of every collective in a lowered step, compiled (HLO, loop trips
    counted), in the program's dtypes."""
    return sum(c.bytes * c.count for c in hlo.collectives(lowered.compile().as_text(), lowered.as_text()))


def parity(step, tokens, reference) -> float:
    """The worst per-param relative error (Frobenius) of `step`'s gradients vs one device's."""
    _, grads = step.value_and_grad(step.state, tokens)
    expected = dict(nnx.to_flat_state(reference))
    return max(
        float(np.linalg.norm(np.asarray(g.get_value()) - np.asarray(expected[path].get_value()))
              / np.linalg.norm(np.asarray(expected[path].get_value())))
        for path, g in nnx.to_flat_state(grads)
    )


def bench_strategy(preset: str, sizes: dict[str, int], config: DecoderConfig, batch, reference, repeats: int,
                   precision: Precision | None = None, grad_accum: int = 1) -> dict:
    mesh, rules = jshard.make_mesh(**sizes), jshard.preset(preset)
    tx = optax.adamw(1e-3)

    def make_model():
        return decoder(config, nnx.Rngs(0))

    layout = Layout.of(rules, mesh, precision=precision, grad_accum=grad_accum)
    step = build_step(make_model(), tx, gpt_loss, layout, mesh)
    tokens = step.shard_batch(batch)
    lowered = step.lower(step.state, tokens)
    memory = lowered.compile().memory_analysis()
    comm = comm_bytes(lowered)
    textbook = textbook_bytes(step, config, batch.shape)
    explicit_parity = parity(step, tokens, reference)
    row = dict(
        strategy=rules.name, mesh=format_mesh(mesh_shape(mesh)), comm_bytes=comm, textbook_bytes=textbook,
        comm_ratio=comm / textbook if textbook else float("nan"),
        memory_bytes_per_device=memory.argument_size_in_bytes + memory.output_size_in_bytes
        - memory.alias_size_in_bytes + memory.temp_size_in_bytes,
        textbook_memory_bytes=textbook_memory(step, config), parity_rel_err=explicit_parity,
        xla_comm_bytes=None, xla_parity_rel_err=None, step_s=None, gspmd_step_s=None, speed_ratio=None,
    )
    if not (step.precision and step.precision.master):  # the compiler-placed step holds params as the model does
        # (collective matmuls are the explicit step's: XLA places the same layouts' collectives itself)
        xla = build_step(make_model(), tx, gpt_loss, dataclasses.replace(
            layout, strategy=dataclasses.replace(rules, collective_matmul=False)), mesh, collectives="compiler")
        row.update(xla_comm_bytes=comm_bytes(xla.lower(xla.state, tokens)), xla_parity_rel_err=parity(xla, tokens, reference),
                   gspmd_step_s=median_step_seconds(xla, tokens, repeats))
    # Last: a timed step donates the step's initial state.
    row["step_s"] = median_step_seconds(step, tokens, repeats)
    if row["gspmd_step_s"]:
        row["speed_ratio"] = row["step_s"] / row["gspmd_step_s"]
    return row


def _cell(value, width: int, spec: str) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def format_row(row: dict) -> str:
    return (
        f"{row['strategy']:<21}{row['mesh']:<24}{row['comm_bytes']:>11}{row['textbook_bytes']:>11}"
        f"{row['comm_ratio']:>7.2f}{row['memory_bytes_per_device']:>11}{row['textbook_memory_bytes']:>11}"
        f"{row['parity_rel_err']:>10.1e}{_cell(row['xla_comm_bytes'], 11, '')}{_cell(row['xla_parity_rel_err'], 10, '.1e')}"
        f"{row['step_s'] * 1e3:>9.1f}{_cell(row['gspmd_step_s'] and row['gspmd_step_s'] * 1e3, 9, '.1f')}"
        f"{_cell(row['speed_ratio'], 7, '.2f')}"
    )


HEADER = (f"{'strategy':<21}{'mesh':<24}{'comm B':>11}{'textbook':>11}{'ratio':>7}{'memory B':>11}"
          f"{'textbook':>11}{'parity':>10}{'xla comm B':>11}{'xla par.':>10}{'step ms':>9}{'xla ms':>9}{'speed':>7}")


def run_strategies(config: DecoderConfig, policy: Precision, batch_size: int, repeats: int,
                   text: str | None = None, grad_accum: int = 1) -> list[dict]:
    """Every row of `jshard bench strategies` for the --strategies `text` (`strategies`), printed as it comes;
    each step accumulating `grad_accum` micro-batches of the batch (parity: against the whole batch's gradients)."""
    batch = np.random.default_rng(0).integers(0, config.vocab, (batch_size, config.seq_len + 1))
    # The reference: one device, fp32 throughout.
    reference = nnx.grad(gpt_loss)(decoder(dataclasses.replace(config, dtype=jnp.float32), nnx.Rngs(0)), batch)
    device = jax.devices()[0]
    print(f"# jshard bench strategies: {jax.device_count()} × {device.device_kind} ({device.platform}), {config.family} "
          f"layers={config.layers} embed={config.embed} heads={config.heads} seq={config.seq_len} batch={batch_size}"
          f"{f' in {grad_accum} accumulated micro-batches' if grad_accum > 1 else ''}, "
          f"AdamW, {policy.describe()}, median of {repeats}")
    if device.platform == "cpu":
        print("# fake CPU devices: times are threads of one process; bytes and memory are exact")
    pairs = strategies(text, jax.device_count(), experts=bool(getattr(config, "experts", 0)))
    if not text and not getattr(config, "experts", 0):
        left = [s for s in EXAMPLE_MESHES if _splits(jshard.preset(s), "experts") and not _splits(jshard.preset(s), "layers")]
        print(f"# {', '.join(left)}: left out, the model has no experts (--model moe-tiny runs them)")
    print(HEADER)
    rows = []
    for preset, sizes in pairs:
        rows.append(bench_strategy(preset, sizes, config, batch, reference, repeats, policy, grad_accum))
        print(format_row(rows[-1]), flush=True)
    return rows


def _splits(rules, name: str) -> bool:
    """Whether the rules split params' `name` dim: `layers` (a pipeline: not this bench's), `experts`."""
    return any(n == name and axes for n, axes in rules.table("param"))


def strategies(text: str | None, devices: int, experts: bool = True) -> list[tuple[str, dict[str, int]]]:
    """--strategies as (preset, mesh sizes) pairs, checked before any step is built; by default
    every preset without a pipeline (and, for a model without experts, without expert parallelism)."""
    entries = text.split(";") if text else [
        s for s in EXAMPLE_MESHES if not _splits(jshard.preset(s), "layers")
        and (experts or not _splits(jshard.preset(s), "experts"))]
    pairs = []
    for entry in filter(None, (e.strip() for e in entries)):
        preset, _, mesh_text = entry.partition("@")
        jshard.preset(preset)  # a bad name fails here, with the presets it knows
        pairs.append((preset.strip(), parse_axis_sizes(mesh_text) if mesh_text else example_mesh(preset.strip(), devices)))
    return pairs
