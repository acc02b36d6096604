"""Whether fixtures made again (`make_fixtures.py DIR`) are the committed ones: every file the
same to the byte (versions.json aside, which holds the date), but reference.npz's float arrays,
which torch computes on this machine's CPU: within 1e-6 + 1e-5 relative (torch's float32
reductions differ in their last bits from one CPU to another: 2.4e-7 at most on logits of
order 1, AMD EPYC against the machine that made them), same keys, dtypes and shapes, and the
integer arrays (ids, greedy tokens) equal. `.ci/run` calls it:

    python tests/hf/same_fixtures.py MADE_DIR tests/hf/fixtures
"""

import sys
from pathlib import Path

import numpy as np


def differences(made: Path, committed: Path) -> list[str]:
    names = {p.relative_to(made) for p in made.rglob("*") if p.is_file()}
    names |= {p.relative_to(committed) for p in committed.rglob("*") if p.is_file()}
    found = []
    for name in sorted(n for n in names if n.name != "versions.json"):
        a, b = made / name, committed / name
        if not (a.is_file() and b.is_file()):
            found.append(f"{name}: only in {made if a.is_file() else committed}")
        elif name.suffix == ".npz":
            x, y = np.load(a), np.load(b)
            if sorted(x.files) != sorted(y.files):
                found.append(f"{name}: arrays {sorted(x.files)} against {sorted(y.files)}")
                continue
            for key in x.files:
                u, v = x[key], y[key]
                if (u.dtype, u.shape) != (v.dtype, v.shape):
                    found.append(f"{name}[{key}]: {u.dtype}{list(u.shape)} against {v.dtype}{list(v.shape)}")
                elif np.issubdtype(u.dtype, np.floating) and not np.allclose(u, v, rtol=1e-5, atol=1e-6):
                    found.append(f"{name}[{key}]: differs by up to {np.abs(u - v).max():.3g}")
                elif not np.issubdtype(u.dtype, np.floating) and not np.array_equal(u, v):
                    found.append(f"{name}[{key}]: not equal")
        elif a.read_bytes() != b.read_bytes():
            found.append(f"{name}: not the same bytes")
    return found


if __name__ == "__main__":
    made, committed = map(Path, sys.argv[1:3])
    found = differences(made, committed)
    print("\n".join(found) or f"{made} is {committed} (floats within 1e-5)")
    sys.exit(1 if found else 0)
