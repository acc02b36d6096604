"""`jshard export`: a `jshard train` checkpoint as a Hugging Face model directory (`jshard.app.hf`)."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from jshard.app import hf
from jshard.mesh import use_fake_cpu_devices_unless_accelerated

DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def add_parser(commands) -> None:
    parser = commands.add_parser("export", help="write a checkpoint as a Hugging Face model directory",
                                 description=hf.export_checkpoint.__doc__)
    add = parser.add_argument
    add("--checkpoint-dir", required=True, metavar="DIR", help="a `jshard train --checkpoint-dir` directory")
    add("--to", required=True, metavar="DIR", help="the directory to write: config.json, safetensors, tokenizer.json")
    add("--step", type=int, metavar="N", help="the checkpoint's step (default: the latest)")
    add("--dtype", choices=DTYPES, default="float32", help="the tensors' dtype (default: float32, the checkpoint's)")
    add("--family", choices=hf.FAMILIES, help="config.json's model_type (default: the one that holds the model's "
                                              "features: llama, qwen2, qwen3 or mixtral)")
    add("--max-shard-gb", type=float, default=5.0, metavar="GB", help="largest safetensors file (default: 5)")
    parser.set_defaults(run=run)


def run(args) -> int:
    use_fake_cpu_devices_unless_accelerated(1)  # the params come back to this host whole
    files = hf.export_checkpoint(args.checkpoint_dir, args.to, step=args.step, dtype=DTYPES[args.dtype],
                                 family=args.family, max_shard_bytes=int(args.max_shard_gb * 2**30))
    print(f"jshard export: {args.checkpoint_dir} -> {args.to}: {', '.join(files)}")
    return 0
