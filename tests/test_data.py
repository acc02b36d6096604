"""The user's own data: text files and folders, memory-mapped token files, the BPE tokenizer,
the held-out split and its forward-only evaluation, and every bad input about them."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding

import jshard
from jshard.app import data, documents, tokenizer
from jshard.cli import main
from jshard.models import GPT, GPT_SIZES, gpt_loss
from jshard.parallel import abstract_batch, build_step
from jshard.app.train_config import TrainConfig
from jshard.app.training import train

RUN = dict(model="tiny", batch_size=8, seq_len=32, strategy="dp", mesh="data=8")
CLI = ["train", "--model", "tiny", "--steps", "2", "--batch-size", "8", "--seq-len", "32", "--strategy", "dp",
       "--mesh", "data=8"]
IDS = np.random.default_rng(7).integers(0, 256, 20_000)  # token ids, as a tokeniser would have written them


@pytest.fixture(scope="module")
def token_files(tmp_path_factory):
    where = tmp_path_factory.mktemp("tokens")
    IDS.astype(np.uint16).tofile(where / "ids.bin")  # nanoGPT's layout
    np.save(where / "ids.npy", IDS.astype(np.int32))
    return where


@pytest.mark.parametrize("name, dtype", [("ids.bin", np.uint16), ("ids.npy", np.int32)])
def test_token_files_are_memory_mapped_and_rows_read_from_them(token_files, name, dtype):
    loaded = data.load(str(token_files / name))
    assert isinstance(loaded.tokens, np.memmap) and loaded.tokens.dtype == dtype
    assert loaded.tokenizer is None and loaded.max_id == IDS.max()
    split = data.split(loaded.tokens, 32, seed=0, eval_fraction=0.1)
    assert isinstance(split.train.tokens, np.memmap) and isinstance(split.eval, np.memmap)  # views, nothing read
    assert len(split.eval) == 2000 and len(split.train.tokens) == 18_000
    rows = split.train.rows([0, 1, 500])
    for row in rows:  # every row is a window of the file's first 18,000 ids
        start = [s for s in range(18_000 - 32) if np.array_equal(IDS[s:s + 33], row)]
        assert start and start[0] + 33 <= 18_000
    held = split.eval_batch(1, 8, NamedSharding(jshard.make_mesh(data=8), jax.P("data")))
    np.testing.assert_array_equal(np.asarray(held), IDS[18_000:].astype(np.int32)[8 * 33:16 * 33].reshape(8, 33))


def test_text_folder_is_its_txt_files_in_path_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.txt").write_text("second ")
    (tmp_path / "1.txt").write_text("first, é ")
    (tmp_path / "notes.md").write_text("not read")
    loaded = data.load(str(tmp_path))
    assert tokenizer.ByteTokenizer().decode(loaded.tokens) == "first, é second "
    assert loaded.tokenizer_identity == {"kind": "bytes", "vocab_size": 256}


def test_bpe_round_trips_and_is_saved_and_loaded_as_it_was(tmp_path):
    text = data.corpus_tokens().tobytes().decode()
    bpe = tokenizer.train_bpe([text], 512)
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text and len(ids) < len(text) / 2 and ids.max() < 512
    bpe.save(str(tmp_path))
    loaded = tokenizer.load(str(tmp_path))
    assert loaded.identity() == bpe.identity() and np.array_equal(loaded.encode(text), ids)
    assert tokenizer.load(str(tmp_path / "none")).kind == "bytes"


def test_different_process_counts_build_the_same_global_batch():
    # What each process of a run builds: the rows its devices hold. Split the 8 devices into
    # 1, 2 or 4 processes: every row is built exactly once, and each is row k of the stream.
    stream = data.TextBatches(data.corpus_tokens(), 15, seed=0)
    sharding = NamedSharding(jshard.make_mesh(data=2, fsdp=2, tensor=2), jax.P(("data", "fsdp")))
    held = sharding.devices_indices_map((8, 16))
    for processes in (1, 2, 4):
        devices = sorted(held, key=lambda d: d.id)
        built = {}
        for process in range(processes):
            mine = devices[process * 8 // processes:(process + 1) * 8 // processes]
            rows = sorted({r for d in mine for r in range(8)[held[d][0]]})
            built |= dict(zip(rows, stream.rows([40 + r for r in rows])))
        assert sorted(built) == list(range(8))
        np.testing.assert_array_equal(np.stack([built[r] for r in range(8)]), stream.rows(range(40, 48)))


# -- evaluation: forward only, the same layouts ---------------------------------------------


# The kinds of step: explicit collectives, ZeRO-2's shard-and-replica view, the B/W-split and
# the interleaved pipeline programs, XLA's partitioner. ZeRO-3 + TP, GPipe and 1F1B are
# checked against DP's eval losses in tests/test_train.py's strategy runs.
EVAL_STEPS = [  # (layout, who places the collectives)
    ("dp data=8", "explicit"), ("zero2 fsdp=8", "explicit"), ("pp+dp stage=2,data=4 m=2 schedule=zb-h1", "explicit"),
    ("pp+dp stage=2,data=4 m=2 schedule=interleaved v=2", "explicit"), ("dp+tp data=4,tensor=2", "compiler"),
]


@pytest.mark.parametrize("layout, collectives", EVAL_STEPS)
def test_eval_loss_is_the_one_device_loss_and_leaves_the_state(layout, collectives):
    config = dataclasses.replace(GPT_SIZES["tiny"], layers=4)
    tokens = np.random.default_rng(3).integers(0, 256, (16, 33)).astype(np.int32)  # fresh inputs
    reference = float(gpt_loss(GPT(config, rngs=nnx.Rngs(5)), tokens))  # one device, plain Flax
    layout = jshard.Layout.parse(layout)
    mesh = jshard.make_mesh(**dict(layout.mesh))
    step = build_step(jshard.init(lambda: GPT(config, rngs=nnx.Rngs(5)), mesh, layout.rules), optax.adam(1e-2), gpt_loss,
                      layout, mesh, collectives=collectives)
    batch = step.shard_batch(tokens)
    before = jax.tree.map(np.asarray, step.state.params)
    loss = float(step.loss(step.state, batch))
    assert loss == pytest.approx(reference, rel=1e-6)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, step.state.params), before)
    _, trained = step(step.state, batch)  # the state was neither donated nor changed
    assert float(trained) == pytest.approx(reference, rel=1e-6)


def test_eval_runs_no_backward():
    mesh, rules = jshard.make_mesh(data=8), jshard.preset("dp")
    # only compiled: built from shapes (`abstract`: the program of the step built on the devices)
    step = build_step(nnx.eval_shape(lambda: GPT(GPT_SIZES["tiny"], rngs=nnx.Rngs(0))), optax.sgd(0.1),
                      gpt_loss, jshard.Layout.of(rules, mesh), mesh, abstract=True)
    batch = abstract_batch(step.plan, (8, 33), np.int32)
    forward = step._loss.lower(step.state.params, step.state.model_state, batch, None).compile().cost_analysis()
    training = step.lower(step.state, batch).compile().cost_analysis()
    forward, training = (c[0] if isinstance(c, list) else c for c in (forward, training))
    assert forward["flops"] < training["flops"] / 2.5  # backward is twice the forward


# -- runs on the user's data ------------------------------------------------------------------


def metrics(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_bpe_run_on_a_text_file_resumes_at_the_exact_row(tmp_path):
    text = tmp_path / "book.txt"
    text.write_text(data.corpus_tokens().tobytes().decode() * 2)
    config = dict(RUN, data=str(text), tokenizer="bpe", vocab=512, eval_every=2, steps=4)
    whole = train(TrainConfig.of(**config, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=2,
                              metrics=str(tmp_path / "a.jsonl")))
    assert sorted(whole.eval_losses) == [2, 4]
    assert (tmp_path / "a" / tokenizer.FILE).exists()
    rows = metrics(tmp_path / "a.jsonl")
    assert [r.get("eval_loss") for r in rows] == [None, whole.eval_losses[2], None, whole.eval_losses[4]]
    assert rows[1]["eval_perplexity"] == pytest.approx(np.exp(whole.eval_losses[2]))
    # Cut after step 2; resume without --tokenizer: the saved BPE, the saved data position.
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "4")
    (tmp_path / "b.jsonl").write_text("".join((tmp_path / "a.jsonl").read_text().splitlines(True)[:2]))
    resumed = train(TrainConfig.of(**{**config, "tokenizer": None}, checkpoint_dir=str(tmp_path / "b"), resume=True,
                                metrics=str(tmp_path / "b.jsonl"), plot=str(tmp_path / "b.png")))
    assert resumed.first_step == 2
    assert resumed.losses == whole.losses[2:] and resumed.eval_losses == {4: whole.eval_losses[4]}  # bit for bit
    # The picture of the resumed run is drawn from its metrics file: all four steps.
    assert [r["step"] for r in metrics(tmp_path / "b.jsonl")] == [1, 2, 3, 4]
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def refused(capsys, argv, message):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err, captured.err
    assert "step " not in captured.out  # nothing trained
    return captured.err


@pytest.mark.parametrize("make, flags, message", [
    (None, ["--data", "{tmp}/missing.txt"], "missing.txt: no such file or folder"),
    (lambda tmp: (tmp / "empty.txt").write_text(""), ["--data", "{tmp}/empty.txt"], "empty, no text to train on"),
    (lambda tmp: (tmp / "empty.bin").write_bytes(b""), ["--data", "{tmp}/empty.bin"], "no tokens in it"),
    (lambda tmp: (tmp / "odd.bin").write_bytes(b"abc"), ["--data", "{tmp}/odd.bin"], "not a whole number of uint16"),
    (lambda tmp: np.save(tmp / "m.npy", np.ones((4, 4))), ["--data", "{tmp}/m.npy"], "token ids are a flat integer"),
    (lambda tmp: np.save(tmp / "neg.npy", np.array([3, -1, 2])), ["--data", "{tmp}/neg.npy"], "negative token id"),
    (lambda tmp: np.save(tmp / "big.npy", np.array([3, 300, 2])), ["--data", "{tmp}/big.npy"],
     "token id 300 is outside the model's vocab of 256 (ids 0..255). Fix: --vocab 301"),
    (None, ["--vocab", "64"], "token id 122 is outside the model's vocab of 64"),
    (lambda tmp: (tmp / "x.txt").write_text("short"), ["--data", "{tmp}/x.txt"],
     "--seq-len 32: 5 training tokens hold no window of seq_len + 1 = 33 tokens"),
    (None, ["--eval-every", "1", "--eval-split", "0"], "the held-out split (0 of 35,189 tokens = 0) holds 0 rows"),
    (None, ["--eval-every", "1", "--eval-batches", "40"], "40 batches of 8 rows need 320. Fix: fewer --eval-batches"),
    (None, ["--eval-split", "1"], "--eval-split must be a fraction in [0, 1), got 1.0"),
    (lambda tmp: np.save(tmp / "ids.npy", np.arange(99)), ["--data", "{tmp}/ids.npy", "--tokenizer", "bpe"],
     "holds token ids already; --tokenizer bpe trains on text"),
    (None, ["--tokenizer", "bpe", "--vocab", "200"], "a byte-level BPE needs a vocab above its 256 byte tokens"),
    (None, ["--plot", "{tmp}/no/curves.png"], "curves.png: directory {tmp}/no does not exist; create it first"),
    (None, ["--plot", "{tmp}/curves.txt"], "curves.txt: matplotlib writes no .txt picture; name it .png"),
])
def test_bad_data_is_refused_before_device_work(capsys, tmp_path, make, flags, message):
    if make:
        make(tmp_path)
    refused(capsys, CLI + [f.format(tmp=tmp_path) for f in flags], message.format(tmp=tmp_path))


def test_a_checkpoint_of_another_tokenizer_is_refused(capsys, tmp_path):
    bpe = ["--tokenizer", "bpe", "--vocab", "320"]
    assert main(CLI + bpe + ["--checkpoint-dir", str(tmp_path)]) == 0
    capsys.readouterr()
    resume = CLI + ["--steps", "3", "--checkpoint-dir", str(tmp_path), "--resume"]
    err = refused(capsys, resume + ["--tokenizer", "bytes", "--vocab", "320"],
                  "tokenizer.kind: saved 'bpe', this run 'bytes'")
    assert "(step 2)" in err
    # A tokenizer file swapped in beside the checkpoints is not the one it was trained with.
    trained = tokenizer.load(str(tmp_path)).identity()
    tokenizer.train_bpe(["some other text"], 320).save(str(tmp_path))
    refused(capsys, resume, f"was trained with tokenizer {trained}")


# -- documents: JSONL, Parquet, a datasets.save_to_disk folder --------------------------------


DOCS = ["It is a truth universally acknowledged,", "that a single man in possession of a good fortune", "",
        "must be in want of a wife. é"]  # an empty document too: it still ends with the separator


def write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))


def write_parquet(path, docs, field="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path, row_group_size=2)


def write_save_to_disk(path, docs, field="text"):
    """The folder `datasets.Dataset.save_to_disk` writes: Arrow IPC streams named by state.json."""
    import pyarrow as pa

    path.mkdir()
    names = []
    for i, part in enumerate((docs[:2], docs[2:])):
        names.append(f"data-{i:05d}-of-00002.arrow")
        with pa.OSFile(str(path / names[-1]), "wb") as sink, \
                pa.ipc.new_stream(sink, pa.schema([(field, pa.string())])) as writer:
            writer.write_table(pa.table({field: part}))
    (path / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (path / "dataset_info.json").write_text("{}")


FORMATS = {"jsonl": ("d.jsonl", write_jsonl), "parquet": ("d.parquet", write_parquet),
           "save_to_disk": ("saved", write_save_to_disk)}


@pytest.fixture
def token_cache(tmp_path, monkeypatch):
    """Tokenised documents kept under the test's folder, not ~/.cache."""
    monkeypatch.setattr(documents, "cache_dir", lambda: str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("form", FORMATS)
def test_documents_read_as_the_same_text_in_a_txt_file(tmp_path, token_cache, form):
    name, write = FORMATS[form]
    write(tmp_path / name, DOCS, "body")
    (tmp_path / "same.txt").write_text("".join(d + documents.SEPARATOR for d in DOCS))
    loaded = data.load(str(tmp_path / name), text_field="body")
    assert isinstance(loaded.tokens, np.memmap) and f"{len(DOCS)} documents" in loaded.source
    np.testing.assert_array_equal(loaded.tokens, data.load(str(tmp_path / "same.txt")).tokens)
    again = data.load(str(tmp_path / name), text_field="body")  # the cached token file, read again
    assert again.tokens.filename == loaded.tokens.filename and len(list(token_cache.iterdir())) == 2


def test_documents_end_with_the_tokenizers_eos(tmp_path, token_cache):
    write_jsonl(tmp_path / "d.jsonl", DOCS)
    bpe = tokenizer.train_bpe(DOCS, 300)
    bpe.eos_id = 299  # as a Hugging Face model's config.json names one
    loaded = data.load(str(tmp_path / "d.jsonl"), tokenizer=bpe)
    expected = np.concatenate([np.append(bpe.encode(d), 299) for d in DOCS])
    np.testing.assert_array_equal(loaded.tokens, expected)
    assert "EOS id 299 after each document" in loaded.source


def test_a_large_jsonl_is_read_in_bounded_memory(tmp_path, token_cache, monkeypatch):
    """A read holds one chunk of text and its ids, not the file: tracemalloc's peak (numpy's
    arrays and Python's strings) stays far under the file's size."""
    import tracemalloc

    monkeypatch.setattr(documents, "CHUNK_CHARS", 1 << 16)
    line = json.dumps({"text": "x" * 900}) + "\n"
    (tmp_path / "big.jsonl").write_text(line * 8000)  # 7.3 MB
    size = (tmp_path / "big.jsonl").stat().st_size
    tracemalloc.start()  # (the id scan after it reads in chunks of its own: data.SCAN_CHUNK)
    tokens, _, count = documents.tokenize(documents.open_documents(str(tmp_path / "big.jsonl")),
                                          tokenizer.ByteTokenizer())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert count == 8000 and len(tokens) == 8000 * 902 and peak < size / 20, (peak, size)


BAD_DOCUMENTS = [
    ("d.jsonl", b'{"text": "one"}\n{"text": two}\n', "d.jsonl:2: not JSON"),
    ("d.jsonl", b'{"text": "one"}\n\n{"body": "x", "id": 3}\n', "d.jsonl:3: no field 'text' (its fields: 'body', 'id'). "
                                                                 "Fix: --text-field body."),
    ("d.jsonl", b'{"text": 7}\n', "d.jsonl:1: field 'text' is 7, not a string"),
    ("d.jsonl", b'{"text": "\xff"}\n', "d.jsonl:1: not UTF-8 (byte 10 of the line)"),
    ("d.jsonl", b'["text"]\n', "d.jsonl:1: a JSON list, not an object"),
    ("d.jsonl", b"", "d.jsonl: empty, no documents in it"),
    ("d.parquet", None, "d.parquet: row 3 has no 'text' (null)"),
    ("d.parquet", b"PAR1 not really", "d.parquet: not a Parquet file"),
]


@pytest.mark.parametrize("name, content, message", BAD_DOCUMENTS, ids=[m.split(": ", 1)[1][:24] for *_, m in BAD_DOCUMENTS])
def test_bad_documents_are_one_line_naming_the_row(capsys, tmp_path, token_cache, name, content, message):
    if content is None:
        write_parquet(tmp_path / name, ["a", "b", None])
    else:
        (tmp_path / name).write_bytes(content)
    err = refused(capsys, CLI + ["--data", str(tmp_path / name)], f"--data {tmp_path / name}{message[len(name):]}")
    assert len(err.strip().splitlines()) == 1


def test_a_run_trains_on_a_save_to_disk_folder(capsys, tmp_path, token_cache):
    write_save_to_disk(tmp_path / "saved", [data.corpus_tokens().tobytes().decode()[:9000]] * 2, "content")
    assert main(CLI + ["--steps", "1", "--data", str(tmp_path / "saved"), "--text-field", "content"]) == 0
    assert "2 documents (arrow) -> 18,004 tokens (bytes, a blank line after each document" in capsys.readouterr().out
