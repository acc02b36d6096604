"""Hugging Face checkpoints in and out (`jshard.app.hf`), held to transformers' own numbers.

The references are transformers' (PyTorch, fp32) on tiny random models of each family, saved
with `save_pretrained` beside the logits, loss and greedy tokens it gave (`tests/hf/`, made by
`tests/hf/make_fixtures.py`): jshard computes none of them. Where JSHARD_HF_PYTHON names a
Python with transformers (CI builds one), exports are also loaded back by transformers."""

import glob
import json
import os
import shutil
import subprocess
import sys
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

import jshard
from jshard.app import hf
from jshard.nn.losses import PAD_LOGIT
from jshard.app.generation import GenerateConfig, Sampling, generate, run_generation
from jshard.models import decoder, gpt_loss
from jshard.parallel import build_step
from jshard.app.prepare import set_up
from jshard.app.train_config import TrainConfig, TrainError
from jshard.app.training import train
from parity import OPTIMIZER

HERE = os.path.join(os.path.dirname(__file__), "hf")
FIXTURES = os.path.join(HERE, "fixtures")
FAMILIES = ["llama", "llama-tied", "mistral", "qwen2", "qwen3", "mixtral", "gpt2"]
LOGITS_TOLERANCE = 1e-4  # relative to the largest logit, fp32
# Strategies that split each family's params, the loss held under each: ZeRO-3, the three axes, a pipeline.
STRATEGIES = [("zero3", dict(fsdp=8)), ("dp+fsdp+tp", dict(data=2, fsdp=2, tensor=2)),
              ("fsdp+tp+pp", dict(fsdp=2, tensor=2, stage=2))]


def fixture(family: str) -> str:
    return os.path.join(FIXTURES, family)


def reference(family: str) -> dict:
    return dict(np.load(os.path.join(fixture(family), "reference.npz")))


def imported(directory: str, sharding=None):
    """The model of a Hugging Face directory, its params on one device (or `sharding`)."""
    config = hf.model_config(hf.read_config(directory), directory)
    abstract = nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0)))
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=sharding), nnx.state(abstract, nnx.Param))
    return nnx.merge(nnx.graphdef(abstract), hf.load_params(directory, config, like)), config


def flat_params(model) -> dict:
    return {tuple(map(str, path)): np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def tensors_of(directory: str) -> dict:
    found = {}
    for path in glob.glob(os.path.join(directory, "*.safetensors")):
        found |= load_file(path)
    return found


def relative_error(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


# -- transformers (JSHARD_HF_PYTHON): one process of that Python for the module's checks -----------
# Each check is `check_with_transformers.main(argv)`, the script's own, as its command line runs it;
# the process imports torch and transformers once (~5 s of each check's ~6 s when each was a process).
_SERVE = r"""
import contextlib, io, json, sys, traceback
sys.path.insert(0, sys.argv[1])
import check_with_transformers
for line in sys.stdin:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = check_with_transformers.main(json.loads(line))
        except BaseException:
            traceback.print_exc()
            code = 1
    print(sys.argv[2], json.dumps(dict(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())), flush=True)
"""
_transformers = {}  # the process, while one runs


def with_transformers(*argv: str) -> subprocess.CompletedProcess:
    """`JSHARD_HF_PYTHON tests/hf/check_with_transformers.py *argv`: its exit status, stdout and
    stderr (with whatever the process wrote outside a check: a crash's last words)."""
    process = _transformers.get("process")
    if process is None or process.poll() is not None:
        tag = f"jshard-hf-{uuid.uuid4().hex}"
        process = subprocess.Popen([os.environ["JSHARD_HF_PYTHON"], "-c", _SERVE, HERE, tag], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _transformers.update(process=process, tag=tag)
    process.stdin.write(json.dumps(list(argv)) + "\n")
    process.stdin.flush()
    other = []
    for line in process.stdout:
        if line.startswith(_transformers["tag"] + " "):
            done = json.loads(line.split(" ", 1)[1])
            stderr = "".join(other) + done["stderr"]
            return subprocess.CompletedProcess(argv, done["returncode"], done["stdout"], stderr)
        other.append(line)
    _transformers.clear()  # it ended within the check
    return subprocess.CompletedProcess(argv, process.wait(), "", "".join(other))


@pytest.fixture(scope="module", autouse=True)
def _transformers_process():
    yield
    if process := _transformers.pop("process", None):
        process.stdin.close()
        process.wait(timeout=60)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.fast
def test_hf_logits_match_transformers(family):
    model, _ = imported(fixture(family))
    ref = reference(family)
    assert relative_error(model(jnp.asarray(ref["ids"])), ref["logits"]) < LOGITS_TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_greedy_tokens_match_transformers(family):
    model, _ = imported(fixture(family))
    ref = reference(family)
    out = generate(model, ref["prompt"], Sampling(max_tokens=16, temperature=0.0), jshard.make_mesh(
        devices=jax.devices()[:1], data=1), jshard.preset("dp"))
    np.testing.assert_array_equal(out.tokens, ref["greedy"])


# Left out: mistral under STRATEGIES (its params are Llama's, the same LlamaConfig fields, split as
# llama's are) and dp on the other families (the batch split alone: the loss convention is one for
# every family), so dp runs on mistral. Beside them: experts over their own axis; sequence parallelism
# over the features it meets (biases added after a reduce-scatter, norms of each head's queries and keys).
CASES = [("mistral", "dp", dict(data=8))] + [(f, p, s) for f in FAMILIES if f != "mistral" for p, s in STRATEGIES] + [
    ("mixtral", "dp+ep", dict(data=2, expert=4))] + [
    (f, "dp+fsdp+tp+sp", dict(data=2, fsdp=2, tensor=2)) for f in ("qwen2", "qwen3", "gpt2")]


@pytest.mark.parametrize("family, preset, sizes", CASES, ids=[f"{f}-{p}" for f, p, _ in CASES])
def test_hf_sharded_loss_matches_transformers(family, preset, sizes):
    """transformers' loss with labels=input_ids is jshard's next-token loss on the same ids."""
    model, _ = imported(fixture(family))
    ref = reference(family)
    pipelined = "stage" in sizes
    step = build_step(model, OPTIMIZER, gpt_loss,
                      jshard.Layout.of(preset, sizes, microbatches=2 if pipelined else None))
    ids, expected = ref["ids"], float(ref["loss"])
    if "sp" in preset.split("+"):  # sequence parallelism splits the 23 positions: 22, and transformers'
        ids = ids[:, :23]          # loss over them from its own logits (causal: the same for a shorter input)
        logits = ref["logits"][:, :22].astype(np.float64)
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        expected = float(-np.take_along_axis(logp, ids[:, 1:, None], -1).mean())
    rows = np.tile(ids, (4, 1))  # 8 rows: every batch split divides; the mean is the same
    loss = float(step.loss(step.state, step.shard_batch(rows)))
    assert abs(loss - expected) <= 1e-4 * abs(expected), (loss, expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_import_export_import_is_bit_identical(family, tmp_path):
    model, config = imported(fixture(family))
    family_type = hf.read_config(fixture(family))["model_type"]
    shard = 200_000 if family == "llama" else 5 * 2**30  # llama's fixture is 3 shards: so is its export
    files = hf.export(flat_params(model), config, str(tmp_path), family=family_type, max_shard_bytes=shard,
                      tokenizer=os.path.join(fixture(family), hf.TOKENIZER))
    assert (hf.INDEX in files) == (family == "llama")
    original, exported = tensors_of(fixture(family)), tensors_of(str(tmp_path))
    assert sorted(original) == sorted(exported)
    for name in original:
        assert original[name].dtype == exported[name].dtype and np.array_equal(original[name], exported[name]), name
    again, again_config = imported(str(tmp_path))
    assert again_config == config
    for path, value in flat_params(model).items():
        np.testing.assert_array_equal(flat_params(again)[path], value)
    python = os.environ.get("JSHARD_HF_PYTHON")
    if python:  # transformers loads the export and gives its own logits back exactly
        checked = with_transformers(fixture(family), str(tmp_path))
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert json.loads(checked.stdout.strip().splitlines()[-1])["max_rel_err"] <= 1e-5


def test_hf_from_pretrained_reads_each_device_block_into_its_shards():
    """Under zero3 each device holds its own slice of each param, in the dtype asked for."""
    mesh, rules = jshard.make_mesh(fsdp=8), jshard.preset("zero3")
    model = hf.from_pretrained(fixture("llama"), mesh, rules, dtype=jnp.bfloat16)
    expected_shardings = dict(nnx.to_flat_state(jshard.shardings(nnx.state(model, nnx.Param), mesh, rules)))
    whole, _ = imported(fixture("llama"))
    split = 0
    for path, value in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        array = value.get_value()
        assert array.dtype == jnp.bfloat16 and array.sharding == expected_shardings[path].get_value()
        np.testing.assert_array_equal(np.asarray(array), flat_params(whole)[tuple(map(str, path))].astype(jnp.bfloat16))
        if array.sharding.spec != jax.P():  # a split param: each device holds a block, not the whole
            assert all(s.data.size * 8 == array.size for s in array.addressable_shards)
            split += 1
    assert split >= 8  # the layers' matrices, the embedding and the head


def transformers_loss(directory: str, ids: np.ndarray, tmp_path) -> float | None:
    """transformers' loss of `directory` on `ids` (labels=input_ids), where JSHARD_HF_PYTHON is set."""
    python = os.environ.get("JSHARD_HF_PYTHON")
    if not python:
        return None
    np.save(tmp_path / "ids.npy", ids)
    out = with_transformers("--loss", directory, str(tmp_path / "ids.npy"))
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["loss"]


def trained_from_hf(config: TrainConfig, tmp_path):
    """(set-up, result, first batch, expected first loss) of `train(config)`, an `--init-from` run:
    the expected loss transformers' on the run's first batch (with JSHARD_HF_PYTHON; else the
    imported model's on one device, whose logits the tests above hold to transformers')."""
    setup = set_up(config)
    first_batch = setup.split.train.rows(range(config.data.batch_size))
    setup.checkpoints.close()
    result = train(config)
    expected = transformers_loss(config.model.init_from, first_batch, tmp_path)
    if expected is None:
        model, _ = imported(config.model.init_from)
        expected = float(gpt_loss(model, jnp.asarray(first_batch)))
    return setup, result, first_batch, expected


def test_hf_train_init_from_fine_tunes_and_exports(tmp_path, capsys):
    """`jshard train --init-from` under dp+fsdp+tp starts from the imported weights: its first
    loss is transformers' on that batch (with JSHARD_HF_PYTHON; else the imported model's on
    one device, whose logits the tests above hold to transformers'); it trains; `export_checkpoint`
    writes the result as a directory jshard (and transformers) reads back."""
    directory = str(tmp_path / "llama")
    shutil.copytree(fixture("llama"), directory)
    config = TrainConfig.of(init_from=directory, strategy="dp+fsdp+tp", steps=20, batch_size=8,
                         checkpoint_dir=str(tmp_path / "ck"))
    _, result, first_batch, expected = trained_from_hf(config, tmp_path)
    assert f"weights     from {directory}" in capsys.readouterr().out
    assert abs(result.losses[0] - expected) <= 1e-4 * expected, (result.losses[0], expected)
    assert result.losses[-1] < result.losses[0] - 0.5
    exported = str(tmp_path / "exported")
    files = hf.export_checkpoint(str(tmp_path / "ck"), exported)
    assert hf.CONFIG in files and hf.TOKENIZER in files
    again, again_config = imported(exported)
    assert again_config == hf.model_config(hf.read_config(directory))
    assert transformers_loss(exported, first_batch, tmp_path) in (None, pytest.approx(
        float(gpt_loss(again, jnp.asarray(first_batch))), rel=1e-4))


@pytest.mark.parametrize("change, message", [
    (dict(model_type="gpt_neox"), "model_type 'gpt_neox' is not one jshard imports"),
    (dict(sliding_window=16), "sliding_window = 16"),
    (dict(hidden_act="gelu"), "hidden_act = 'gelu'"),
    (dict(attention_bias=True), "attention_bias = True"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e4)), "rope type 'yarn'"),
    (dict(hidden_size=48), "k_proj.weight has shape [32, 64], where the config gives"),
    (dict(num_hidden_layers="2"), "num_hidden_layers = '2': a size must be a positive integer"),
    (dict(rope_parameters=dict(rope_type="llama3", rope_theta=1e4)), "no field 'factor'"),
])
@pytest.mark.fast
def test_hf_bad_configs_get_one_line(tmp_path, change, message):
    directory = str(tmp_path / "model")
    shutil.copytree(fixture("llama"), directory)
    config = hf.read_config(directory) | change
    with open(os.path.join(directory, hf.CONFIG), "w") as f:
        json.dump(config, f)
    with pytest.raises(hf.HFError, match=message.replace("[", r"\[").replace("(", r"\(")):
        imported(directory)


def test_hf_missing_and_extra_tensors_are_named(tmp_path):
    directory = str(tmp_path / "model")
    shutil.copytree(fixture("qwen3"), directory)
    tensors = load_file(os.path.join(directory, hf.SINGLE))
    from safetensors.numpy import save_file
    save_file(tensors | {"score.weight": np.zeros((2, 64), np.float32)}, os.path.join(directory, hf.SINGLE))
    with pytest.raises(hf.HFError, match="no place for: score.weight"):
        imported(directory)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, os.path.join(directory, hf.SINGLE))
    with pytest.raises(hf.HFError, match="no tensor 'model.layers.1.self_attn.k_norm.weight'"):
        imported(directory)
    os.remove(os.path.join(directory, hf.SINGLE))
    with pytest.raises(hf.HFError, match="neither model.safetensors nor"):
        imported(directory)
    with pytest.raises(hf.HFError, match="no config.json"):
        imported(str(tmp_path))


def test_hf_commands_refuse_bad_input_in_one_line(tmp_path):
    with pytest.raises(TrainError, match="--init-from .* gives the model and its tokenizer; --layers"):
        train(TrainConfig.of(init_from=fixture("llama"), layers=4))
    from jshard.app.generation import GenerateError
    with pytest.raises(GenerateError, match="one of them"):
        run_generation(GenerateConfig(checkpoint_dir=None, prompt="x"))
    cli = subprocess.run([sys.executable, "-m", "jshard.cli", "export", "--checkpoint-dir", str(tmp_path), "--to",
                          str(tmp_path / "out")], capture_output=True, text=True)
    assert cli.returncode == 2 and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    assert "holds no checkpoint" in cli.stderr


@pytest.mark.parametrize("value, said", [
    (np.nan, "before any update: the params it started from \\({directory}\\) are not finite"),
    # Finite weights whose forward overflows (the final norm's 1e38 times the logits' sums):
    (1e38, "before any update, though the params it started from \\({directory}\\) are finite: the forward "
           "overflows in fp32; training stopped, no checkpoint was written. Fix: other weights or data."),
], ids=["nan", "overflow"])
def test_hf_weights_whose_loss_is_not_finite_stop_the_first_step(tmp_path, value, said):
    directory = str(tmp_path / "model")
    shutil.copytree(fixture("qwen3"), directory)
    tensors = load_file(os.path.join(directory, hf.SINGLE))
    tensors["model.norm.weight"][3 if np.isnan(value) else slice(None)] = value
    from safetensors.numpy import save_file
    save_file(tensors, os.path.join(directory, hf.SINGLE))
    with pytest.raises(TrainError, match=r"step 1: the loss is (nan|inf) at the first step, " + said.format(directory=directory)):
        train(TrainConfig.of(init_from=directory, strategy="dp", steps=2, batch_size=8))


def test_hf_init_from_trains_on_a_token_file_of_its_ids_and_generates_from_the_run(tmp_path, capsys):
    """`--init-from DIR --data ids.npy`: the ids as given (its tokenizer's), the first loss
    transformers' on the first batch; the run keeps the model's tokenizer beside its checkpoint,
    so `generate` reads it back, on a mesh its one sample fills."""
    directory = str(tmp_path / "llama")
    shutil.copytree(fixture("llama"), directory)
    ids = np.random.default_rng(11).integers(0, 320, 4000)
    np.save(tmp_path / "ids.npy", ids.astype(np.int32))
    config = TrainConfig.of(init_from=directory, data=str(tmp_path / "ids.npy"), strategy="dp", mesh="data=8", steps=1,
                         batch_size=8, seq_len=23, checkpoint_dir=str(tmp_path / "ck"))
    setup, result, first_batch, expected = trained_from_hf(config, tmp_path)
    assert setup.data.tokenizer_identity["kind"] == "bpe" and setup.data.max_id == ids.max()
    assert abs(result.losses[0] - expected) <= 1e-4 * expected, (result.losses[0], expected)
    assert os.path.exists(tmp_path / "ck" / hf.TOKENIZER)
    capsys.readouterr()
    run_generation(GenerateConfig(str(tmp_path / "ck"), "ab", max_tokens=3))
    assert "dp on one device (1 of 8 × cpu)" in capsys.readouterr().out
    np.save(tmp_path / "ids.npy", np.append(ids, 320).astype(np.int32))  # one id past the model's vocab
    with pytest.raises(TrainError, match=r"token id 320 is outside the vocab of .*llama \(320: ids 0..319\)\. Fix: "):
        set_up(config.replace(checkpoint_dir=None))


# -- a vocabulary no tensor axis divides: GPT-2's 50257 -----------------------------------------------
# The fixture is GPT-2 with its released vocabulary (tests/hf/fixtures/gpt2-vocab: one small layer,
# transformers' loss and greedy tokens, no logits kept). Under a split of the vocab its table is
# padded to 50304 rows (`Layout.model`), the pad rows zero and their logits `jshard.nn.losses.PAD_LOGIT`.
GPT2_VOCAB, GPT2_TABLE = 50257, 50304
SPLIT_VOCAB = [("dp", dict(data=8)), ("dp+tp", dict(data=4, tensor=2)), ("dp+tp", dict(data=2, tensor=4)),
               ("zero3+tp", dict(fsdp=2, tensor=4))]


@pytest.mark.parametrize("preset, sizes", SPLIT_VOCAB, ids=[f"{p}-{'x'.join(map(str, s.values()))}" for p, s in SPLIT_VOCAB])
def test_hf_gpt2_vocabulary_splits_over_the_tensor_axis_at_transformers_loss(preset, sizes):
    layout = jshard.Layout.of(preset, sizes)
    model = hf.from_pretrained(fixture("gpt2-vocab"), jshard.make_mesh(**sizes), layout.rules)
    assert model.token_embed.embedding.shape[0] == (GPT2_TABLE if "tensor" in sizes else GPT2_VOCAB)
    step = build_step(model, OPTIMIZER, gpt_loss, layout)
    ref = reference("gpt2-vocab")
    loss = float(step.loss(step.state, step.shard_batch(np.tile(ref["ids"], (4, 1)))))
    assert abs(loss - float(ref["loss"])) <= 1e-5 * float(ref["loss"]), (loss, float(ref["loss"]))


def padded_gpt2():
    """The fixture's model with its table padded as a tensor split pads it, on one device."""
    config = jshard.Layout.of("dp+tp", dict(data=4, tensor=2)).model(hf.model_config(hf.read_config(fixture("gpt2-vocab"))))
    abstract = nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0)))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    like = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=one), nnx.state(abstract, nnx.Param))
    return nnx.merge(nnx.graphdef(abstract), hf.load_params(fixture("gpt2-vocab"), config, like)), config


@pytest.mark.fast
def test_hf_padded_vocabulary_is_never_a_token():
    """The pad rows read as zeros, their logits PAD_LOGIT; the real logits, the loss and greedy
    decoding those of the unpadded model (transformers' greedy tokens)."""
    padded, config = padded_gpt2()
    plain, _ = imported(fixture("gpt2-vocab"))
    assert (config.vocab, config.vocab_rows) == (GPT2_VOCAB, GPT2_TABLE)
    table = np.asarray(padded.token_embed.embedding.get_value())
    np.testing.assert_array_equal(table[:GPT2_VOCAB], np.asarray(plain.token_embed.embedding.get_value()))
    assert not table[GPT2_VOCAB:].any()
    ref = reference("gpt2-vocab")
    logits = np.asarray(padded(jnp.asarray(ref["ids"])))
    assert relative_error(logits[..., :GPT2_VOCAB], plain(jnp.asarray(ref["ids"]))) < 1e-6  # (another GEMM's rounding)
    assert (logits[..., GPT2_VOCAB:] == PAD_LOGIT).all()
    assert float(gpt_loss(padded, jnp.asarray(ref["ids"]))) == pytest.approx(float(ref["loss"]), rel=1e-5)
    mesh = jshard.make_mesh(devices=jax.devices()[:1], data=1)
    greedy = generate(padded, ref["prompt"], Sampling(max_tokens=16, temperature=0.0), mesh, jshard.preset("dp"))
    np.testing.assert_array_equal(greedy.tokens[:, :5], ref["greedy"][:, :5])  # (the margin after: 1e-4)
    # pad rows that would win every draw were their logits not masked (the tied head reads the table)
    padded.token_embed.embedding.set_value(jnp.asarray(table).at[GPT2_VOCAB:].set(1.0))
    sampled = generate(padded, ref["prompt"], Sampling(max_tokens=48, temperature=2.0, seed=3), mesh, jshard.preset("dp"))
    assert sampled.tokens.max() < GPT2_VOCAB


def test_hf_gpt2_vocabulary_trains_under_tp_and_exports_unpadded(tmp_path, capsys):
    """`train --init-from` GPT-2 with a token file under dp+tp: the table padded (said in the
    set-up), the first loss transformers' on the first batch; resumed under dp it keeps the
    checkpoint's table; generated from; exported with GPT-2's own 50257 rows, which jshard and
    transformers read back."""
    directory = str(tmp_path / "gpt2")
    shutil.copytree(fixture("gpt2-vocab"), directory)
    ids = np.random.default_rng(5).integers(0, GPT2_VOCAB, 3000)
    np.save(tmp_path / "tokens.npy", ids.astype(np.int32))
    config = TrainConfig.of(init_from=directory, data=str(tmp_path / "tokens.npy"), strategy="dp+tp", mesh="data=4,tensor=2",
                         steps=1, batch_size=8, seq_len=23, checkpoint_dir=str(tmp_path / "ck"))
    _, result, first_batch, expected = trained_from_hf(config, tmp_path)
    assert f"vocab {GPT2_VOCAB} (table {GPT2_TABLE}: padded" in capsys.readouterr().out
    assert abs(result.losses[0] - expected) <= 1e-5 * expected, (result.losses[0], expected)
    resumed = train(config.replace(strategy="dp", mesh="data=8", steps=2, resume=True))
    assert len(resumed.losses) == 1 and np.isfinite(resumed.losses[0])
    with pytest.raises(jshard.app.generation.GenerateError, match=r"no tokenizer.json, and its vocab of 50257 is not bytes' "
                                                             r"256: .* Fix: put the model's tokenizer.json in "):
        run_generation(GenerateConfig(None, "ab", init_from=directory))  # (the fixture has none)
    shutil.copyfile(os.path.join(fixture("gpt2"), hf.TOKENIZER), os.path.join(directory, hf.TOKENIZER))
    # (a tokenizer of 320 ids reads the prompt): generate's model, imported under tp, is padded as train's
    generating = jshard.app.generation.set_up(GenerateConfig(None, "ab", init_from=directory, strategy="dp+tp",
                                                       mesh="data=2,tensor=4", num_samples=2))
    assert (generating.model.vocab_rows, generating.abstract.token_embed.embedding.shape[0]) == (GPT2_TABLE,) * 2
    # tp's default mesh over 8 devices splits 4 heads 8 ways: generate takes the 4 devices that split them
    generating = jshard.app.generation.set_up(GenerateConfig(None, "ab", init_from=directory, strategy="tp"))
    assert generating.mesh.devices.size == 4 and generating.model.vocab_rows == GPT2_TABLE
    exported = str(tmp_path / "exported")
    hf.export_checkpoint(str(tmp_path / "ck"), exported)
    assert tensors_of(exported)["transformer.wte.weight"].shape == (GPT2_VOCAB, 16)
    again, again_config = imported(exported)
    assert again_config == hf.model_config(hf.read_config(directory))
    assert transformers_loss(exported, first_batch, tmp_path) in (None, pytest.approx(
        float(gpt_loss(again, jnp.asarray(first_batch))), rel=1e-5))
