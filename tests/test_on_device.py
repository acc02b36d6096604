"""The device tier (`pytest -m device`): jshard's step on the device JAX starts on, against the
plain Flax NNX + optax step from the same weights, and cuDNN's attention against XLA's.

In the suite these run on a fake CPU device like every test. `make gpu-check` runs them on a
GPU (JSHARD_TEST_DEVICE=1: conftest leaves JAX's platform alone and collects this tier only),
where the bf16 steps call cuDNN's fused attention and XLA:GPU's kernels: what no CPU shows.
Head dims are 64, so cuDNN (and jshard's Triton flash kernel) take them. test_flash.py's
kernel checks are of this tier too: there Triton runs the kernel, not Pallas's interpreter.
"""

import contextlib
import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import jshard
from jshard.bench.plain import plain_from
from jshard.bench.step_time import compiled_for_device, plain_step
from jshard.models import GPTConfig, LlamaConfig, decoder, gpt_loss
from jshard.parallel import build_step
from jshard.precision import precision as precision_policy
from parity import BF16_TOLERANCE, OPTIMIZER, TOLERANCE, assert_losses_close, relative_error
from seed import SEED

pytestmark = pytest.mark.device  # on a fake CPU device, parity tests of the kind the rest of the suite runs

CONFIGS = {
    "gpt": GPTConfig(vocab=256, seq_len=128, embed=128, heads=2, mlp=512, layers=2),
    "llama": LlamaConfig(vocab=256, seq_len=128, embed=256, heads=4, kv_heads=2, mlp=512, layers=2),
}
ROWS, STEPS = 4, 3
ON_GPU = jax.default_backend() == "gpu"


def _batches(config):
    rng = np.random.default_rng(SEED)
    return [rng.integers(0, config.vocab, (ROWS, config.seq_len + 1)) for _ in range(STEPS)]


# On a fake CPU device each precision once, the models in turn, two precisions each (the
# suite's budget); on a GPU every pair, where cuDNN's and cuBLAS's kernels are what is tested.
ON_CPU = {("gpt", "fp32"), ("llama", "mixed"), ("gpt", "bf16"), ("llama", "fp8")}


@pytest.mark.parametrize("name, precision", [
    pytest.param(name, precision, id=f"{name}-{precision}",
                 marks=[] if ON_GPU or (name, precision) in ON_CPU else
                 pytest.mark.skip(reason="a GPU's (make gpu-check): on a CPU each precision runs once"))
    for name in sorted(CONFIGS) for precision in ("fp32", "mixed", "bf16", "fp8")])
def test_step_matches_the_plain_flax_step(name, precision):
    config, policy = CONFIGS[name], precision_policy(precision)
    model = decoder(config, nnx.Rngs(SEED))
    plain = plain_from(model, policy.compute)
    devices = jax.devices()[:1]
    # fp32 at fp32 (a GPU's default runs fp32 matmuls as TF32): the comparison is the step's, not TF32's.
    exact = jax.default_matmul_precision("highest") if precision == "fp32" else contextlib.nullcontext()
    with exact:
        step = build_step(model, OPTIMIZER, gpt_loss, jshard.Layout("dp", precision=policy),
                          jshard.make_mesh(devices=devices, data=1))
        plain_fn, plain_state, rows = plain_step(plain, OPTIMIZER, devices)
        state, losses, plain_losses = step.state, [], []
        for tokens in _batches(config):
            state, loss = step(state, step.shard_batch(tokens))
            plain_state, plain_loss = plain_fn(plain_state, jax.device_put(tokens, rows))
            losses.append(float(loss))
            plain_losses.append(float(plain_loss))
    # bf16 keeps its params in bf16, plain Flax in fp32 (Flax computes in bf16 over fp32 params);
    # fp8 against plain bf16: FP8's rounding moves these first losses by 1e-4 (tests/test_fp8.py).
    assert_losses_close(losses, plain_losses, f"{name} {precision} on {devices[0].platform}",
                        TOLERANCE if precision == "fp32" else BF16_TOLERANCE)


def _loss_and_grads(model, tokens):
    graph, params, rest = nnx.split(model, nnx.Param, ...)
    return jax.jit(jax.value_and_grad(lambda p: gpt_loss(nnx.merge(graph, p, rest), tokens)))(params)


@pytest.mark.skipif(not ON_GPU, reason="cuDNN's attention and jshard's Triton kernel need a GPU")
@pytest.mark.parametrize("kernel", ["cudnn", "pallas"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_attention_matches_xlas(name, kernel):
    """cuDNN's fused attention and jshard's flash kernel (`nn.flash`, Triton: the ring's and
    cp-gather's blocks run it) against XLA's: loss and gradients in bf16."""
    tokens = _batches(CONFIGS[name])[0]
    results = {}
    for choice in (kernel, "xla"):
        config = dataclasses.replace(CONFIGS[name], dtype=jax.numpy.bfloat16, attention=choice)
        results[choice] = _loss_and_grads(decoder(config, nnx.Rngs(SEED)), tokens)
    (loss, grads), (xla_loss, xla_grads) = results[kernel], results["xla"]
    assert relative_error(loss, xla_loss) <= BF16_TOLERANCE
    for (path, g), (xla_path, want) in zip(nnx.to_flat_state(grads), nnx.to_flat_state(xla_grads), strict=True):
        assert path == xla_path
        error = relative_error(np.asarray(g.get_value(), np.float32), np.asarray(want.get_value(), np.float32))
        assert error <= BF16_TOLERANCE, f"{name} {'/'.join(map(str, path))}: {kernel} vs XLA gradient {error:.2e}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_device_compiles_the_kernel_auto_chose(name):
    """bf16 at head dim 64: cuDNN's fused attention on a GPU (in the program the device ran), XLA's elsewhere."""
    model = decoder(CONFIGS[name], nnx.Rngs(SEED))
    devices = jax.devices()[:1]
    step = build_step(model, OPTIMIZER, gpt_loss, jshard.Layout("dp", precision="bf16"),
                      jshard.make_mesh(devices=devices, data=1))
    _, program = compiled_for_device(step, step.state, step.shard_batch(_batches(CONFIGS[name])[0]))
    assert program["attention"] == ("cudnn" if ON_GPU else "xla")
    assert program["memory"]["total"] > 0 and program["kernels"]["fusion"] > 0


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fp8_projections_are_fp8_gemms_in_the_devices_program(name):
    """Under `fp8` the program the device compiled runs the projections as cuBLASLt FP8 GEMMs
    (q, k, v, out and the MLP's: forward and both gradients; the head's three stay bf16) on a
    GPU; a CPU's has none. (With XLA's dot merger on, an H100 ran a Llama's q and kv products
    as one bf16 GEMM: 11 of 15 FP8.)"""
    model = decoder(CONFIGS[name], nnx.Rngs(SEED))
    devices = jax.devices()[:1]
    step = build_step(model, OPTIMIZER, gpt_loss, jshard.Layout("dp", precision="fp8"),
                      jshard.make_mesh(devices=devices, data=1))
    _, program = compiled_for_device(step, step.state, step.shard_batch(_batches(CONFIGS[name])[0]))
    projections = {"gpt": 4, "llama": 5}[name]
    kernels = program["kernels"]
    assert kernels["cublas_fp8"] >= (3 * projections if ON_GPU else 0)
    assert kernels["cublas"] - kernels["cublas_fp8"] <= (3 if ON_GPU else 0)
