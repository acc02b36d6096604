"""Losses: the model's own (`cross_entropy`, vocab-parallel where the rules split the vocab)
and those a layer adds in backward (`with_loss_gradient`, weighed by the step context's
loss scale: `scaled_losses`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jshard import vma
from jshard.nn.context_parallel import laid_out_input
from jshard.nn.layouts import layout
from jshard.nn.step_context import current_step, in_step, replaced
from jshard.rules import active_rules


# -- losses a layer adds ------------------------------------------------------------------


@contextlib.contextmanager
def scaled_losses(scale: float):
    """Within this block, losses added in backward (`with_loss_gradient`) are scaled by `scale`:
    a pipeline seeds each micro-batch's loss with 1/M in backward, so it scales theirs too."""
    with replaced(loss_scale=current_step().loss_scale * scale):
        yield


def with_loss_gradient(y: jax.Array, loss: jax.Array, weight: float) -> jax.Array:
    """y, unchanged; in backward `loss` gets the cotangent `weight`: as if weight · loss were
    added to the loss being differentiated, though the loss reported does not show it (an
    auxiliary loss, such as a router's load balancing; Megatron's MoEAuxLossAutoScaler).

    Inside a step `loss` is this device's share, as a step's loss is: the mean over the batch
    shards is the whole. Where devices computed it alike (over tensor or context) it is averaged
    first, so that its gradient counts once."""
    if in_step():
        rules = active_rules()
        keep = {a for name, axes in rules.activations + rules.params if name in ("batch", "layers") for a in axes}
        spread = tuple(sorted(vma.varying_axes(loss) - keep))
        loss = lax.pmean(loss, spread) if spread else loss
    return _with_loss_gradient(y, loss, weight * current_step().loss_scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _with_loss_gradient(y, loss, weight):
    return y


def _with_loss_fwd(y, loss, weight):
    return y, loss


def _with_loss_bwd(weight, loss, g):
    return g, vma.zeros_like(loss) + jnp.asarray(weight, loss.dtype)


_with_loss_gradient.defvjp(_with_loss_fwd, _with_loss_bwd)


# -- loss -------------------------------------------------------------------------------------


# A padded vocabulary's extra logits: exp() of it is 0 in float32 whatever the real logits, and it
# is finite (no inf - inf = NaN where a loss or a sampler subtracts the largest logit).
PAD_LOGIT = -1e9


def padded_vocab(vocab: int, multiple: int) -> int:
    """Rows of a token table for `vocab` tokens, rounded up to a multiple of `multiple` (Megatron
    pads so that the tensor axis divides it; the pad rows are never a token)."""
    return -(-vocab // multiple) * multiple


def without_padded_vocab(logits: jax.Array, vocab: int, names: Sequence[str | None]) -> jax.Array:
    """`logits` with the columns past `vocab` (a padded table's) at `PAD_LOGIT`: out of every
    softmax, loss, argmax and sample. Inside a step this device's columns start where its shard
    of the vocab axes does."""
    columns = logits.shape[-1]
    vocab_axes = layout(names)[-1] if in_step() else ()
    if columns * (lax.axis_size(vocab_axes) if vocab_axes else 1) == vocab:  # no pad: nothing to mask
        return logits
    index = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    if vocab_axes:
        index = index + lax.axis_index(vocab_axes) * columns
    return vma.where(index < vocab, logits, jnp.asarray(PAD_LOGIT, logits.dtype))


def cross_entropy(logits: jax.Array, labels: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Mean next-token cross-entropy; vocab-parallel where the rules split the last dim.

    Inside a step, `labels` arrive split over the batch axes only and the mean is over
    this device's share of the batch (the step averages over the batch axes). Each token's
    loss is `token_losses`', whose backward writes the logits' gradient in their own dtype.
    """
    if not in_step():
        return token_losses(logits, labels, ()).mean()
    logits_layout = layout(names)
    # Labels have the logits' layout on their dims (sequence-parallel logits split seq).
    labels = laid_out_input(labels, names[:-1], logits_layout[:-1])
    losses = token_losses(logits, labels, logits_layout[-1])
    # Sequence-parallel logits: this device holds a slice of the sequence; average over all.
    split = [a for d, axes in enumerate(logits_layout[:-1]) if names[d] != "batch" for a in axes]
    mean = losses.mean()
    return lax.pmean(mean, split) if split else mean


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def token_losses(logits: jax.Array, labels: jax.Array, vocab_axes: tuple[str, ...]) -> jax.Array:
    """Each token's -log softmax(logits)[label] in float32, its vocab split over `vocab_axes`
    (this device's columns a block of them). A custom VJP: autodiff of the float32 softmax keeps
    float32 copies of the whole logits (two of 8192 × 128256 in the 8B step: 3.9 GiB), where the
    gradient, softmax - onehot, is one elementwise pass over the logits written in their dtype."""
    return _token_losses_fwd(logits, labels, vocab_axes)[0]


def _columns(logits, labels, vocab_axes):
    """(this device's label columns, whether the label is among them)."""
    rows = logits.shape[-1]
    local = labels - (lax.axis_index(vocab_axes) * rows if vocab_axes else 0)
    return local, (local >= 0) & (local < rows)


def _token_losses_fwd(logits, labels, vocab_axes):
    wide = logits.astype(jnp.float32)
    peak = lax.stop_gradient(wide.max(-1))
    if vocab_axes:
        peak = lax.pmax(peak, vocab_axes)
    total = jnp.exp(wide - peak[..., None]).sum(-1)
    local, inside = _columns(logits, labels, vocab_axes)
    picked = vma.where(inside, jnp.take_along_axis(wide, jnp.clip(local, 0, logits.shape[-1] - 1)[..., None], -1)[..., 0], 0.0)
    if vocab_axes:
        total, picked = lax.psum(total, vocab_axes), lax.psum(picked, vocab_axes)
    normalizer = jnp.log(total) + peak  # log-sum-exp over the whole vocab
    return normalizer - picked, (logits, labels, normalizer)


def _token_losses_bwd(vocab_axes, residuals, g):
    logits, labels, normalizer = residuals
    local, _ = _columns(logits, labels, vocab_axes)
    column = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    probabilities = jnp.exp(logits.astype(jnp.float32) - normalizer[..., None])
    grad = (probabilities - (column == local[..., None])) * g[..., None]
    return vma.vary(grad.astype(logits.dtype), vma.varying_axes(logits)), None


token_losses.defvjp(_token_losses_fwd, _token_losses_bwd)
