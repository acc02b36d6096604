"""The Llama decoder: its published shapes, rotary positions, grouped KV heads under the
rules, and the commands that take it. Parity on every strategy and schedule is in
test_strategies.py and test_pipeline.py (parametrised over both decoders, `decoders.py`)."""

import json

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import jshard
from jshard import planner
from jshard.cli import build_parser, main
from jshard.cli.plan import plan_input
from jshard.models import LLAMA_SIZES, Llama, LlamaConfig, gpt_loss
from jshard.planner.memory import ACTIVATIONS
from jshard.models.llama import rotary
from jshard.nn.attn import attention_implementation
from jshard.parallel import build_step
from jshard.rules import ShardingError
from jshard.app.train_config import TrainConfig
from jshard.app.training import train


@pytest.mark.parametrize("name, published", [
    # Parameter counts of Meta's checkpoints (Hugging Face model cards).
    ("llama-3.2-1b", 1_235_814_400), ("llama-3.1-8b", 8_030_261_248), ("llama-3.1-70b", 70_553_706_496),
])
def test_named_sizes_have_the_published_parameter_counts(name, published):
    model = nnx.eval_shape(lambda: Llama(LLAMA_SIZES[name], rngs=nnx.Rngs(0)))
    assert sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))) == published


def test_matmul_weights_count_the_6n_flops_of_the_params():
    config = LLAMA_SIZES["llama-3.1-8b"]
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    # Every kernel is a matmul once per token; the input embedding is a lookup, norm scales are not.
    matrices = sum(v.size for path, v in params.items() if path[-1] == "kernel")
    assert config.matmul_weights == matrices


def test_rotary_scores_depend_on_the_distance_only():
    # q·k after rotation at positions (i, j) equals the same q·k at (i + s, j + s).
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, 16), dtype=np.float32)
    seq = np.zeros((1, 12, 1, 16), np.float32)
    rq, rk = rotary(seq + q, 10000.0)[0, :, 0], rotary(seq + k, 10000.0)[0, :, 0]
    assert np.allclose(rq[2] @ rk[7], rq[5] @ rk[10], rtol=1e-5)
    assert np.allclose(rq[0] @ rk[0], q @ k, rtol=1e-5)  # position 0: no rotation
    assert not np.allclose(rq[2] @ rk[7], rq[2] @ rk[8], rtol=1e-3)


def test_kv_heads_that_do_not_divide_the_tensor_axis_are_one_error():
    config = LlamaConfig(vocab=64, seq_len=16, embed=32, heads=8, kv_heads=2, mlp=64, layers=2)
    with pytest.raises(ShardingError) as error:
        build_step(Llama(config, rngs=nnx.Rngs(0)), optax.sgd(0.1), gpt_loss,
                   jshard.Layout.of("dp+tp", dict(data=2, tensor=4)))
    assert "blocks/attn/kv/kernel" in str(error.value) and "('kv_heads', size 2) does not divide by tensor=4" in str(error.value)


def test_a_gpt_has_no_kv_heads(capsys):
    assert main(["plan", "--model", "small", "--kv-heads", "2"]) == 2
    assert "a GPTConfig has no kv_heads" in capsys.readouterr().err


def test_plan_counts_the_real_architecture(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "llama-3.1-8b", "--strategy", "fsdp+tp", "--mesh", "fsdp=8,tensor=8",
                 "--json", str(out)]) == 0
    est = json.loads(out.read_text())
    assert est["model"]["params"] == 8_030_261_248 and est["model"]["kind"] == "Llama"
    assert "Llama 32 layers, embed 4096, heads 32 (8 kv)" in capsys.readouterr().out


def test_bench_step_times_a_llama_against_its_plain_flax_twin(tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--model", "llama-tiny", "--batch-size", "8", "--seq-len", "32", "--repeats", "2",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "model       Llama llama-tiny" in text
    jshard_loss, plain_loss = text.split("first-step loss jshard ")[1].split(" (same")[0].split(", plain ")
    assert jshard_loss == plain_loss  # the same model from the same weights, to 6 decimals
    assert json.loads(out.read_text())["model_params"] == 131_392


def test_train_learns_a_llama():
    result = train(TrainConfig.of(model="llama-tiny", strategy="dp+fsdp+tp", steps=40, batch_size=16, seq_len=32))
    assert result.losses[-1] < 0.75 * result.losses[0], result.losses


# -- the attention kernel: cuDNN's flash kernel where it can run, XLA's elsewhere ------------


@pytest.mark.parametrize("choice, platform, dtype, head_dim, expected", [
    ("auto", "cpu", "bfloat16", 128, "xla"),
    ("auto", "gpu", "bfloat16", 128, "cudnn"),
    ("auto", "gpu", "float32", 128, "xla"),  # cuDNN's kernel is bf16 / fp16 only
    ("auto", "gpu", "bfloat16", 100, "xla"),  # head dim not a multiple of 8
    ("auto", "gpu", "bfloat16", 256, "xla"),
    ("xla", "gpu", "bfloat16", 128, "xla"),
    ("cudnn", "gpu", "float16", 64, "cudnn"),
])
def test_attention_implementation(choice, platform, dtype, head_dim, expected):
    assert attention_implementation(choice, dtype, head_dim, platform) == expected


def test_cudnn_where_it_cannot_run_is_one_error(capsys):
    with pytest.raises(ValueError, match="needs a GPU, bf16 or fp16"):
        attention_implementation("cudnn", "bfloat16", 64, "cpu")
    assert main(["train", "--model", "llama-tiny", "--attention", "cudnn", "--steps", "1"]) == 2
    assert "--attention cudnn: attention 'cudnn' needs a GPU" in capsys.readouterr().err
    assert main(["plan", "--model", "llama-tiny", "--attention", "cudnn", "--hardware", "cpu"]) == 2


def test_the_plan_follows_the_kernel():
    def plan_of(*flags):
        args = build_parser().parse_args(["plan", "--model", "llama-3.1-8b", "--strategy", "fsdp", "--mesh", "fsdp=8",
                                          *flags])
        return planner.estimate(plan_input(args))

    flash, xla = plan_of("--precision", "bf16"), plan_of("--precision", "bf16", "--attention", "xla")
    assert (flash["attention"], xla["attention"]) == ("cudnn", "xla")
    config = LLAMA_SIZES["llama-3.1-8b"]
    # XLA keeps the scores (the GPU table's elements per head and key, a token, in bf16) and more
    # per element of q, k, v and its output, in each layer and in the one layer's backward the
    # step holds beside them, and that backward's fp32 score buffers where they outgrow the freed
    # logits (one row); the flash kernel keeps no scores.
    gpu = ACTIVATIONS["gpu"]
    q_k_v_out = config.embed * 2 + 2 * config.kv_heads * config.head_dim
    per_token = gpu.scores * config.heads * config.seq_len + gpu.xla_attention * q_k_v_out
    scores = per_token * 2 * (config.layers + gpu.backward["none"]) * config.seq_len
    logits = config.seq_len * gpu.logits * config.vocab * 4
    scores += max(0, gpu.score_backward * config.heads * config.seq_len**2 - logits)
    difference = xla["memory_bytes_per_device"]["activations"] - flash["memory_bytes_per_device"]["activations"]
    assert difference == pytest.approx(scores, rel=1e-6)
    assert plan_of("--precision", "fp32")["attention"] == "xla"
