"""A mixture of experts: top-k routing with a capacity per row, experts stacked on `experts`.

    x (batch, seq, embed)
      -> router: softmax over experts, in float32; each token's top k experts, gated by their
         probabilities (renormalised over the k when k > 1, as Mixtral; Switch's raw for k = 1)
      -> each row's token choices into (expert, slot) places: first choices of the whole row
         before second ones (GShard), in token order; a choice past an expert's `capacity`
         slots is dropped (the residual stream carries that token on)
      -> buffer (experts, batch, capacity, embed) -> each expert's SwiGLU on its slots
      -> back to the tokens, each choice weighted by its gate

Capacity is per row, C = ceil(capacity_factor · k · seq / experts): which choices are dropped
depends on the row alone, so it is the same on one device and on every mesh (but under
context parallelism, whose chunk order the step refuses to queue by: `parallel/plan.py`).
`capacity_factor=None` is dropless: C = seq, the most one expert can be chosen in a row.

Expert parallelism follows from the names alone. The buffer is built where its rows are
(`TOKEN_SIDE`: `experts` whole, `batch` over the batch axes, `expert` among them) and computed
where the experts are (`EXPERT_SIDE`: `experts` over `expert`, `batch` over the other batch
axes); `nn.relayout` between the two is one all-to-all over `expert` and one back, each
device sending (ep-1)/ep of its buffer. The experts' weights are split over `expert` and
never move; under ZeRO-3 they are gathered over `fsdp` like any weight, under tensor
parallelism their `mlp` is split as the dense MLP's.

Load balancing (Switch Transformer): balance = E · Σ_e f_e · P_e, with f_e the fraction of
token choices routed to expert e (before dropping) and P_e its mean router probability,
over the tokens of one forward (in a pipeline: one micro-batch). Its gradient, times the
config's `balance_loss` weight, is added in backward (`nn.with_loss_gradient`, as Megatron's
MoEAuxLossAutoScaler does), so the loss a step reports stays the language model's;
`router_stats` reports the balance, the experts' load and the dropped choices.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jshard import nn, vma
from jshard.nn.layouts import layout
from jshard.nn.step_context import in_step

MOE_IN = ("batch", None, "embed")  # whole rows: a row's choices queue for its experts' slots
TOKEN_SIDE = (None, "batch", None, "embed")  # (experts, batch, capacity, embed) where the rows are
EXPERT_SIDE = ("experts", "batch", None, "embed")  # ... where the experts are
EXPERT_HIDDEN = ("experts", "batch", None, "mlp")


def check(experts: int, top_k: int, capacity_factor: float | None, where: str = "MoE") -> None:
    """ValueError unless each token can pick top_k distinct experts and slots are positive."""
    if not 1 <= top_k <= experts:
        raise ValueError(f"{where}: top_k={top_k} must be between 1 and experts={experts}")
    if capacity_factor is not None and capacity_factor <= 0:
        raise ValueError(f"{where}: capacity_factor={capacity_factor} must be positive, or None (dropless)")


def capacity(seq: int, experts: int, top_k: int, capacity_factor: float | None) -> int:
    """Slots per expert per row: ceil(factor · k · seq / experts), at most seq; seq if dropless."""
    if capacity_factor is None:
        return seq
    return min(seq, math.ceil(capacity_factor * top_k * seq / experts))


@dataclasses.dataclass(frozen=True)
class Routing:
    """Where each of a row's token choices goes. All (batch, seq, k) but `slot_token`."""

    expert: jax.Array  # the chosen expert
    gate: jax.Array  # its weight in the token's output (float32)
    kept: jax.Array  # whether the choice got a slot (False: dropped)
    slot: jax.Array  # expert · C + its place in the expert's queue (meaningful where kept)
    slot_token: jax.Array  # (batch, experts · C): the token in each slot; seq where the slot is empty
    probs: jax.Array  # (batch, seq, experts) router probabilities (float32)


def route(logits: jax.Array, top_k: int, slots: int) -> Routing:
    """Top-k routing of (batch, seq, experts) logits into `slots` places per expert and row."""
    rows, seq, experts = logits.shape
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    top_p, expert = lax.top_k(probs, top_k)
    gate = top_p / top_p.sum(-1, keepdims=True) if top_k > 1 else top_p
    chosen = jax.nn.one_hot(expert, experts, dtype=jnp.int32)  # (batch, seq, k, experts)
    queue = chosen.transpose(0, 2, 1, 3).reshape(rows, top_k * seq, experts)  # first choices first
    place = ((jnp.cumsum(queue, axis=1) - 1) * queue).sum(-1).reshape(rows, top_k, seq).transpose(0, 2, 1)
    kept = place < slots
    slot = expert * slots + place
    # Scatter each kept choice's token index into its slot; dropped ones go to a spare last slot.
    target = vma.where(kept, slot, experts * slots)
    axes = vma.varying_axes(target)
    tokens = vma.vary(jnp.broadcast_to(jnp.arange(seq)[None, :, None], expert.shape), axes)
    empty = vma.vary(jnp.full((rows, experts * slots + 1), seq), axes)
    slot_token = empty.at[jnp.arange(rows)[:, None, None], target].set(tokens)[:, :-1]
    return Routing(expert, gate, kept, slot, slot_token, probs)


def _total_over_rows(x: jax.Array) -> jax.Array:
    """x summed over dim 0, the rows: of the whole batch, summing over the batch axes in a step."""
    x = x.sum(0)
    if in_step():
        axes = layout(("batch",))[0]
        x = lax.psum(vma.vary(x, axes), axes) if axes else x
    return x


def balance(routing: Routing) -> tuple[jax.Array, jax.Array]:
    """(this forward's balance loss as this device adds it, the experts' load f).

    f is the whole batch's (counts summed over the batch axes); P this device's rows' mean,
    so that the devices' mean of E · Σ f · P is the whole batch's balance and its gradient
    reaches each device's router through its own rows."""
    rows, seq, top_k = routing.expert.shape
    experts = routing.probs.shape[-1]
    counts = jax.nn.one_hot(routing.expert, experts, dtype=jnp.float32).sum((1, 2))  # (batch, experts)
    load = _total_over_rows(counts)
    load = load / load.sum()
    mean_prob = routing.probs.mean((0, 1))
    return experts * jnp.sum(load * mean_prob), load


# -- the layer ----------------------------------------------------------------------------------


class MoE(nnx.Module):
    """A mixture of `experts` SwiGLU MLPs (embed -> mlp -> embed each), top-`top_k` routed."""

    def __init__(self, embed: int, mlp: int, experts: int, top_k: int, capacity_factor: float | None,
                 balance_weight: float, *, rngs: nnx.Rngs, kernel_init=nnx.initializers.normal(0.02),
                 dtype=None):
        check(experts, top_k, capacity_factor)
        self.experts, self.top_k, self.capacity_factor, self.balance_weight = experts, top_k, capacity_factor, balance_weight
        self.router = nn.Linear(embed, experts, in_names="embed", out_names=None, kernel_init=kernel_init,
                                dtype=jnp.float32, rngs=rngs, fp8=False)
        linear = dict(kernel_init=kernel_init, dtype=dtype, rngs=rngs)
        self.gate_up = nn.Linear((experts, embed), (2, mlp), in_names=("experts", "embed"), out_names=(None, "mlp"),
                                 **linear)
        self.down = nn.Linear((experts, mlp), embed, in_names=("experts", "mlp"), out_names="embed", **linear)

    def __call__(self, x: jax.Array, names=("batch", "seq", "embed"), dropless: bool = False) -> jax.Array:
        return self.forward(x, names, dropless)[0]

    def forward(self, x: jax.Array, names=("batch", "seq", "embed"), dropless: bool = False) -> tuple[jax.Array, dict]:
        """(output named as x, router statistics: balance, load (experts,), dropped fraction)."""
        x = nn.relayout(x, names, MOE_IN)
        rows, seq, _ = x.shape
        slots = capacity(seq, self.experts, self.top_k, None if dropless else self.capacity_factor)
        routing = route(self.router(x, MOE_IN), self.top_k, slots)
        balance_loss, load = balance(routing)
        dropped = 1 - _total_over_rows(routing.kept.sum((1, 2)).astype(jnp.float32)) / (
            _total_over_rows(jnp.full((rows,), seq * self.top_k, jnp.float32)))

        # Dispatch: each slot's token (a zero row where the slot is empty), experts first.
        padded = jnp.concatenate([x, vma.zeros_like(x[:, :1])], axis=1)
        buffer = jnp.take_along_axis(padded, routing.slot_token[..., None], axis=1)
        buffer = buffer.reshape(rows, self.experts, slots, -1).transpose(1, 0, 2, 3)
        buffer = nn.relayout(buffer, TOKEN_SIDE, EXPERT_SIDE)  # to the experts' devices

        gate_up = self.gate_up(buffer, EXPERT_SIDE)
        y = self.down(nn.swiglu(gate_up[..., 0, :], gate_up[..., 1, :]), EXPERT_HIDDEN)

        y = nn.relayout(y, EXPERT_SIDE, TOKEN_SIDE)  # back to the rows' devices
        y = y.transpose(1, 0, 2, 3).reshape(rows, self.experts * slots, -1)
        place = vma.where(routing.kept, routing.slot, 0).reshape(rows, seq * self.top_k, 1)
        chosen = jnp.take_along_axis(y, place, axis=1).reshape(rows, seq, self.top_k, -1)
        weight = vma.where(routing.kept, routing.gate, 0)  # the k-way sum in float32, as the gates are
        out = jnp.einsum("bskd,bsk->bsd", *vma.match(chosen.astype(jnp.float32), weight))
        out = nn.with_loss_gradient(out, balance_loss, self.balance_weight)
        stats = dict(balance=balance_loss, load=load, dropped=dropped)
        return nn.relayout(out.astype(x.dtype), MOE_IN, names), stats
