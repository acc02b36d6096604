"""The planner against the compiler: `jshard plan --validate` builds small steps on fake CPU
devices and compares the estimate's memory with `compiled.memory_analysis()` (within 10%)
and its collective bytes with the compiled HLO's (exactly): the GPT and the Llama on every
`VALIDATION` case, the mixture of experts on every `MOE_VALIDATION` case (`validation_cases`),
each strategy on its example mesh (`EXAMPLE_MESHES`, which tests and `jshard bench strategies`
use too) or its default one. docs/planning.md shows the table.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jshard import hlo
from jshard.layout import Layout
from jshard.mesh import default_mesh, format_mesh, make_mesh, mesh_shape
from jshard.models import LLAMA_SIZES, DecoderConfig, GPTConfig, LlamaConfig, decoder, gpt_loss
from jshard.parallel.state import abstract_batch
from jshard.parallel.step import build_step
from jshard.planner.estimate import PlanInput, estimate
from jshard.planner.hardware import HARDWARE
from jshard.precision import precision as precision_policy
from jshard.rules import ShardingError, preset

# Where tests, `jshard bench strategies` and `jshard plan --validate` run each strategy:
# one mesh per preset on 8 devices, the combinations on one 2x2x2 mesh.
EXAMPLE_MESHES = {
    "dp": dict(data=8),
    "zero1": dict(fsdp=8),
    "zero2": dict(fsdp=8),
    "zero3": dict(fsdp=8),
    "dp+tp": dict(data=2, tensor=4),
    "dp+tp+sp": dict(data=2, tensor=4),
    "dp+fsdp": dict(data=2, fsdp=4),
    "fsdp+tp": dict(fsdp=4, tensor=2),
    "dp+fsdp+tp": dict(data=2, fsdp=2, tensor=2),
    "dp+fsdp+tp+sp": dict(data=2, fsdp=2, tensor=2),
    "dp+tp+sp-overlap": dict(data=2, tensor=4),
    "dp+pp": dict(data=2, stage=4),
    "fsdp+tp+pp": dict(fsdp=2, tensor=2, stage=2),
    "cp": dict(context=8),
    "dp+cp": dict(data=2, context=4),
    "dp+cp+tp": dict(data=2, context=2, tensor=2),
    "ep": dict(expert=8),
    "dp+ep": dict(data=2, expert=4),
    "fsdp+ep": dict(fsdp=2, expert=4),
    "dp+ep+tp": dict(data=2, expert=2, tensor=2),
}


def example_mesh(strategy: str, devices: int = 8) -> dict[str, int]:
    """`EXAMPLE_MESHES[strategy]` on `devices`: its outermost axis takes what the others leave.
    A strategy is found under any spelling of its preset ('dp+tp+cp' as 'dp+cp+tp')."""
    canonical = {preset(name).name: sizes for name, sizes in EXAMPLE_MESHES.items()}
    sizes = EXAMPLE_MESHES.get(strategy) or canonical.get(preset(strategy).name)
    if sizes is None:
        raise ShardingError(f"no example mesh for {strategy!r}; those with one: {', '.join(EXAMPLE_MESHES)}")
    outer, inner = next(iter(sizes)), math.prod(list(sizes.values())[1:])
    if devices % inner:
        raise ShardingError(f"the example mesh of {strategy!r} ({format_mesh(sizes)}) needs a multiple of "
                            f"{inner} devices, not {devices}")
    return {**sizes, outer: devices // inner}


# Every strategy on its example mesh (`EXAMPLE_MESHES`), each remat policy with and
# without tensor and sequence parallelism, and every pipeline schedule: (strategy,
# micro-batches, schedule, remat, mesh, precision, stage remat), mesh "example" or "default"
# (`mesh.default_mesh`); pipelines keep their residuals, and two recompute their stages; then
# rows per micro-batch per data shard where not 2.
VALIDATION = (
    ("dp", None, None, "none"), ("zero1", None, None, "none"), ("zero2", None, None, "none"),
    ("zero3", None, None, "none"), ("dp+tp", None, None, "none"), ("dp+tp+sp", None, None, "none"),
    ("dp+fsdp", None, None, "none"), ("fsdp+tp", None, None, "none"),
    ("dp+fsdp+tp", None, None, "none"), ("dp+fsdp+tp+sp", None, None, "none"), ("dp", None, None, "full"),
    ("dp", None, None, "selective"), ("dp+tp+sp", None, None, "full"), ("dp+tp+sp", None, None, "selective"),
    ("dp+tp+sp-overlap", None, None, "none"), ("dp+tp+sp-overlap", None, None, "full"),
    ("dp+pp", 4, "gpipe", "none"), ("dp+pp", 4, "1f1b", "none"), ("dp+pp", 4, "interleaved", "none", "default"),
    ("dp+pp", 4, "zb-h1", "none"),
    ("dp+pp", 4, "1f1b", "none", "example", "fp32", "full"), ("dp+pp", 4, "zb-h1", "none", "example", "fp32", "full"),
    # Mixed precision (bf16 params and compute, fp32 master): see `validate_one` for what is compared.
    ("dp", None, None, "none", "example", "mixed"), ("zero2", None, None, "none", "example", "mixed"),
    ("zero3", None, None, "none", "example", "mixed"), ("dp+fsdp+tp", None, None, "none", "example", "mixed"),
    # FP8 projections: ZeRO-3 gathers them in e4m3 and all-reduces their scales (under remat again).
    ("zero3", None, None, "none", "example", "fp8"), ("dp+fsdp+tp", None, None, "none", "example", "fp8"),
    ("zero3", None, None, "full", "example", "fp8"),
    # Context parallelism, ring and all-gathered, with 8 rows per data shard: at 2 the chunks are
    # so short that what is not per token (the optimizer's temporaries) dominates memory.
    ("cp", None, None, "none", "example", "fp32", None, 8), ("dp+cp+tp", None, None, "none", "example", "fp32", None, 8),
    ("dp+cp", None, None, "full", "example", "fp32", None, 8),
    ("dp+cp-gather", None, None, "none", "default", "fp32", None, 8),
)
# Expert parallelism on each of its example meshes, and once under full remat.
MOE_VALIDATION = (
    ("ep", None, None, "none"), ("dp+ep", None, None, "none"), ("fsdp+ep", None, None, "none"),
    ("dp+ep+tp", None, None, "none"), ("dp+ep", None, None, "full"),
)
VALIDATION_MODEL = GPTConfig(seq_len=64, embed=128, heads=4, mlp=512, layers=8)
# Both decoders run every VALIDATION case; the Llama's 8 query heads share 4 KV heads. The
# MOE_VALIDATION cases run on `moe-tiny` (2 layers, embed 64, 8 experts of mlp 128, top-2,
# capacity factor 1.25).
VALIDATION_MODELS = {"gpt": VALIDATION_MODEL,
                     "llama": LlamaConfig(seq_len=64, embed=128, heads=8, kv_heads=4, mlp=384, layers=8),
                     "moe": LLAMA_SIZES["moe-tiny"]}
MEMORY_TOLERANCE = 0.10
# XLA:GPU compiles with no device to autotune on, and at 128 tokens a device its heuristics run
# the tiny models' GEMMs as Triton split-K fusions whose float32 partial products (four times a
# weight's size, MBs) are temporaries no real model's GEMMs have: a constant that sets these
# models' peaks (docs/gpu-compile.md). A GPU target validates the same cases on the same models
# this many times as wide (embed, mlp) and as long (seq), where the per-token and per-param
# terms the planner models set memory as in real models.
GPU_VALIDATION_SCALE = 4
# And this many times as deep, 16 layers as Llama 3.2 1B: XLA:GPU packs its temporaries into one
# heap with gaps that no live-bytes model counts, on the `zero2` mixed rows 14-17% of the step's
# live peak at 8 layers and 11-12% at 16 (XLA's buffer assignment, docs/gpu-compile.md).
GPU_VALIDATION_DEPTH = 2


def validation_models(platform: str = "cpu") -> dict[str, DecoderConfig]:
    """`VALIDATION_MODELS`, or on "gpu" each `GPU_VALIDATION_SCALE` times as wide and long and
    `GPU_VALIDATION_DEPTH` times as deep."""
    if platform == "cpu":
        return VALIDATION_MODELS
    k, d = GPU_VALIDATION_SCALE, GPU_VALIDATION_DEPTH
    return {name: dataclasses.replace(c, embed=k * c.embed, mlp=k * c.mlp, seq_len=k * c.seq_len, layers=d * c.layers)
            for name, c in VALIDATION_MODELS.items()}


def validation_cases() -> list[tuple[tuple, str]]:
    """(case, key of `validation_models()`) for every row `jshard plan --validate` runs, in order."""
    return ([(case, model) for model in ("gpt", "llama") for case in VALIDATION]
            + [(case, "moe") for case in MOE_VALIDATION])


def model_name(config: DecoderConfig) -> str:
    """The validation table's model column: the decoder's family, MoE for one with experts."""
    return "MoE" if getattr(config, "experts", 0) else config.family


def validate_one(strategy: str, microbatches, schedule, remat: str, mesh: str = "example", precision: str = "fp32",
                 stage_remat: str | None = None, rows: int = 2, devices=None, model=VALIDATION_MODEL,
                 hardware: str = "cpu", grad_accum: int = 1) -> dict:
    """One VALIDATION case on `devices` (default: all): the strategy's example mesh with its
    outermost axis taking the rest, or its default mesh; `model` a GPT's or a Llama's config,
    under `precision` (`jshard.precision`), planned for `hardware` (a `HARDWARE` profile: the
    devices' kind), accumulating `grad_accum` micro-batches of `rows` rows a data shard. The step is built abstractly, so `devices` may be a GPU target's with no GPU
    here (`jshard.aot.target_devices`): then XLA's GPU compiler compiles it.

    Collective bytes are counted in the program's dtypes (`hlo.collectives`). Memory: the
    compiled total (arguments + outputs - donated + temporaries), except where XLA:CPU runs
    bf16 compute: it widens bf16 values to f32 in its temporaries (activations, gathered
    weights: twice what a GPU holds), so there the held state alone is compared, the
    planner's params + master + optimizer against the compiled arguments less the batch. XLA:GPU
    keeps bf16 bf16: there the totals are compared."""
    policy = precision_policy(precision)
    config = dataclasses.replace(model, remat=remat)
    devices = jax.devices() if devices is None else devices
    rules = preset(strategy)
    shape = example_mesh(strategy, len(devices)) if mesh == "example" else default_mesh(rules, len(devices))
    mesh = make_mesh(devices, **shape)
    layout = Layout.of(rules, mesh, schedule=schedule, microbatches=microbatches, micro_batch_size=rows,
                       precision=policy, stage_remat=stage_remat, grad_accum=grad_accum)
    est = estimate(PlanInput(config, layout, HARDWARE[hardware]))
    step = build_step(nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0))), optax.adamw(1e-3), gpt_loss, layout, mesh,
                      abstract=True)
    batch = abstract_batch(step.plan, (est["tokens_per_step"] // config.seq_len, config.seq_len + 1), jnp.int32)
    lowered = step.lower(step.state, batch)
    compiled = lowered.compile()
    ma = compiled.memory_analysis()
    measured = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
    # In the program's dtypes; a pipeline's sends as often as they run (the tick table's).
    ticks = step.tick_branches
    counted = hlo.bytes_by_kind(compiled.as_text(), lowered.as_text(), ticks and ticks.weights)
    predicted = dict(est["comm_bytes_per_step"])
    predicted_memory = est["memory_bytes_per_device"]["total"]
    compared = "total"
    if step.plan.platform == "cpu" and policy.compute != jnp.float32:
        compared = "state"
        predicted_memory = sum(est["memory_bytes_per_device"][k] for k in ("params", "master", "optimizer"))
        measured = ma.argument_size_in_bytes - est["memory_bytes_per_device"]["batch"]
    return dict(
        model=model_name(config), strategy=rules.name, mesh=format_mesh(mesh_shape(mesh)),
        schedule=(schedule or "-") + ("/full" if stage_remat == "full" else ""), remat=remat, precision=policy.name,
        memory_compared=compared, memory_predicted=predicted_memory, memory_compiled=measured,
        memory_rel_err=predicted_memory / measured - 1,
        comm_predicted=predicted, comm_compiled=counted, comm_exact=predicted == counted,
    )


def within_tolerance(result: dict) -> bool:
    return result["comm_exact"] and abs(result["memory_rel_err"]) <= MEMORY_TOLERANCE


def format_validation(results: list[dict]) -> str:
    lines = [f"{'model':<7}{'strategy':<18}{'mesh':<26}{'schedule':<13}{'remat':<10}{'precision':<10}{'memory est':>12}"
             f"{'compiled':>12}{'err':>8}  comm bytes by kind (est = compiled)"]
    for r in results:
        comm = ", ".join(f"{k} {v}" for k, v in sorted(r["comm_compiled"].items()))
        mark = "exact" if r["comm_exact"] else f"MISMATCH est {r['comm_predicted']}"
        state = " (state)" if r["memory_compared"] == "state" else ""
        lines.append(f"{r['model']:<7}{r['strategy']:<18}{r['mesh']:<26}{r['schedule']:<13}{r['remat']:<10}{r['precision']:<10}"
                     f"{r['memory_predicted']:>12}{r['memory_compiled']:>12}{r['memory_rel_err'] * 100:>7.1f}%{state}  {mark}: {comm}")
    return "\n".join(lines)
