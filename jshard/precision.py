"""Precision policies: which dtype each thing a step holds or moves is in.

    compute  activations and matmuls (the model config's `dtype`)
    param    params as the devices hold them, gather them (ZeRO-3) and differentiate them
    reduce   the gradient reduction: the all-reduce / reduce-scatter over the batch axes
    master   the copy the optimizer updates, in the optimizer's (ZeRO) layout, beside Adam's
             moments; None where the param is its own master

Four policies, by name (`--precision`):

    fp32   fp32 everywhere
    bf16   bf16 compute over fp32 params: the params are the master
    mixed  ZeRO's and Megatron's mixed precision: bf16 params and gradients on the devices,
           an fp32 master in the optimizer's layout, sharded by ZeRO-1/2/3 with Adam's moments.
           The update runs in fp32 on the shard and is cast to bf16 before it is gathered
           back. Per device, with Ψ params over N devices: DP 16Ψ, ZeRO-1 4Ψ + 12Ψ/N,
           ZeRO-2 2Ψ + 14Ψ/N (+ the fp32 gradient shard: 2Ψ/N more), ZeRO-3 16Ψ/N.
    fp8    `mixed`, with the projections' matmuls in FP8 (`jshard.nn.Linear` kernels: attention's
           and the MLP's, not the embedding, the head or a router): e4m3 forward, e5m2
           gradients, per-tensor current scaling (`jshard.nn.fp8`); ZeRO-3 gathers those
           weights in e4m3 (half of bf16's bytes). The same state as `mixed`.

Gradients are reduced in fp32 under `mixed` (`reduce`, or bf16 on request: half the bytes).
ZeRO-3's reduce-scatter is the transpose of its bf16 gather, so it always runs in the param
dtype; the planner's report says so.

A policy is jmp's idea (param / compute / output dtypes) with what jmp has no place for: the
reduction dtype and a master copy in the optimizer's layout. It is a dataclass here rather
than a jmp dependency because the casts it implies live in the step, which shards them;
optax's AdamW updates the master unchanged.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str
    compute: np.dtype
    param: np.dtype
    reduce: np.dtype
    master: np.dtype | None = None
    fp8: bool = False  # the projections' matmuls in FP8 (`jshard.nn.fp8`)

    def __post_init__(self):
        for field in ("compute", "param", "reduce", "master"):
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, jnp.dtype(value))

    def describe(self) -> str:
        """One line for reports: 'mixed: bf16 compute, bf16 params and grads, fp32 master, fp32 reduction'."""
        held = f"{self.param.name} params" + (f" and grads, {self.master.name} master" if self.master else "")
        compute = ("fp8 projections (e4m3 forward, e5m2 gradients), " if self.fp8 else "") + f"{self.compute.name} compute"
        return f"{self.name}: {compute}, {held}, {self.reduce.name} reduction"


PRECISIONS = {
    "fp32": Precision("fp32", jnp.float32, jnp.float32, jnp.float32),
    "bf16": Precision("bf16", jnp.bfloat16, jnp.float32, jnp.float32),
    "mixed": Precision("mixed", jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32),
    "fp8": Precision("fp8", jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32, fp8=True),
}
REDUCE_DTYPES = ("fp32", "bf16")


def precision(name: str | Precision | None, reduce: str | None = None) -> Precision | None:
    """The policy called `name` (a key of PRECISIONS), its reduction dtype replaced by `reduce`
    ('fp32' or 'bf16') when given. A Precision passes through; None stays None (the step
    keeps params as the model holds them)."""
    if name is None or isinstance(name, Precision):
        policy = name
    elif name not in PRECISIONS:
        raise ValueError(f"precision {name!r}: choose one of {', '.join(PRECISIONS)}")
    else:
        policy = PRECISIONS[name]
    if reduce is None:
        return policy
    if reduce not in REDUCE_DTYPES:
        raise ValueError(f"gradient reduction {reduce!r}: choose one of {', '.join(REDUCE_DTYPES)}")
    if policy is None:
        raise ValueError("a gradient reduction dtype needs a precision policy: give precision= too")
    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[reduce]
    return dataclasses.replace(policy, reduce=dtype, name=policy.name if dtype == policy.reduce else f"{policy.name}/{reduce}-reduce")
