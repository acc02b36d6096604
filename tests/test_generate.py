"""`jshard generate`: the KV cache against the full forward, sharded against one device,
sampling, the checkpoint's tokenizer, and every bad input.

Two small checkpoints, saved as `jshard train` saves them, serve every test: the tiny GPT
(bytes), and a tiny Llama with a BPE tokenizer and an older record (no `family`).
"""

import dataclasses
import json
import shutil
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jshard
from jshard.app import tokenizer as tokenizers
from jshard.app.checkpoint import Checkpoints
from jshard.cli import main
from jshard.app.generation import GenerateConfig, generate, load_model, set_up
from jshard.models import SIZES

PROMPT = "ROMEO: What"
NEW = 12  # new tokens per sample
ONE_DEVICE = jshard.make_mesh(devices=jax.devices()[:1])


def save(where, config, on, step, **record):
    """A checkpoint as `jshard train` writes one: the params at full precision (and an optimizer
    state, which generation does not read), a record of the model, and the tokenizer."""
    model = jshard.init(lambda: jshard.models.decoder(config, nnx.Rngs(step)), on, jshard.preset("dp"))
    identity = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("dtype", "remat", "attention")}
    with Checkpoints(where) as checkpoints:
        state = {"params": nnx.state(model, nnx.Param), "opt_state": {"count": jnp.zeros((), jnp.int32)}}
        checkpoints.save(step, state, {"step": step, "model": identity, "seed": step, **record})
    return where


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    """The tiny GPT, untrained (its own head: the tied one greedily repeats one byte), saved on data=8."""
    config = dataclasses.replace(SIZES["tiny"], tied_head=False)
    return save(tmp_path_factory.mktemp("gpt"), config, jshard.make_mesh(data=8), 2, family="GPT",
                tokenizer=tokenizers.ByteTokenizer().identity(), strategy="dp", mesh="data=8")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """llama-tiny over a 320-token BPE saved beside it; its record, as older ones, has no family."""
    bpe = tokenizers.train_bpe([resources.files("jshard.app").joinpath("corpus.txt").read_text("utf-8")], 320)
    config = dataclasses.replace(SIZES["llama-tiny"], vocab=320)
    where = save(tmp_path_factory.mktemp("llama"), config, ONE_DEVICE, 1, tokenizer=bpe.identity())
    bpe.save(str(where))
    return where


@pytest.fixture(scope="module")
def runs(gpt, llama):
    """generate(...)'s new tokens, memoised: run(name, cache=..., mesh=..., ...) -> (samples, NEW)."""
    done = {}

    def run(name, cache=True, strategy="dp", mesh="data=8", num_samples=8, temperature=0.0, **fields):
        key = (name, cache, strategy, mesh, num_samples, temperature, tuple(sorted(fields.items())))
        if key not in done:
            where = {"gpt": gpt, "llama": llama}[name]
            s = set_up(GenerateConfig(str(where), PROMPT, max_tokens=NEW, temperature=temperature, strategy=strategy,
                                      mesh=None if mesh == "one device" else mesh, num_samples=num_samples,
                                      **fields))
            if mesh == "one device":
                s = dataclasses.replace(s, mesh=ONE_DEVICE)
            prompts = np.tile(s.prompt, (num_samples, 1))
            done[key] = generate(load_model(s), prompts, s.sampling, s.mesh, s.rules, cache).tokens
        return done[key]

    return run


# -- the cache ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_greedy_tokens_with_and_without_the_cache_are_the_same(runs, name):
    cached = runs(name)
    assert cached.shape == (8, NEW)
    assert len(np.unique(cached)) > 1, cached  # not one token repeated: the comparison has something to miss
    np.testing.assert_array_equal(cached, runs(name, cache=False))


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_cached_decode_gives_the_full_forwards_logits_at_every_position(gpt, llama, name):
    s = set_up(GenerateConfig(str({"gpt": gpt, "llama": llama}[name]), PROMPT, mesh="data=8", num_samples=8))
    model = load_model(s)
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(0), (8, 24), 0, s.model.vocab)
    full = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))(params, tokens)
    decode = jax.jit(lambda params, tokens, cache, at: nnx.merge(graphdef, params).decode(tokens, cache, at))
    logits, cache = decode(params, tokens[:, :10], model.init_cache(8), jnp.int32(0))  # a prompt of 10
    pieces = [logits]
    for position in range(10, 24):  # then one token at a time
        logits, cache = decode(params, tokens[:, position:position + 1], cache, jnp.int32(position))
        pieces.append(logits)
    np.testing.assert_allclose(np.concatenate(pieces, axis=1), full, atol=1e-5, rtol=0)


# -- sharding -------------------------------------------------------------------------------


@pytest.mark.parametrize("name, strategy, mesh", [
    ("gpt", "dp", "data=8"), ("gpt", "dp+tp", "data=2,tensor=4"), ("llama", "dp", "data=8"),
    ("llama", "dp+tp", "data=4,tensor=2"),
])
def test_sharded_generation_gives_one_devices_tokens(runs, name, strategy, mesh):
    np.testing.assert_array_equal(runs(name, strategy=strategy, mesh=mesh), runs(name, mesh="one device"))


def test_the_cache_is_laid_out_by_the_rules(gpt):
    """The cache a prefill writes, (layers, batch, seq, heads, kv): the samples over data, the
    heads over tensor (as q, k and v: no device reads another's keys)."""
    s = set_up(GenerateConfig(str(gpt), PROMPT, strategy="dp+tp", mesh="data=2,tensor=4", num_samples=8))
    model = load_model(s)
    graphdef, params = nnx.split(model)
    prompts = jnp.asarray(np.tile(s.prompt, (8, 1)))
    with jshard.activate(s.mesh, s.rules):
        prefill = jax.jit(lambda params: nnx.merge(graphdef, params).decode(prompts, model.init_cache(8), 0)[1])
        cache = prefill.lower(params).compile().output_shardings
    wanted = jax.NamedSharding(s.mesh, jax.P(None, "data", None, "tensor", None))
    assert cache.k.is_equivalent_to(wanted, 5) and cache.v.is_equivalent_to(wanted, 5), cache


# -- sampling -------------------------------------------------------------------------------


def test_the_same_seed_draws_the_same_samples_with_or_without_the_cache(runs):
    drawn = runs("gpt", temperature=1.0, seed=3)
    assert len({row.tobytes() for row in drawn}) > 1  # the 8 samples differ from each other
    np.testing.assert_array_equal(drawn, runs("gpt", temperature=1.0, seed=3, cache=False))
    assert not np.array_equal(drawn, runs("gpt", temperature=1.0, seed=4))


def test_top_k_1_is_greedy(runs):
    np.testing.assert_array_equal(runs("gpt", temperature=1.0, top_k=1, seed=3), runs("gpt"))


# -- the command ----------------------------------------------------------------------------


def test_command_reads_and_writes_text_through_the_checkpoints_tokenizer(capsys, llama, tmp_path):
    out = tmp_path / "out.json"
    assert main(["generate", "--checkpoint-dir", str(llama), "--prompt", PROMPT, "--max-tokens", "6",
                 "--mesh", "data=8", "--num-samples", "8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "jshard generate: Llama (2 layers, embed 64, 4 heads (2 kv), vocab 320) from" in printed  # by its fields
    assert "generated 6 tokens × 8 samples in" in printed and "ms per token (cache)" in printed
    report, bpe = json.loads(out.read_text()), tokenizers.load(str(llama))
    assert report["tokenizer"] == bpe.identity() and report["per_token_ms"] > 0
    assert report["prompt_tokens"] == bpe.encode(PROMPT).tolist() and len(report["prompt_tokens"]) < len(PROMPT)
    for text, tokens in zip(report["samples"], report["tokens"], strict=True):
        assert text == bpe.decode(report["prompt_tokens"] + tokens) and text.startswith(PROMPT) and text in printed


# -- bad input: one clear error, exit code 2, before any device work ------------------------


def refused(capsys, argv, *messages):
    assert main(["generate", "--prompt", PROMPT, "--mesh", "data=8"] + argv) == 2
    captured = capsys.readouterr()
    for message in messages:
        assert message in captured.err, captured.err
    assert "jshard generate:" not in captured.out  # nothing loaded, nothing generated
    return captured.err


@pytest.mark.parametrize("flags, messages", [
    (["--step", "7"], ["--step 7:", "holds step 2. Fix: --step 2"]),
    (["--prompt", ""], ["--prompt is empty", "Fix: e.g."]),
    (["--max-tokens", "60"], ["the prompt (11 tokens) and --max-tokens 60 make 71 tokens, more than the model's "
                              "seq_len of 64", "Fix: --max-tokens 53 or less, or a prompt of at most 4 tokens."]),
    (["--max-tokens", "20", "--prompt", "x" * 60], ["the prompt (60 tokens) and --max-tokens 20 make 80 tokens",
                                                     "Fix: --max-tokens 4 or less, or a prompt of at most 44 tokens."]),
    (["--prompt", "x" * 70], ["the prompt (70 tokens) and --max-tokens 1 make 71", "Fix: a prompt of at most 63 tokens."]),
    (["--temperature", "-1"], ["--temperature must be a number >= 0", "Fix: e.g. --temperature 0.8"]),
    (["--top-k", "-3"], ["--top-k must be a positive int", "Fix: e.g. --top-k 40"]),
    (["--top-k", "300"], ["--top-k 300 is more than the model's vocab of 256", "Fix: --top-k 256 or less"]),
    (["--mesh", "data=3"], ["mesh data=3 needs 3 devices, but JAX sees 8"]),
    (["--num-samples", "3"], ["--num-samples 3 does not split over the 8 batch shards of dp on data=8",
                              "Fix: make --num-samples a multiple of 8"]),
    (["--strategy", "tp", "--mesh", "tensor=8"], ["('heads', size 4) does not divide by tensor=8"]),
    (["--strategy", "dp+pp", "--mesh", "data=4,stage=2"], ["pp splits the layers", "Fix: --strategy dp."]),
    (["--strategy", "dp+sp", "--mesh", "data=4,tensor=2"], ["a decode step holds one token", "Fix: --strategy dp+tp."]),
    (["--strategy", "dp+cp", "--mesh", "data=4,context=2"], ["cp splits each sequence", "Fix: --strategy dp."]),
])
def test_bad_flags_are_refused_before_device_work(capsys, gpt, flags, messages):
    refused(capsys, ["--checkpoint-dir", str(gpt)] + flags, *messages)


def test_missing_or_empty_checkpoint_dir_is_refused(capsys, tmp_path):
    refused(capsys, ["--checkpoint-dir", str(tmp_path / "nowhere")], "nowhere does not exist. Fix: point it at")
    refused(capsys, ["--checkpoint-dir", str(tmp_path)], "holds no checkpoint. Fix: point it at")


def copy(where, to):
    shutil.copytree(where, to, dirs_exist_ok=True)
    return to


def test_a_prompt_outside_the_models_vocab_is_refused(capsys, gpt, tmp_path):
    where = copy(gpt, tmp_path / "ascii")
    meta = where / "2" / "meta" / "metadata"  # as if trained with --vocab 128
    record = json.loads(meta.read_text())
    meta.write_text(json.dumps({**record, "model": {**record["model"], "vocab": 128}}))
    refused(capsys, ["--checkpoint-dir", str(where), "--prompt", "café au lait"],
            "--prompt: token 4 of 13 ('é', id 195) is outside the model's vocab of 128 (ids 0..127)",
            "Fix: a prompt without it: with bytes as tokens this model reads bytes below 128 (ASCII text).")


def test_a_tokenizer_other_than_the_checkpoints_is_refused(capsys, gpt, llama, tmp_path):
    bytes_run = copy(gpt, tmp_path / "bytes")
    shutil.copy(llama / tokenizers.FILE, bytes_run / tokenizers.FILE)
    refused(capsys, ["--checkpoint-dir", str(bytes_run)],
            "the checkpoint (step 2) was trained with the tokenizer kind bytes, vocab_size 256, but",
            f"{tokenizers.FILE} is kind bpe", f"Fix: delete {bytes_run / tokenizers.FILE}: the run used bytes.")
    bpe_run = copy(llama, tmp_path / "bpe")
    (bpe_run / tokenizers.FILE).unlink()
    refused(capsys, ["--checkpoint-dir", str(bpe_run)], f"has no {tokenizers.FILE}, which means bytes",
            f"Fix: put the run's {tokenizers.FILE} back in {bpe_run}.")


def test_one_prompt_on_eight_devices_takes_a_mesh_its_samples_fill(capsys, gpt, tmp_path):
    """With no --mesh, dp over 8 devices cannot split 1 sample: the mesh is the most devices whose
    batch shards the samples fill (here one), not a refusal."""
    out = tmp_path / "out.json"
    assert main(["generate", "--checkpoint-dir", str(gpt), "--prompt", PROMPT, "--max-tokens", "4", "--temperature",
                 "0", "--json", str(out)]) == 0
    assert f"dp on one device (1 of {jax.device_count()} × cpu)" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["devices"] == 1 and len(report["tokens"]) == 1
    s = set_up(GenerateConfig(str(gpt), PROMPT, num_samples=6, strategy="dp+tp"))  # 6 samples: data=2 of tensor=2
    sizes = dict(zip(s.mesh.axis_names, s.mesh.axis_sizes))
    assert (sizes["data"], sizes["tensor"], s.mesh.devices.size) == (2, 2, 4)
