"""Tokenizers: bytes (the default, nothing to ship) or a byte-level BPE trained on the data.

The BPE is Hugging Face `tokenizers`' (a Rust implementation, trained in seconds on a few
MB, nothing downloaded): byte-level, so any text encodes and decodes losslessly. A run
that trains one saves it as `tokenizer.json` beside its checkpoints; a resumed run and
`jshard generate` load it from there, so all three use the same ids. A directory without
one means bytes.

    tokenizer = train_bpe(texts, vocab_size=1024); tokenizer.save(checkpoint_dir)
    tokenizer = load(checkpoint_dir)  # ByteTokenizer or BPETokenizer
    ids = tokenizer.encode("text"); text = tokenizer.decode(ids)
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable

import numpy as np

FILE = "tokenizer.json"  # in a checkpoint directory
KINDS = ("bytes", "bpe")
BPE_VOCAB = 1024  # the BPE's size when the model's vocab is not given; a multiple of 64


class TokenizerError(ValueError):
    """A tokenizer that cannot be used as asked."""


class ByteTokenizer:
    """Token = byte (vocab 256). Decoding replaces a cut multi-byte character with U+FFFD."""

    kind, vocab_size = "bytes", 256
    eos_id = None  # every byte is text: documents are joined by a blank line (`documents.SEPARATOR`)

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def encode_each(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(text.encode("utf-8"), np.uint8) for text in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def identity(self) -> dict:
        """What a checkpoint records, and a resumed run must match."""
        return {"kind": self.kind, "vocab_size": self.vocab_size}

    def save(self, directory: str) -> None:
        """Nothing to save: a directory without `tokenizer.json` is bytes."""


class BPETokenizer:
    """A byte-level BPE (`tokenizers.Tokenizer`)."""

    kind = "bpe"

    def __init__(self, tokenizer, eos_id: int | None = None):
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size()
        self.eos_id = eos_id  # an imported model's end of text, put after each document; None: none

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text).ids, np.int32)

    def encode_each(self, texts: list[str]) -> list[np.ndarray]:
        """Each text's ids, encoded in parallel (the Rust side's threads)."""
        return [np.asarray(e.ids, np.int32) for e in self._tokenizer.encode_batch(texts)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids])

    def to_json(self) -> str:
        return self._tokenizer.to_str()

    def identity(self) -> dict:
        return {"kind": self.kind, "vocab_size": self.vocab_size,
                "sha256": hashlib.sha256(self.to_json().encode()).hexdigest()[:16]}

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        temporary = os.path.join(directory, FILE + ".tmp")
        with open(temporary, "w") as f:
            f.write(self.to_json())
        os.replace(temporary, os.path.join(directory, FILE))  # atomic: never half a tokenizer


def train_bpe(texts: list[str], vocab_size: int = BPE_VOCAB) -> BPETokenizer:
    """A byte-level BPE of at most `vocab_size` tokens learned from `texts` (fewer where the
    texts run out of pairs worth merging)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size <= len(alphabet):
        raise TokenizerError(f"a byte-level BPE needs a vocab above its {len(alphabet)} byte tokens, got {vocab_size}. "
                             f"Fix: --vocab {BPE_VOCAB}, or --tokenizer bytes.")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=[])
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return BPETokenizer(tokenizer)


def load(directory: str) -> ByteTokenizer | BPETokenizer:
    """The tokenizer saved in `directory` (a checkpoint dir): its BPE, or bytes where none is."""
    path = os.path.join(directory, FILE)
    if not os.path.exists(path):
        return ByteTokenizer()
    from tokenizers import Tokenizer

    try:
        return BPETokenizer(Tokenizer.from_file(path), _eos_id(directory))
    except Exception as e:  # tokenizers raises its own exception type for a bad file
        raise TokenizerError(f"{path} is not a tokenizer file ({str(e).splitlines()[0]}). Fix: delete it to "
                             "use bytes, or restore the one the run saved.") from e


def _eos_id(directory: str) -> int | None:
    """The end-of-text id a Hugging Face model directory's config.json names (the first of a
    list), or None (jshard's own runs: a BPE trained without special tokens)."""
    try:
        with open(os.path.join(directory, "config.json")) as f:
            eos = json.load(f).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None
    eos = eos[0] if isinstance(eos, list) and eos else eos
    return eos if isinstance(eos, int) and not isinstance(eos, bool) else None
