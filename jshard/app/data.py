"""Training data: the shipped corpus or the user's own, tokenised, split, in a fixed order.

    load(None)                    the public-domain text shipped with jshard (the default)
    load("notes.txt"), load(dir)  text files (a folder: every *.txt under it, sorted by path)
    load("train.bin")             token ids, nanoGPT's layout: a flat array of uint16
    load("train.npy")             token ids, a flat integer array saved by numpy
    load("docs.jsonl"), load("docs.parquet"), load(saved_dir)
                                  documents (JSONL, Parquet, a `datasets.save_to_disk` folder),
                                  streamed through the tokenizer into a cached token file (`documents.py`)

Text is tokenised here, by bytes (vocab 256: nothing to ship or download) or a BPE trained
on it (`tokenizer.py`). Token files are opened as numpy memory maps: nothing is read until
a row is, so a file far larger than memory trains, and each process reads only the rows
its devices hold. The shuffle is grain's `index_shuffle`, a keyed bijection on the window
indices: row k's window is computed, not looked up in a permutation array, so the order
costs no memory however many windows there are (a permutation of a 100 G-token file's
windows would be 12 GiB). Reading a few rows of one flat array needs no more of grain (no
worker pool, no record format).

The last `eval_split` of the tokens is held out for evaluation (`Split`), never trained on.

Order: the training tokens are cut into windows of seq_len + 1 tokens (inputs and their
next-token targets); each epoch shifts the cut by a random offset and visits every window
once in a random order. Both come from (seed, epoch) only, so row k of the stream is the
same in every run, on every process count and after a restart: the data position is just
the number of rows consumed. Evaluation reads the held-out windows in order, from the
first, so every evaluation scores the same rows.

Each process builds only its own rows of a global batch (the rows its devices hold under
the batch sharding) and hands them to `jax.make_array_from_process_local_data`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from importlib import resources

import jax
import numpy as np

from jshard.app import documents
from jshard.app import tokenizer as tokenizers

CORPUS = "corpus.txt"  # public-domain texts, in the package beside this module
TOKEN_FILES = (".bin", ".npy")  # pre-tokenised: read through a memory map
TEXT_SUFFIX = ".txt"  # what a folder's text files end with
SCAN_CHUNK = 1 << 24  # tokens per read while checking a token file's ids (64 MiB of uint32)


class DataError(ValueError):
    """Data that cannot be trained on as asked."""


def corpus_tokens() -> np.ndarray:
    """The shipped corpus as int32 byte values."""
    return load(None).tokens


@dataclasses.dataclass
class Data:
    """Tokens to train and evaluate on, and where they came from."""

    tokens: np.ndarray  # 1-D ints: in memory (text) or a memory map (token files)
    source: str  # for the set-up line: what was read
    identity: dict  # what a checkpoint records and a resumed run must match
    tokenizer: tokenizers.ByteTokenizer | tokenizers.BPETokenizer | None  # None: token files (ids given)
    max_id: int  # the largest token id: the model's vocab must exceed it

    @property
    def tokenizer_identity(self) -> dict:
        """What a checkpoint records of the tokenizer: its identity, or that ids were given."""
        return self.tokenizer.identity() if self.tokenizer else {"kind": "ids"}


def _text_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    files = sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                   if name.endswith(TEXT_SUFFIX) and not name.startswith("."))
    if not files:
        raise DataError(f"--data {path}: a folder with no *{TEXT_SUFFIX} files in it. Fix: point --data at a text "
                        f"file, a folder of *{TEXT_SUFFIX} files, or a token file ({', '.join(TOKEN_FILES)}).")
    return files


def _read_texts(files: list[str]) -> list[str]:
    texts = []
    for name in files:
        try:
            with open(name, encoding="utf-8") as f:
                texts.append(f.read())
        except UnicodeDecodeError as e:
            raise DataError(f"--data {name}: not UTF-8 text (byte {e.start}). Fix: convert it to UTF-8, or "
                            "tokenise it yourself into a .bin / .npy token file.") from None
    return texts


def _memmap(path: str) -> np.ndarray:
    """A token file as a read-only memory map: .bin is nanoGPT's flat uint16, .npy numpy's."""
    if path.endswith(".bin"):
        size = os.path.getsize(path)
        if size % 2:
            raise DataError(f"--data {path}: {size} bytes is not a whole number of uint16 token ids (nanoGPT's "
                            ".bin layout). Fix: write the ids as np.uint16, or save them as .npy.")
        return np.memmap(path, np.uint16, mode="r") if size else np.zeros(0, np.uint16)
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise DataError(f"--data {path}: not a numpy array file ({e}). Fix: np.save(path, ids).") from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f"--data {path}: holds a {tokens.dtype} array of shape {tokens.shape}; token ids are a flat "
                        "integer array. Fix: np.save(path, ids.reshape(-1).astype(np.uint16)) (or int32).")
    return tokens


def _id_range(tokens: np.memmap) -> tuple[int, int]:
    """The smallest and largest id of a token file, read in chunks through the file, not the
    map: mapped pages would stay resident in this process (a page cache it cannot drop)."""
    low, high = None, None
    with open(tokens.filename, "rb") as f:
        f.seek(tokens.offset)
        while len(chunk := np.fromfile(f, tokens.dtype, SCAN_CHUNK)):
            low = int(chunk.min()) if low is None else min(low, int(chunk.min()))
            high = int(chunk.max()) if high is None else max(high, int(chunk.max()))
    return low, high


def load(path: str | None, tokenizer_kind: str = "bytes", bpe_vocab: int = tokenizers.BPE_VOCAB,
         tokenizer: tokenizers.ByteTokenizer | tokenizers.BPETokenizer | None = None,
         text_field: str = documents.TEXT_FIELD) -> Data:
    """The tokens at `path` (None: the shipped corpus). Text is tokenised by `tokenizer` where
    given (a resumed run's, an imported model's), else by bytes or a BPE of `bpe_vocab` trained
    on it. A token file's ids are taken as given: as `tokenizer`'s ids where one is given."""
    if tokenizer_kind not in tokenizers.KINDS:
        raise DataError(f"unknown --tokenizer {tokenizer_kind!r}; choose one of {', '.join(tokenizers.KINDS)}")
    if path is not None and not os.path.exists(path):
        raise DataError(f"--data {path}: no such file or folder. Fix: give a text file, a folder of *{TEXT_SUFFIX} "
                        f"files, a token file ({', '.join(TOKEN_FILES)}) or documents ({documents.FORMATS}).")
    if path is not None and path.endswith(TOKEN_FILES):
        if tokenizer_kind == "bpe" and tokenizer is None:
            raise DataError(f"--data {path} holds token ids already; --tokenizer {tokenizer_kind} trains on text. "
                            "Fix: drop --tokenizer, or give the text itself.")
        tokens = _memmap(path)
        if not len(tokens):
            raise DataError(f"--data {path}: no tokens in it. Fix: point --data at a file with token ids.")
        given = f"; the ids of the {tokenizer.kind} tokenizer given, vocab {tokenizer.vocab_size}" if tokenizer else ""
        return _token_data(path, tokens, f"{path}: {len(tokens):,} token ids ({tokens.dtype}, memory-mapped{given})",
                           {"path": os.path.abspath(path), "tokens": len(tokens)}, tokenizer)
    if path is not None and documents.is_documents(path):
        try:
            found = documents.open_documents(path, text_field)
            if tokenizer is None:  # a BPE learns from the documents: one pass more, streamed too
                tokenizer = tokenizers.train_bpe(found.texts(), bpe_vocab) if tokenizer_kind == "bpe" else \
                    tokenizers.ByteTokenizer()
            tokens, file, count = documents.tokenize(found, tokenizer)
        except documents.DocumentError as e:
            raise DataError(str(e)) from None
        joined = f"{tokenizer.kind}, EOS id {tokenizer.eos_id} after each document" if tokenizer.eos_id is not None \
            else f"{tokenizer.kind}, a blank line after each document: the tokenizer has no EOS"
        return _token_data(path, tokens, f"{path}: {count:,} documents ({found.format}) -> {len(tokens):,} tokens "
                           f"({joined}; memory-mapped from {file})",
                           {"path": os.path.abspath(path), "tokens": len(tokens), "text_field": text_field}, tokenizer)
    if path is None:
        texts, source = [resources.files("jshard.app").joinpath(CORPUS).read_text("utf-8")], f"{CORPUS} (shipped)"
    else:
        files = _text_files(path)
        texts, source = _read_texts(files), path + (f" ({len(files)} text files)" if len(files) > 1 else "")
    if not any(texts):
        raise DataError(f"--data {path}: empty, no text to train on. Fix: point --data at a file with text in it.")
    if tokenizer is None:
        tokenizer = tokenizers.train_bpe(texts, bpe_vocab) if tokenizer_kind == "bpe" else tokenizers.ByteTokenizer()
    tokens = np.concatenate([tokenizer.encode(text) for text in texts])
    identity = {"path": os.path.abspath(path) if path else CORPUS, "tokens": len(tokens)}
    return Data(tokens, f"{source}: {sum(map(len, texts)):,} characters -> {len(tokens):,} tokens ({tokenizer.kind})",
                identity, tokenizer, int(tokens.max()))


def _token_data(path: str, tokens: np.ndarray, source: str, identity: dict, tokenizer) -> Data:
    """A memory-mapped token stream, its ids checked for sign (the vocab is the caller's)."""
    low, high = _id_range(tokens)
    if low < 0:
        raise DataError(f"--data {path}: holds a negative token id ({low}). Fix: write ids in 0..vocab-1.")
    return Data(tokens, source, identity, tokenizer, high)


@dataclasses.dataclass
class Split:
    """The training stream and the held-out windows of `tokens`."""

    train: TextBatches
    eval: np.ndarray  # the held-out tokens (a view: a memory map stays one)
    seq_len: int
    batches: int = 1  # held-out batches per evaluation

    @property
    def eval_windows(self) -> int:
        return len(self.eval) // (self.seq_len + 1)

    def eval_batch(self, index: int, size: int, sharding: jax.sharding.Sharding) -> jax.Array:
        """Held-out batch `index`: windows index·size .. (index+1)·size - 1, in order."""
        width = self.seq_len + 1

        def rows(indices):
            return np.stack([self.eval[k * width:(k + 1) * width] for k in indices]).astype(np.int32)

        return _global_batch(rows, index * size, size, width, sharding)


def split(tokens: np.ndarray, seq_len: int, seed: int, eval_fraction: float) -> Split:
    """The first 1 - `eval_fraction` of `tokens` to train on, the rest held out."""
    held = int(round(len(tokens) * eval_fraction))
    return Split(TextBatches(tokens[:len(tokens) - held], seq_len, seed), tokens[len(tokens) - held:], seq_len)


class TextBatches:
    """Rows of seq_len + 1 consecutive tokens of `tokens`, row k fixed by (seed, k)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens, self.width, self.seed = tokens, seq_len + 1, seed
        # Windows start at shift + j·width; any shift in [0, seq_len] leaves this many whole.
        self.windows = (len(tokens) - seq_len) // self.width
        if self.windows < 1:
            raise DataError(f"{len(tokens)} training tokens hold no window of seq_len + 1 = {self.width} tokens. "
                            "Fix: a shorter --seq-len, or more data.")

    @functools.lru_cache(maxsize=4)
    def _epoch(self, epoch: int) -> tuple[int, int]:
        """The epoch's shift of the cut and its shuffle's key."""
        rng = np.random.default_rng([self.seed, epoch])
        return int(rng.integers(self.width)), int(rng.integers(2**31))

    def window(self, k: int) -> int:
        """Which window row k of the stream is: epoch k // windows, shuffled by its key."""
        from grain.experimental import index_shuffle  # (imported on first use: it takes a second or two)

        shift, key = self._epoch(k // self.windows)
        return shift + index_shuffle(k % self.windows, max_index=self.windows - 1, seed=key, rounds=4) * self.width

    def rows(self, indices) -> np.ndarray:
        """Rows `indices` of the stream, as an int32 array (len(indices), seq_len + 1)."""
        out = np.empty((len(indices), self.width), np.int32)
        for i, k in enumerate(indices):
            start = self.window(k)
            out[i] = self.tokens[start:start + self.width]
        return out

    def batch(self, position: int, size: int, sharding: jax.sharding.Sharding) -> jax.Array:
        """Rows position .. position + size - 1 as one global array laid out by `sharding`."""
        return _global_batch(self.rows, position, size, self.width, sharding)


def process_rows(sharding: jax.sharding.Sharding, size: int, width: int) -> list[int]:
    """The rows of a (size, width) global batch that this process's devices hold, in order
    (what `make_array_from_process_local_data` expects of it)."""
    indices = sharding.addressable_devices_indices_map((size, width)).values()
    return sorted({row for index in indices for row in range(size)[index[0]]})


def _global_batch(rows, position: int, size: int, width: int, sharding) -> jax.Array:
    """Rows position .. position + size - 1 of `rows(indices)`; this process builds only its own."""
    local = process_rows(sharding, size, width)
    return jax.make_array_from_process_local_data(sharding, rows([position + r for r in local]), (size, width))
