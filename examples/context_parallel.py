"""Per-device memory and bytes of context parallelism: one training step of one long row.

    .venv/bin/python examples/context_parallel.py                  # seq 4096 on 1, 2, 4, 8 devices
    .venv/bin/python examples/context_parallel.py --seq-len 8192 --json cp.json

A GPT (embed 64, 4 heads, 2 layers, fp32) trains on one row of --seq-len tokens, split over
cp = 1, 2, 4, 8 devices on the `context` axis: ring attention (`cp`) and all-gathered keys and
values (`cp-gather`); cp = 1 is one device without context parallelism (XLA's attention).
Per device it prints the compiled step's temporaries (`compiled.memory_analysis()`: the
activations kept for backward, attention scores, gradients and work buffers), their ratio to
one device's next to 1/cp, the planner's activations (`jshard.planner`), and the bytes the
attention's collectives move (the ring's collective-permutes; the gather's all-gathers and
reduce-scatters) next to the planner's formula.
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np
import optax
from flax import nnx

import jshard
from jshard import hlo
from jshard import planner
from jshard.models import GPTConfig, decoder, gpt_loss

jshard.use_fake_cpu_devices(8, unless_accelerated=True)

ATTENTION_KINDS = ("collective-permute", "all-gather", "reduce-scatter")  # params move none of these here


def measure(preset: str, cp: int, config: GPTConfig) -> dict:
    mesh = jshard.make_mesh(devices=jax.devices()[:cp], context=cp)
    step = jshard.build_step(decoder(config, nnx.Rngs(0)), optax.adamw(1e-3), gpt_loss,
                             jshard.Layout.of(preset, mesh), mesh)
    lowered = step.lower(step.state, step.shard_batch(np.zeros((1, config.seq_len + 1), np.int32)))
    compiled = lowered.compile()
    moved = sum(c.bytes * c.count for c in hlo.collectives(compiled.as_text(), lowered.as_text())
                if c.kind in ATTENTION_KINDS)
    sizes = jshard.mesh_shape(mesh)
    est = planner.estimate(planner.PlanInput(config, jshard.Layout.of(preset, sizes), planner.HARDWARE["cpu"]))
    predicted = sum(r["bytes"] for r in est["collectives"] if r["kind"] in ATTENTION_KINDS)
    return dict(preset=preset, cp=cp, temp=compiled.memory_analysis().temp_size_in_bytes,
                planned_activations=est["memory_bytes_per_device"]["activations"], bytes=moved, planned_bytes=predicted)


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--devices", default="1,2,4,8", help="cp sizes, comma-separated")
    p.add_argument("--json", help="write the rows to FILE")
    args = p.parse_args(argv)
    config = GPTConfig(seq_len=args.seq_len, embed=64, heads=4, mlp=256, layers=2)
    sizes = [int(n) for n in args.devices.split(",")]
    print(f"# GPT embed {config.embed}, {config.heads} heads, {config.layers} layers, fp32; one row of {args.seq_len} "
          f"tokens; {jax.device_count()} × {jax.devices()[0].platform}, jax {jax.__version__}")
    print(f"{'preset':<11}{'cp':>3}{'temp B':>13}{'× one':>8}{'1/cp':>7}{'planned act. B':>16}"
          f"{'attention comm B':>18}{'planned':>12}")
    one = measure("dp", 1, config) if 1 in sizes else None
    rows = [one] if one else []
    for preset in ("cp", "cp-gather"):
        rows += [measure(preset, n, config) for n in sizes if n > 1]
    for row in rows:
        ratio = f"{row['temp'] / one['temp']:8.3f}" if one else f"{'-':>8}"
        print(f"{row['preset']:<11}{row['cp']:>3}{row['temp']:>13}{ratio}{1 / row['cp']:>7.3f}"
              f"{row['planned_activations']:>16}{row['bytes']:>18}{row['planned_bytes']:>12}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(jax=jax.__version__, seq_len=args.seq_len, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
