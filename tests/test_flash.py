"""jshard's flash kernel (`nn.flash`), run by Pallas's interpreter on this CPU, against JAX's
own attention (`jax.nn.dot_product_attention`, XLA, an explicit mask): the output and
log-sum-exp, the gradients, a ring's two blocks merged and differentiated under the merged
statistics, bf16, and bad input. Its GPU program (Triton, inside context-parallel steps) is
test_gpu_compile.py's; context parallelism's parity with one device, test_strategies.py's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jshard.nn import flash
from jshard.nn.context_parallel import balanced_order, block_kernel

B, Q, K, HEADS, KV_HEADS, D = 1, 128, 256, 4, 2, 16  # 2 backward tiles of queries, 4 of keys; grouped KV heads
# The kernel checks are of the device tier: `make gpu-check` runs them on a GPU, where Triton runs
# the kernel and both it and XLA's reference multiply fp32 in TF32 (about 1e-3).
ON_GPU = jax.default_backend() == "gpu"
RTOL, ATOL = (2e-2, 2e-2) if ON_GPU else (1e-5, 1e-5)


def inputs(dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=shape), dtype) for shape in
            ((B, Q, HEADS, D), (B, K, KV_HEADS, D), (B, K, KV_HEADS, D), (B, Q, HEADS, D))]


# (query positions, key positions): causal over the keys' last 128; the queries of device 1 of 2 in
# the load-balanced order over all keys in that order (cp-gather's); every key (a ring's off-diagonal block)
POSITIONS = {
    "causal": (jnp.arange(K - Q, K), jnp.arange(K)),
    "balanced": (balanced_order(K, 2).reshape(2, -1)[1][:Q], balanced_order(K, 2)),
    "none": None,
}


def reference(q, k, v, positions):
    mask = None if positions is None else (positions[0][:, None] >= positions[1][None, :])[None, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")


def reference_lse(q, k, positions):
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, HEADS // KV_HEADS, axis=2)) / np.sqrt(D)
    if positions is not None:
        scores = jnp.where(positions[0][:, None] >= positions[1][None, :], scores, -jnp.inf)
    return jax.nn.logsumexp(scores, axis=-1)


@pytest.mark.device
@pytest.mark.parametrize("name", POSITIONS)
def test_forward_is_attention_and_its_log_sum_exp(name):
    q, k, v, _ = inputs()
    out, lse = flash.flash_forward(q, k, v, POSITIONS[name])
    assert out.dtype == lse.dtype == jnp.float32 and lse.shape == (B, HEADS, Q)
    np.testing.assert_allclose(out, reference(q, k, v, POSITIONS[name]), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(lse, reference_lse(q, k, POSITIONS[name]), rtol=RTOL, atol=ATOL)


@pytest.mark.device
@pytest.mark.parametrize("name", ["causal", "balanced"])
def test_gradients_are_attentions(name):
    q, k, v, d_out = inputs()
    q_pos, k_pos = POSITIONS[name]
    out, vjp = jax.vjp(lambda q, k, v: flash.flash_attention(q, k, v, q_pos, k_pos), q, k, v)
    expected_out, expected_vjp = jax.vjp(lambda q, k, v: reference(q, k, v, POSITIONS[name]), q, k, v)
    np.testing.assert_allclose(out, expected_out, rtol=RTOL, atol=ATOL)
    for got, want, what in zip(vjp(d_out), expected_vjp(d_out), "qkv"):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"d{what}")


@pytest.mark.device
def test_two_blocks_merged_and_differentiated_under_the_merged_statistics():
    """A ring's use: each block's output and log-sum-exp merged (online softmax), and each
    block's backward given the merged log-sum-exp and rowsum(dO · O): together, attention over
    both blocks and its gradients."""
    q, k, v, d_out = inputs(seed=1)
    q_pos, k_pos = POSITIONS["causal"]
    halves = [(slice(0, K // 2), None), (slice(K // 2, K), (q_pos, k_pos[K // 2:]))]  # the first block wholly visible
    parts = [flash.flash_forward(q, k[:, s], v[:, s], pos) for s, pos in halves]
    lse = jnp.logaddexp(parts[0][1], parts[1][1])
    out = sum(o * jnp.exp(part_lse - lse).transpose(0, 2, 1)[..., None] for o, part_lse in parts)
    expected_out, expected_vjp = jax.vjp(lambda q, k, v: reference(q, k, v, POSITIONS["causal"]), q, k, v)
    np.testing.assert_allclose(out, expected_out, rtol=RTOL, atol=ATOL)
    delta = jnp.einsum("bqhd,bqhd->bhq", d_out, out)
    grads = [flash.flash_backward(q, k[:, s], v[:, s], d_out, lse, delta, pos) for s, pos in halves]
    dq = grads[0][0] + grads[1][0]
    dk, dv = (jnp.concatenate([g[i] for g in grads], axis=1) for i in (1, 2))
    for got, want, what in zip((dq, dk, dv), expected_vjp(d_out), "qkv"):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=f"d{what}")


@pytest.mark.device
def test_bf16_inputs_are_near_fp32_attention():
    q, k, v, _ = inputs()
    low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    out = flash.flash_attention(*low, *POSITIONS["balanced"])
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(out.astype(jnp.float32), reference(q, k, v, POSITIONS["balanced"]), atol=2e-2)


@pytest.mark.fast
@pytest.mark.parametrize("call, message", [
    (lambda: flash.check_pallas(48, "gpu"), "attention 'pallas' needs a head dim of 16, 32, 64, 128, 256; here 48"),
    (lambda: flash.check_pallas(64, "cpu"), "attention 'pallas' is jshard's Triton kernel, for a GPU; here: cpu"),
    (lambda: flash.check_flash(64, 100, 256), "cuts 100 tokens into tiles of 64"),
    (lambda: flash.check_flash(64, 128, 320), "cuts 320 tokens into tiles of 128"),
    (lambda: block_kernel("cudnn", 64, 512, 4, "gpu"), "attention 'cudnn' cannot run a ring's or gathered keys' blocks"),
    (lambda: block_kernel("pallas", 64, 512, 4, "cpu"), "for a GPU; here: cpu"),
    (lambda: block_kernel("pallas", 64, 48, 4, "gpu"), "cuts 96 tokens into tiles of 64"),
], ids=["head-dim", "cpu", "tiles", "tiles-of-keys", "cudnn-blocks", "cpu-blocks", "chunk-tiles"])
def test_bad_input_is_one_line_with_its_fix(call, message):
    with pytest.raises(ValueError, match="Fix: ") as e:
        call()
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.fast
def test_the_block_kernel_is_flash_on_a_gpu_where_the_head_dim_and_tiles_allow():
    """`auto` takes the flash kernel on a GPU where its head dim and each block's length fit
    (a chunk of 48 tokens makes whole blocks of 96, which 64-token tiles do not cut), else XLA's."""
    assert [block_kernel("auto", d, 512, 4, "gpu") for d in (128, 96)] == ["pallas", "xla"]
    assert [block_kernel("auto", 128, chunk, 4, "gpu") for chunk in (32, 48, 4096)] == ["pallas", "xla", "pallas"]
    assert [block_kernel(c, 128, 512, 4, "cpu") for c in ("auto", "xla")] == ["xla", "xla"]
    assert block_kernel("xla", 128, 512, 4, "gpu") == "xla"
