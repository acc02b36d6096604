"""Training data: a small text corpus shipped with jshard, as bytes, in a deterministic order.

Tokens are bytes (vocab 256): no tokenizer to ship or download. The corpus is cut into
windows of seq_len + 1 tokens (inputs and their next-token targets); each epoch shifts the
cut by a random offset and visits every window once in a random order. Both come from
(seed, epoch) only, so row k of the stream is the same in every run, on every process and
after a restart: the data position is just the number of rows consumed.

Each process builds only its own rows of a global batch (the rows its devices hold under
the batch sharding) and hands them to `jax.make_array_from_process_local_data`.
"""

from __future__ import annotations

import functools
from importlib import resources

import jax
import numpy as np

CORPUS = "corpus.txt"  # public-domain texts, in the package beside this module


def corpus_tokens() -> np.ndarray:
    """The shipped corpus as int32 byte values."""
    text = resources.files("jshard").joinpath(CORPUS).read_bytes()
    return np.frombuffer(text, np.uint8).astype(np.int32)


class TextBatches:
    """Rows of seq_len + 1 consecutive tokens of `tokens`, row k fixed by (seed, k)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self.tokens, self.width, self.seed = tokens, seq_len + 1, seed
        # Windows start at shift + j·width; any shift in [0, seq_len] leaves this many whole.
        self.windows = (len(tokens) - seq_len) // self.width
        if self.windows < 1:
            raise ValueError(f"a corpus of {len(tokens)} tokens holds no window of {self.width} tokens")

    @functools.lru_cache(maxsize=4)
    def _epoch(self, epoch: int) -> tuple[int, np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch])
        return int(rng.integers(self.width)), rng.permutation(self.windows)

    def rows(self, indices) -> np.ndarray:
        """Rows `indices` of the stream, as an int32 array (len(indices), seq_len + 1)."""
        out = np.empty((len(indices), self.width), np.int32)
        for i, k in enumerate(indices):
            shift, order = self._epoch(k // self.windows)
            start = shift + order[k % self.windows] * self.width
            out[i] = self.tokens[start:start + self.width]
        return out

    def batch(self, position: int, size: int, sharding: jax.sharding.Sharding) -> jax.Array:
        """Rows position .. position + size - 1 as one global array laid out by `sharding`.

        This process builds only the rows its devices hold, in order (what
        `make_array_from_process_local_data` expects of it).
        """
        shape = (size, self.width)
        local = sorted({row for index in sharding.addressable_devices_indices_map(shape).values()
                        for row in range(size)[index[0]]})
        return jax.make_array_from_process_local_data(sharding, self.rows([position + r for r in local]), shape)
