"""The suite's one seed, for every random model init and input a test draws.

Fixed, so that two runs of the suite give the same answer; `JSHARD_TEST_SEED=<int>` replaces
it to fuzz (e.g. `JSHARD_TEST_SEED=$RANDOM make test`). pytest's header shows the seed in use,
and parity failures name it, so that any failure can be replayed.
"""

import os
import zlib

import numpy as np

DEFAULT_SEED = 0
_ASKED = os.environ.get("JSHARD_TEST_SEED", "").strip()

SEED = int(_ASKED) if _ASKED.isdigit() else DEFAULT_SEED  # numpy's seeds are non-negative
if _ASKED and not _ASKED.isdigit():
    raise ValueError(f"JSHARD_TEST_SEED={_ASKED!r} is not a non-negative integer. Fix: e.g. JSHARD_TEST_SEED=$RANDOM, "
                     f"or unset it for the fixed seed {DEFAULT_SEED}")


def describe_seed() -> str:
    """The seed in use and where it came from, for pytest's header."""
    return f"jshard test seed: {SEED} " + ("(from JSHARD_TEST_SEED)" if _ASKED else "(fixed; JSHARD_TEST_SEED=<int> to fuzz)")


def case_rng(*case) -> np.random.Generator:
    """A generator of its own for one test case (its parameters as `case`), from SEED: cases
    draw different numbers from each other, and the same ones every run."""
    return np.random.default_rng([SEED, *(zlib.crc32(repr(part).encode()) for part in case)])
