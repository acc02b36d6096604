"""This host's copy bandwidth by buffer size, on one thread and on every core at once.

Fake CPU devices share the host's cores and caches: what a step moves costs it the bandwidth
of the level its buffers fit in (docs/planning.md, "The host's cores and caches"). Each size is
copied (`numpy.copyto`, float32) by each thread into a buffer of its own, the fastest of 3
timings kept; bandwidth counts the read and the write.

    python benchmarks/host_copy_bandwidth.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import numpy as np

MIB = 2**20
SIZES_MIB = (0.125, 0.25, 0.5, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256)


def bandwidth(mib: float, threads: int) -> float:
    """Bytes/s that `threads` threads copying `mib` MiB each move together (read + write)."""
    n = int(mib * MIB) // 4
    buffers = [(np.ones(n, np.float32), np.empty(n, np.float32)) for _ in range(threads)]
    repeats = max(5, int(1024 / mib))

    def copy(source, target):
        for _ in range(repeats):
            np.copyto(target, source)

    best = float("inf")
    for _ in range(3):
        workers = [threading.Thread(target=copy, args=pair) for pair in buffers]
        start = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - start)
    return 2 * n * 4 * repeats * threads / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the curves here")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    curves = {}
    for threads in sorted({1, cores}):
        curves[threads] = {}
        for mib in SIZES_MIB:
            curves[threads][mib] = bandwidth(mib, threads)
            print(f"{threads} thread(s)  {mib:8.3f} MiB a buffer  {curves[threads][mib] / 1e9:6.1f} GB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": cores, "gb_per_s": {str(t): {str(m): b / 1e9 for m, b in c.items()}
                                                    for t, c in curves.items()}}, f, indent=1)


if __name__ == "__main__":
    main()
