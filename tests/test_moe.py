"""A mixture of experts and expert parallelism: routing, the balance loss's gradient, the
all-to-all bytes against the planner, expert weights per device, pipelines, bad input.

Parity with one device (loss, gradients, params after 3 AdamW steps) under ep over 8, 4 and 2
devices, with DP, ZeRO-2/3, TP and SP, is test_strategies.py's (the "moe" decoder); training
under dp+ep as under dp, test_train.py's.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jshard
from jshard import moe, nn
from jshard import planner
from jshard.models import SIZES, decoder, gpt_loss
from jshard.parallel import build_step
from jshard.rules import ShardingError
import decoders
from parity import (BF16_TOLERANCE, OPTIMIZER, assert_gradients_close, assert_trees_close, one_device_gradients,
                    relative_error)
from seed import SEED
from traffic import collective_bytes

CONFIG = decoders.CONFIGS["moe"]


def batch_of(rows=16, seed=SEED):
    return np.random.default_rng(seed).integers(0, CONFIG.vocab, (rows, CONFIG.seq_len + 1))


# -- routing ------------------------------------------------------------------------------------


def test_each_row_fills_its_own_slots_first_choices_first():
    """Capacity is per row: routing a batch drops exactly what routing each row alone drops.
    In a row, an expert's slots go to first choices (in token order) before second ones; no
    expert gets more than C, and every slot holds the token routed to it."""
    rng = np.random.default_rng(SEED)
    rows, seq, experts, k, slots = 6, 12, 4, 2, 4
    logits = jnp.asarray(rng.standard_normal((rows, seq, experts)), jnp.float32)
    whole = moe.route(logits, k, slots)
    for r in range(rows):
        alone = moe.route(logits[r:r + 1], k, slots)
        np.testing.assert_array_equal(whole.kept[r], alone.kept[0])
        np.testing.assert_array_equal(whole.slot_token[r], alone.slot_token[0])
    expert, kept, slot = map(np.asarray, (whole.expert, whole.kept, whole.slot))
    assert 0 < kept.sum() < kept.size  # some choices dropped, so that the order matters
    for r in range(rows):
        for e in range(experts):
            queue = [(c, t) for c in range(k) for t in range(seq) if expert[r, t, c] == e]  # first choices first
            assert [bool(kept[r, t, c]) for c, t in queue] == [i < slots for i in range(len(queue))]
            for i, (c, t) in enumerate(queue[:slots]):
                assert slot[r, t, c] == e * slots + i and whole.slot_token[r, e * slots + i] == t
    dropless = moe.route(logits, k, moe.capacity(seq, experts, k, None))
    assert bool(dropless.kept.all())


def test_capacity():
    assert moe.capacity(64, 8, 2, 1.25) == 20 and moe.capacity(64, 8, 1, 1.0) == 8
    assert moe.capacity(10, 2, 2, 4.0) == 10 and moe.capacity(10, 2, 2, None) == 10  # at most the row


def test_the_balance_loss_adds_its_gradient_only():
    """A model's loss is the language model's; its gradient is that of the loss plus
    balance_loss · the sum over layers of E · Σ_e f_e · P_e, computed here independently
    from the router statistics."""
    batch = batch_of()
    weight = CONFIG.balance_loss
    with_balance = decoder(CONFIG, nnx.Rngs(SEED))
    without = decoder(dataclasses.replace(CONFIG, balance_loss=0.0), nnx.Rngs(SEED))
    loss, grads = one_device_gradients(with_balance, gpt_loss, batch)  # jitted: one program, not op by op
    plain_loss, plain_grads = one_device_gradients(without, gpt_loss, batch)
    balance_grads = nnx.jit(nnx.grad(lambda m, tokens: m.router_stats(tokens)["balance"].sum()))(without, batch[:, :-1])
    assert float(loss) == float(plain_loss)
    expected = jax.tree.map(lambda g, b: g + weight * b, plain_grads, balance_grads)
    assert_trees_close(grads, expected, "gradient")
    router = grads["blocks"]["mlp"]["router"]["kernel"].get_value()
    assert relative_error(router, plain_grads["blocks"]["mlp"]["router"]["kernel"].get_value()) > 1e-2


def test_router_stats():
    stats = decoder(CONFIG, nnx.Rngs(SEED)).router_stats(batch_of()[:, :-1])
    assert stats["load"].shape == (CONFIG.layers, CONFIG.experts)
    np.testing.assert_allclose(stats["load"].sum(-1), 1.0, rtol=1e-6)
    assert np.all((0 < stats["dropped"]) & (stats["dropped"] < 0.5))  # capacity factor 1 drops some
    probs = stats["balance"] / CONFIG.experts  # Σ f·P, with Σ f = Σ P = 1
    assert np.all((0 < probs) & (probs <= 1))


# -- expert parallelism, counted ---------------------------------------------------------------


# ep, dp+ep under full remat and fsdp+ep are left out: test_planner.py's MoE rows compile those steps (moe-tiny,
# the same meshes and rows) and hold their bytes to the planner's; these rows still count the buffers by hand
# (4 per layer without remat, 6 with).
@pytest.mark.parametrize("preset, sizes, remat, moe_every", [
    ("zero2+ep", dict(fsdp=2, expert=4), "selective", 1),
    ("dp+ep+tp", dict(data=2, expert=2, tensor=2), "full", 1),
    ("dp+ep+tp+sp", dict(data=2, expert=2, tensor=2), "none", 1),
    ("dp+ep+tp+sp", dict(data=2, expert=2, tensor=2), "full", 2),  # a dense block, then a MoE one
])
def test_collective_bytes_are_the_planners(preset, sizes, remat, moe_every):
    """Every collective of the compiled step, by kind: all-to-alls of the dispatch buffer (4 per
    MoE layer, 6 under remat), the load's all-reduce, and what MoE changes of ZeRO's and TP's,
    equal the planner's formulas (`planner.traffic`)."""
    config = dataclasses.replace(SIZES["moe-tiny"], remat=remat, layers=2 * moe_every, moe_every=moe_every)
    batch = np.random.default_rng(SEED).integers(0, config.vocab, (16, config.seq_len + 1))
    # only compiled: built from shapes (`abstract`: the program of the step built on the devices)
    step = build_step(nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0))), OPTIMIZER, gpt_loss,
                      jshard.Layout.of(preset, sizes), jshard.make_mesh(**sizes), abstract=True)
    counted = collective_bytes(step, batch)
    planned = {}
    for (kind, _), nbytes in planner.traffic(config, step.plan, 16 // step.data_shards, config.seq_len).items():
        planned[kind] = planned.get(kind, 0) + nbytes
    assert counted == planned
    rows, slots = 16 // step.data_shards, moe.capacity(config.seq_len, config.experts, config.top_k, config.capacity_factor)
    buffer = rows * config.experts * slots * config.embed * 4
    assert counted["all-to-all"] == config.moe_layers * (4 if remat == "none" else 6) * buffer


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_expert_weights_per_device_fall_as_one_over_ep(ep):
    """Each device holds experts/ep experts' weights, and compiles to 1/ep of their bytes; the
    rest of the model stays whole (dp)."""
    step = build_step(decoder(SIZES["moe-tiny"], nnx.Rngs(0)), OPTIMIZER, gpt_loss,
                      jshard.Layout.of("dp+ep", dict(data=8 // ep, expert=ep)))
    held = {"/".join(map(str, path)): (v.get_value().addressable_shards[0].data.nbytes, v.get_value().nbytes)
            for path, v in nnx.to_flat_state(step.state.params)}
    experts = [k for k in held if "mlp/gate_up" in k or "mlp/down" in k]
    assert experts and all(held[k][0] * ep == held[k][1] for k in experts)
    assert all(held[k][0] == held[k][1] for k in held if k not in experts)


# -- every n-th block, and decoding -----------------------------------------------------------


@pytest.mark.parametrize("top_k, capacity_factor", [(1, 1.0), (2, None)])
def test_top_1_and_dropless_match_one_device(top_k, capacity_factor):
    """Switch's top-1 (the raw probability as gate) and dropless routing (every choice a slot)
    under dp+ep+tp, against one device, balance gradient included."""
    make = functools.partial(decoders.make, "moe", SEED, top_k=top_k, capacity_factor=capacity_factor)
    batch = batch_of()
    step = build_step(make(), OPTIMIZER, gpt_loss, jshard.Layout.of("dp+ep+tp", dict(data=2, expert=2, tensor=2)))
    assert_gradients_close(step, batch, *one_device_gradients(make(), gpt_loss, batch))
    dropped = make().router_stats(batch[:, :-1])["dropped"]
    assert np.all(dropped == 0) if capacity_factor is None else np.all(dropped > 0)


def test_moe_every_other_block_matches_one_device():
    """moe_every=2: the stack's layers each hold a dense block and a MoE block."""
    make = functools.partial(decoders.make, "moe", SEED, layers=4, moe_every=2)
    model = make()
    assert len(model.blocks.dense) == 1 and model.blocks.moe.mlp.gate_up.kernel.shape[:2] == (2, CONFIG.experts)
    assert model.router_stats(batch_of()[:, :-1])["load"].shape == (2, CONFIG.experts)
    batch = batch_of()
    step = build_step(make(), OPTIMIZER, gpt_loss, jshard.Layout.of("dp+ep+tp", dict(data=2, expert=2, tensor=2)))
    assert_gradients_close(step, batch, *one_device_gradients(model, gpt_loss, batch))


@pytest.mark.parametrize("moe_every", [1, 2])
def test_decoding_with_a_cache_routes_as_the_forward_without_dropping(moe_every):
    """Generation routes dropless: token by token over the KV cache, the logits of a dropless
    model's forward."""
    model = decoders.make("moe", SEED, layers=4, moe_every=moe_every, capacity_factor=None)
    tokens = jnp.asarray(batch_of(rows=2)[:, :9])
    cache = model.init_cache(2, 16)
    first, cache = model.decode(tokens[:, :5], cache, 0)
    rest, cache = model.decode(tokens[:, 5:], cache, 5)
    np.testing.assert_allclose(jnp.concatenate([first, rest], 1), model(tokens), atol=1e-5)


# -- a pipeline ---------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule, moe_every", [("1f1b", 1), ("zb-h1", 2)])
def test_pipeline_matches_one_device(schedule, moe_every):
    """dp+ep+pp: each micro-batch balances its own tokens, and its balance gradient counts 1/M
    as its loss does. The reference: one device, the loss averaged over the same micro-batches
    (chunk j of every batch shard), each forward's balance gradient scaled 1/M."""
    shards, microbatches = 4, 2  # data × expert
    batch = batch_of()
    make = functools.partial(decoders.make, "moe", SEED, layers=4 * moe_every, moe_every=moe_every)
    step = build_step(make(), OPTIMIZER, gpt_loss,
                      jshard.Layout.of("dp+ep+pp", dict(data=2, expert=2, stage=2), microbatches=microbatches,
                                       schedule=schedule))

    def reference_loss(model, batch):
        per_shard = batch.reshape(shards, microbatches, -1, batch.shape[1])
        with nn.scaled_losses(1 / microbatches):
            return jnp.mean(jnp.stack([gpt_loss(model, per_shard[:, j].reshape(-1, batch.shape[1]))
                                       for j in range(microbatches)]))

    assert_gradients_close(step, batch, *one_device_gradients(make(), reference_loss, batch))


# -- the compiler's partitioner, and bf16 ------------------------------------------------------


def test_compiler_placed_step_matches_the_explicit_one():
    """The same rules under plain jax.jit: XLA's partitioner turns the buffer's layouts into its
    own collectives; gradients agree with the explicit step's."""
    batch, mesh, rules = batch_of(), jshard.make_mesh(data=2, expert=4), jshard.preset("dp+ep")
    explicit = build_step(decoders.make("moe", SEED), OPTIMIZER, gpt_loss, jshard.Layout.of(rules, mesh), mesh)
    compiled = build_step(decoders.make("moe", SEED), OPTIMIZER, gpt_loss, jshard.Layout.of(rules, mesh), mesh,
                          collectives="compiler")
    loss, grads = explicit.value_and_grad(explicit.state, explicit.shard_batch(batch))
    assert_gradients_close(compiled, batch, loss, grads)


def test_bf16_matches_fp32_on_one_device():
    """bf16 compute (the experts' matmuls and the all-to-alls), fp32 router and gate sum."""
    batch = batch_of()
    expected, expected_grads = one_device_gradients(decoders.make("moe", SEED), gpt_loss, batch)
    step = build_step(decoders.make("moe", SEED, dtype=jnp.bfloat16), OPTIMIZER, gpt_loss,
                      jshard.Layout.of("dp+ep", dict(data=2, expert=4), precision="mixed"))
    loss, grads = step.value_and_grad(step.state, step.shard_batch(batch))
    assert relative_error(loss, expected) <= BF16_TOLERANCE, f"loss {float(loss)} vs {expected} (seed {SEED})"
    flat = dict(nnx.to_flat_state(expected_grads))
    for path, g in nnx.to_flat_state(grads):
        # The experts' weights, through both all-to-alls: bf16 round-off in the experts' matmuls and
        # a two-layer backward leaves ~10% per param (0.11 seen); a misplaced slot would be ~1.
        if "experts" in (g.get_metadata().get("out_sharding") or ()):
            assert relative_error(g.get_value(), flat[path].get_value()) <= 0.25, f"{path} (seed {SEED})"


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fields, preset, sizes, error, match", [
    (dict(experts=2), "dp+ep", dict(data=2, expert=4), ShardingError,
     r"'blocks/mlp/(gate_up|down)/kernel'.*dim 1 \('experts', size 2\).*expert=4"),
    (dict(experts=0), "dp+ep", dict(data=2, expert=4), ShardingError, "no param of the model has an 'experts' dim.*moe-tiny"),
    (dict(), "dp+cp", dict(data=2, context=4), ShardingError, "mixture of experts.*Fix: a preset without cp"),
    (dict(experts=2, top_k=3), None, None, ValueError, "top_k=3 must be between 1 and experts=2"),
    (dict(capacity_factor=0), None, None, ValueError, "capacity_factor=0 must be positive, or None"),
    (dict(moe_every=4), None, None, ValueError, "layers=2 must divide by moe_every=4"),
])
def test_bad_input(fields, preset, sizes, error, match):
    """One clear error, before any device work: from the config, or from build_step's checks."""
    with pytest.raises(error, match=match):
        model = decoders.make("moe", SEED, **fields)
        build_step(model, OPTIMIZER, gpt_loss, jshard.Layout.of(preset, sizes))


def test_matmul_batches_over_names_leading_both_and_contracts_trailing_ones():
    """Outside a step, as einsum: experts lead both (a batch dim), embed trails x (contracted); a
    name that is x's only one and leads w is contracted, never a batch dim."""
    rng = np.random.default_rng(SEED)
    x, w = rng.standard_normal((3, 2, 5, 4)), rng.standard_normal((3, 4, 6))
    y = nn.matmul(jnp.asarray(x), ("experts", "batch", None, "embed"), jnp.asarray(w), ("experts", "embed", "mlp"))
    np.testing.assert_allclose(y, np.einsum("ebcd,edf->ebcf", x, w), rtol=1e-5, atol=1e-6)
    v, m = rng.standard_normal(4), rng.standard_normal((4, 6))
    np.testing.assert_allclose(nn.matmul(jnp.asarray(v), ("embed",), jnp.asarray(m), ("embed", "mlp")), v @ m,
                               rtol=1e-5, atol=1e-6)
