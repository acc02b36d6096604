"""Check an exported checkpoint against a fixture's reference logits, in transformers.

    .venv-hf/bin/python tests/hf/check_with_transformers.py FIXTURE_DIR EXPORTED_DIR

Loads EXPORTED_DIR with transformers' AutoModelForCausalLM (float32, eager
attention), runs the `ids` stored in FIXTURE_DIR/reference.npz, and compares
the logits with the stored ones.  Prints one JSON line

    {"max_rel_err": ..., "max_abs_err": ...}

(max_rel_err = max|a - b| / max|b|) and exits 1 if max_rel_err > 1e-5, else 0.

    python tests/hf/check_with_transformers.py --loss MODEL_DIR IDS.npy

prints {"loss": ...}: transformers' loss of MODEL_DIR on the int ids (rows, tokens) in IDS.npy
with labels=input_ids (the mean next-token cross-entropy), for a jshard run's first batch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

TOL = 1e-5


def loss(directory: str, ids_file: str) -> int:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    ids = torch.tensor(np.load(ids_file), dtype=torch.long)
    with torch.no_grad():
        value = model(ids, labels=ids).loss
    print(json.dumps({"loss": float(value)}))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 3 and argv[0] == "--loss":
        return loss(argv[1], argv[2])
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    fixture, exported = Path(argv[0]), Path(argv[1])
    ref = np.load(fixture / "reference.npz")
    model = AutoModelForCausalLM.from_pretrained(
        exported, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor(ref["ids"], dtype=torch.long)).logits
    a = logits.float().numpy()
    b = ref["logits"].astype(np.float32)
    if a.shape != b.shape:
        print(json.dumps({"error": f"shape {a.shape} != reference {b.shape}"}))
        return 1
    max_abs = float(np.max(np.abs(a - b)))
    max_rel = max_abs / float(np.max(np.abs(b)))
    print(json.dumps({"max_rel_err": max_rel, "max_abs_err": max_abs}))
    return 1 if not np.isfinite(max_rel) or max_rel > TOL else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
