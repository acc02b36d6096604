"""Context parallelism: the load-balanced layout, ring and all-to-all attention's bytes and memory, bad input.

Parity with one device (loss, gradients, params after 3 AdamW steps) under cp over 2, 4 and 8
devices, alone and with dp, ZeRO-2/3, TP and SP, ring, all-gather and all-to-all, is test_strategies.py's;
with a pipeline, test_pipeline.py's; training as DP does, test_train.py's; per-device memory
falling with cp at seq 4096, test_examples.py's (examples/context_parallel.py).
"""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jshard
from jshard.nn import context_parallel
from jshard.nn.context_parallel import balanced_order, split_input
from jshard.models import DeepMLP, MLPConfig, decoder, gpt_loss, mlp_loss
from jshard.parallel import build_step
import decoders
from parity import BF16_TOLERANCE, OPTIMIZER, assert_gradients_close, assert_trees_close, one_device_gradients
from traffic import assert_context_bytes_are_the_planners


@pytest.mark.parametrize("n", [2, 4, 8])
def test_every_device_holds_an_equal_share_of_causal_work(n):
    """Device i holds chunks i and 2n-1-i. Every device's queries then see equally many keys,
    and in each ring step j != i the pairs causality leaves are exactly one half-block: key
    chunk j for both query chunks (j < i), or query chunk 2n-1-i for both key chunks (j > i),
    which `ring_attention` computes unmasked."""
    c = 3  # tokens per chunk
    order = np.asarray(balanced_order(2 * n * c, n)).reshape(n, 2 * c)
    assert sorted(order.ravel()) == list(range(2 * n * c))
    assert all(list(order[i]) == [*range(i * c, (i + 1) * c), *range((2 * n - 1 - i) * c, (2 * n - i) * c)]
               for i in range(n))
    work = [int((order[i][:, None] >= order.ravel()[None, :]).sum()) for i in range(n)]
    assert len(set(work)) == 1, work
    for i in range(n):
        for j in set(range(n)) - {i}:
            visible = order[i][:, None] >= order[j][None, :]
            half = np.zeros_like(visible)
            if j < i:
                half[:, :c] = True
            else:
                half[c:, :] = True
            np.testing.assert_array_equal(visible, half, err_msg=f"device {i}, block of {j}")


# With remat "none" (the decoders' default) this check runs on test_strategies.py's parity steps
# (its BYTES_COUNTED: cp-gpt on 8, dp+cp+tp-llama, fsdp+cp+sp-gpt), which compile those programs anyway.
@pytest.mark.parametrize("model, preset, sizes", [
    ("gpt", "dp+cp", dict(data=2, context=4)),
    ("llama", "cp-gather", dict(context=8)),
])
def test_compiled_bytes_are_the_planners_under_full_remat(model, preset, sizes):
    """Recomputing each block in the backward pass sends nothing more than the planner says."""
    config = dataclasses.replace(decoders.CONFIGS[model], remat="full")
    batch = np.random.default_rng(0).integers(0, config.vocab, (8, config.seq_len + 1))
    step = build_step(decoder(config, nnx.Rngs(0)), OPTIMIZER, gpt_loss, jshard.Layout.of(preset, sizes))
    assert_context_bytes_are_the_planners(step, config, batch, preset, sizes)


# -- bad input -----------------------------------------------------------------------------------


def test_a_model_with_no_sequence_is_refused():
    step = build_step(DeepMLP(MLPConfig(dim=16, layers=2), rngs=nnx.Rngs(0)), OPTIMIZER, mlp_loss,
                      jshard.Layout.of("dp+cp", dict(data=2, context=4)))
    with pytest.raises(jshard.ShardingError, match="split each sequence over context .* split no input over it"):
        step.value_and_grad(step.state, step.shard_batch(np.ones((8, 16), np.float32)))


@pytest.mark.parametrize("preset, sizes, tokens, message", [
    ("cp", dict(context=8), 13, "into 16 equal chunks; 12 tokens do not divide by 16"),
    ("dp+cp-a2a", dict(data=2, context=4), 11, "into 4 equal chunks; 10 tokens do not divide by 4"),
    ("cp-a2a", dict(context=8), 17, "splits attention's heads 8 ways; 4 heads a device .* do not divide by 8. Fix: "),
])
def test_a_sequence_or_heads_that_do_not_cut_evenly_are_refused(preset, sizes, tokens, message):
    step = build_step(decoders.make("gpt", 0), OPTIMIZER, gpt_loss, jshard.Layout.of(preset, sizes))
    with pytest.raises(jshard.ShardingError, match=message):
        step.value_and_grad(step.state, step.shard_batch(np.ones((2, tokens), np.int32)))


def test_all_to_all_repeats_grouped_kv_heads_that_context_does_not_divide():
    """The Llama's 4 KV heads over tensor=2 leave 2 a device, which context=4 does not divide:
    each is repeated twice before the all-to-all (its gradient the sum of the copies'), and the
    gradients are one device's; the all-to-alls move the repeated heads, as the planner says."""
    batch = np.random.default_rng(4).integers(0, 64, (4, 17))
    step = build_step(decoders.make("llama", 0), OPTIMIZER, gpt_loss, jshard.Layout.of("cp-a2a+tp", dict(tensor=2, context=4)))
    assert_context_bytes_are_the_planners(step, decoders.CONFIGS["llama"], batch, "cp-a2a+tp", dict(tensor=2, context=4))
    assert_gradients_close(step, batch, *one_device_gradients(decoders.make("llama", 0), gpt_loss, batch))


def test_planner_memory_under_all_to_all_and_full_remat():
    """`jshard plan --validate`'s check on the all-to-all's row: memory within 10% of the
    compiler's, bytes exact (the GPT at seq 64, 8 rows a data shard, on the default mesh)."""
    from jshard import planner

    r = planner.validate_one("dp+cp-a2a", None, None, "full", "default", "fp32", None, 8, model=planner.VALIDATION_MODELS["gpt"])
    assert r["comm_predicted"] == r["comm_compiled"] and abs(r["memory_rel_err"]) <= planner.MEMORY_TOLERANCE, r


@pytest.mark.parametrize("preset, sizes, message", [
    ("cp+pp", dict(context=4, stage=2), "preset 'pp[+]cp-gather'"),
    ("cp+cp-gather", dict(context=8), "names both cp and cp-gather"),
    ("cp-a2a+cp", dict(context=8), "names both cp-a2a and cp"),
    ("dp", dict(data=2, context=4), "mesh axis 'context' has size 4, but no rule"),
])
def test_bad_strategies_are_refused_before_placing(preset, sizes, message):
    with pytest.raises(jshard.ShardingError, match=message):
        build_step(decoders.make("gpt", 0), OPTIMIZER, gpt_loss,
                   jshard.Layout.of(preset, sizes, microbatches=2 if "pp" in preset else None))


@pytest.mark.slow
def test_bench_strategies_shows_parity_and_textbook_bytes(tmp_path):
    """The issue's check (its `--plans` is `--strategies` here): cp alone and with dp and tp."""
    from jshard.cli import main

    out = tmp_path / "rows.json"
    argv = ["bench", "strategies", "--strategies", "cp@context=8;dp+cp+tp@data=2,context=2,tensor=2", "--layers", "2",
            "--embed", "32", "--mlp", "128", "--seq-len", "16", "--batch-size", "8", "--repeats", "1", "--json", str(out)]
    assert main(argv) == 0
    rows = __import__("json").loads(out.read_text())
    assert [(r["strategy"], r["mesh"]) for r in rows] == [("cp", "context=8"), ("dp+tp+cp", "data=2,context=2,tensor=2")]
    for row in rows:
        assert row["parity_rel_err"] < 1e-5 and row["comm_bytes"] == row["textbook_bytes"] and row["comm_ratio"] == 1.0
        assert row["xla_parity_rel_err"] < 1e-5  # XLA's partitioner, the same layouts, its own attention


def test_ring_under_bf16_compute_is_near_fp32_on_one_device():
    """bf16 queries, keys and values (fp32 scores, softmax and accumulators in the ring): the
    gradients within 2e-2 of one device's in fp32."""
    import jax.numpy as jnp

    batch = np.random.default_rng(1).integers(0, 64, (4, 17))
    _, expected = one_device_gradients(decoders.make("llama", 0), gpt_loss, batch)
    step = build_step(decoders.make("llama", 0, dtype=jnp.bfloat16), OPTIMIZER, gpt_loss,
                      jshard.Layout.of("cp", dict(context=8)))
    _, grads = step.value_and_grad(step.state, step.shard_batch(batch))
    assert_trees_close(grads, expected, "gradient", BF16_TOLERANCE)


def test_ring_runs_a_block_tile_by_tile(monkeypatch):
    """With 2-query tiles every block runs as a loop over tiles (its dk, dv summed over them):
    the gradients are still one device's."""
    monkeypatch.setattr(context_parallel, "QUERY_TILE", 2)
    batch = np.random.default_rng(2).integers(0, 64, (4, 17))
    _, expected = one_device_gradients(decoders.make("llama", 0), gpt_loss, batch)
    step = build_step(decoders.make("llama", 0), OPTIMIZER, gpt_loss,
                      jshard.Layout.of("dp+cp", dict(data=4, context=2)))
    jaxpr = str(jax.make_jaxpr(step.value_and_grad)(step.state, step.shard_batch(batch)))
    assert "length=4" in jaxpr  # the own block's 8 queries (2 chunks of 4 per device) in 4 tiles
    _, grads = step.value_and_grad(step.state, step.shard_batch(batch))
    assert_trees_close(grads, expected, "gradient")


def test_a_loss_that_averages_only_its_own_chunks():
    """A user's loss that is the mean over this device's tokens (optax's cross-entropy, the
    labels split as the inputs are): the step averages it over the context axes, so loss and
    gradients are one device's."""
    import jax.numpy as jnp

    def own_loss(model, tokens):
        logits = model(tokens[:, :-1]).astype(jnp.float32)
        labels = split_input(tokens[:, 1:], ("batch", "seq"))  # the identity outside a step
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    batch = np.random.default_rng(3).integers(0, 64, (4, 17))
    step = build_step(decoders.make("gpt", 0), OPTIMIZER, own_loss, jshard.Layout.of("dp+cp", dict(data=2, context=4)))
    assert_gradients_close(step, batch, *one_device_gradients(decoders.make("gpt", 0), own_loss, batch))
