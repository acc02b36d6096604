"""What XLA:GPU keeps for backward per layer and token, compiled for 8 H100s with no GPU.

For each strategy, remat policy and attention kernel, jshard's GPT step is compiled by XLA's
GPU compiler (`jshard.aot`) at 2 and 4 layers, 2 and 4 rows per data shard; the double
difference of the compiled temporaries over layers and rows is the bytes one layer keeps per
token, printed in Korthikanti et al. 2022's unit, s·b·h bytes (their Table 2: 34 + 5as/h per
layer; tp: 10 + 24/t + 5as/(ht); tp + sp: (34 + 5as/h)/t; selective recompute 34/t; full 2).
(Not 1 and 2 rows: XLA packs a one-row step's buffers apart from the others', so from 1 row to
2 the double difference moves with XLA's heap, not with what a layer keeps.)
docs/gpu-compile.md holds the table. Needs the CUDA plugin (`make venv GPU_COMPILE=1`).

    python examples/gpu_activations.py [--embed 2048 --heads 16 --seq-len 2048] [--remat none ...]
                                       [--attention xla ...] [--json FILE]

Each row also gives the planner's figure for the same layer (`planner.memory.ACTIVATIONS["gpu"]`).
"""

import argparse
import dataclasses
import json

import jax.numpy as jnp
import optax
from flax import nnx

import jshard
from jshard import aot
from jshard.models import GPTConfig, decoder, gpt_loss
from jshard.planner.memory import ACTIVATIONS, activation_bytes_per_token_layer

# (strategy, mesh, rows per data shard -> global rows): one data-parallel, one tensor-parallel
STRATEGIES = (("dp", dict(data=8)), ("dp+tp", dict(tensor=8)), ("dp+tp+sp", dict(tensor=8)))


def kept_per_token_layer(config: GPTConfig, strategy: str, mesh: dict[str, int], target) -> tuple[float, str]:
    """Bytes per token per layer the compiled backward keeps, and the attention kernel compiled."""
    temps, kernel = {}, ""
    for layers in (2, 4):
        for rows in (2, 4):
            c = dataclasses.replace(config, layers=layers)
            program = aot.compile_step(nnx.eval_shape(lambda: decoder(c, nnx.Rngs(0))), optax.sgd(1e-3), gpt_loss,
                                       jshard.Layout.of(strategy, mesh, precision="bf16"), target,
                                       (rows * mesh.get("data", 1) * mesh.get("fsdp", 1), c.seq_len + 1))
            temps[layers, rows], kernel = program.memory["temporaries"], program.attention
    return ((temps[4, 4] - temps[4, 2]) - (temps[2, 4] - temps[2, 2])) / (4 * config.seq_len), kernel


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--embed", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--remat", nargs="+", choices=("none", "selective", "full"), default=("none", "selective", "full"))
    p.add_argument("--attention", nargs="+", choices=("xla", "cudnn"), default=("xla", "cudnn"))
    p.add_argument("--target", choices=aot.TARGETS, default="h100x8")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    jshard.mesh.use_gpu_xla_flags(compiling_for_gpu=True)
    target = aot.target(args.target)
    h, a, s = args.embed, args.heads, args.seq_len
    base = GPTConfig(vocab=1024, seq_len=s, embed=h, heads=a, mlp=4 * h, layers=2)
    rows = []
    print(f"{'strategy':<10}{'remat':<11}{'attention':<10}{'kept, s·b·h bytes':>18}{'planned':>9}")
    for strategy, mesh in STRATEGIES:
        for remat in args.remat:
            for attention in args.attention:
                config = dataclasses.replace(base, remat=remat, attention=attention)
                per_token, kernel = kept_per_token_layer(config, strategy, mesh, target)
                planned = activation_bytes_per_token_layer(dataclasses.replace(config, dtype=jnp.bfloat16),
                                                           mesh.get("tensor", 1), strategy.endswith("+sp"),
                                                           kernel == "cudnn", ACTIVATIONS["gpu"])
                rows.append(dict(strategy=strategy, remat=remat, attention=kernel, sbh=per_token / h,
                                 planned_sbh=planned / h, embed=h, heads=a, seq_len=s, target=target.name))
                print(f"{strategy:<10}{remat:<11}{kernel:<10}{per_token / h:>18.2f}{planned / h:>9.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
