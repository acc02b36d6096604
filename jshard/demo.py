"""`jshard demo`: a small GPT trained for a few steps with params placed by a preset.

The main job until `jshard train` lands. It builds the mesh (8 fake CPU devices when no
accelerator is present), places the model and the AdamW state by the preset's rules, and
trains on a generated task (continue an arithmetic sequence mod 256) so the loss visibly
falls. The step is `jshard.parallel.build_step`: jit(shard_map) with the strategy's
collectives written out, derived from the rules.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jshard
from jshard.models import GPT, GPTConfig, gpt_loss
from jshard.parallel import build_step


def add_parser(commands) -> None:
    parser = commands.add_parser("demo", help="train a small GPT for a few sharded steps")
    parser.add_argument("--mesh", default="data=2,fsdp=2,tensor=2", help="axis sizes, e.g. data=2,fsdp=2,tensor=2")
    parser.add_argument("--preset", default="dp+fsdp+tp", help="strategy preset, e.g. dp, fsdp, tp+sp, dp+fsdp+tp")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per step when the preset pipelines (pp)")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fake-devices", type=int, default=8, help="CPU devices to fake when no accelerator is present")
    parser.set_defaults(run=run)


def sequence_batch(key, batch_size: int, length: int, vocab: int = 256):
    """Rows start at a random token and step by a random stride in 1..7, modulo `vocab`."""
    start_key, stride_key = jax.random.split(key)
    start = jax.random.randint(start_key, (batch_size, 1), 0, vocab)
    stride = jax.random.randint(stride_key, (batch_size, 1), 1, 8)
    return (start + stride * jnp.arange(length)) % vocab


def run(args) -> int:
    jshard.mesh.use_fake_cpu_devices_unless_accelerated(args.fake_devices)
    mesh = jshard.make_mesh(**jshard.mesh.parse_axis_sizes(args.mesh))
    rules = jshard.preset(args.preset)
    microbatches = args.microbatches if jshard.parallel.stage_axes(mesh, rules) else None
    jshard.parallel.check_plan(mesh, rules, gpt_loss, microbatches)
    config = GPTConfig(seq_len=args.seq_len)

    def make_model():
        return GPT(config, rngs=nnx.Rngs(args.seed))

    print(f"devices: {jax.device_count()} × {jax.devices()[0].device_kind}; mesh {jshard.mesh_shape(mesh)}")
    print(rules)
    model = jshard.init(make_model, mesh, rules)
    print(jshard.describe(model, mesh, rules))
    step = build_step(model, optax.adamw(args.lr), gpt_loss, mesh, rules, microbatches)

    keys = jax.random.split(jax.random.key(args.seed + 1), args.steps)
    batches = (sequence_batch(key, args.batch_size, args.seq_len + 1) for key in keys)
    # The same first batch on one device, unsharded: the sharded loss must match it.
    reference_loss = float(gpt_loss(make_model(), sequence_batch(keys[0], args.batch_size, args.seq_len + 1)))

    state, losses = step.state, []
    for i, tokens in enumerate(batches):
        start = time.perf_counter()
        state, loss = step(state, step.shard_batch(tokens))
        losses.append(float(loss))  # waits for the step
        if i % 5 == 0 or i == args.steps - 1:
            print(f"step {i:3d}  loss {losses[-1]:.4f}  {(time.perf_counter() - start) * 1e3:8.1f} ms")
    print(f"step-0 loss: sharded {losses[0]:.6f}, one device {reference_loss:.6f} "
          f"(relative difference {abs(losses[0] - reference_loss) / reference_loss:.1e})")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {args.steps} steps")
    return 0 if losses[-1] < losses[0] else 1
