"""The library end to end: a layout (a rules preset, a mesh), a GPT placed by it, the sharded step.

    .venv/bin/python examples/train_gpt.py [--layout "fsdp+tp+sp fsdp=4,tensor=2"]   # 8 fake CPU devices, or the GPUs
"""

import argparse

import numpy as np
import optax
from flax import nnx

import jshard
from jshard.models import GPT, GPTConfig, gpt_loss

jshard.use_fake_cpu_devices(8, unless_accelerated=True)
parser = argparse.ArgumentParser(description="train a small GPT laid out as a layout line")
for flag, default in [("layout", "dp+fsdp+tp data=2,fsdp=2,tensor=2"), ("steps", 30), ("batch-size", 16),
                      ("seq-len", 64), ("embed", 128), ("layers", 4)]:
    parser.add_argument(f"--{flag}", default=default, type=str if flag == "layout" else int)


def main(argv=None) -> None:
    args = parser.parse_args(argv)
    layout = jshard.Layout.parse(args.layout)  # strategy, mesh, pipeline (e.g. "pp+dp stage=2,data=4 m=4"), precision
    mesh = jshard.make_mesh(**dict(layout.mesh))
    config = GPTConfig(seq_len=args.seq_len, embed=args.embed, mlp=4 * args.embed, layers=args.layers)
    model = jshard.init(lambda: GPT(config, rngs=nnx.Rngs(0)), mesh, layout.rules)  # created in its shards
    print(jshard.describe(model, mesh, layout.rules))  # per param: names -> spec -> bytes per device
    step = jshard.build_step(model, optax.adamw(3e-3), gpt_loss, layout, mesh)
    rng, state, losses = np.random.default_rng(0), step.state, []
    for i in range(args.steps):  # the task: continue x, x+d, x+2d, ... (mod 256)
        start, stride = rng.integers(0, 256, (args.batch_size, 1)), rng.integers(1, 8, (args.batch_size, 1))
        state, loss = step(state, step.shard_batch((start + stride * np.arange(args.seq_len + 1)) % 256))
        losses.append(float(loss))
        print(f"step {i:3d}  loss {losses[-1]:.4f}")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {args.steps} steps")


if __name__ == "__main__":
    main()
