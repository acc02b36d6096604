"""Peak host memory of importing a Hugging Face checkpoint sharded (docs/checkpoints.md).

    python tests/hf/measure_load_memory.py DIR [--model llama-3.1-8b] [--layers N] [--strategy zero3] [--json OUT]

Writes random bf16 safetensors of `--model`'s shape (Llama names, 5 GB shards with an index)
to DIR unless DIR already holds them, then, on 8 fake CPU devices, reads them with
`jshard.app.hf.load_params` into the strategy's layout in bf16, sampling the process's memory
(/proc/self/status) every 10 ms: anonymous memory (what the process allocated: on fake CPU
devices the devices' arrays live here too) and file-backed pages (the memory-mapped files,
which the kernel can drop). The loader's own cost is the anonymous peak less what the
devices hold at the end.
"""

import argparse
import dataclasses
import json
import os
import threading
import time

import jshard

jshard.use_fake_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from jshard.app import hf  # noqa: E402
from jshard.models import SIZES, decoder  # noqa: E402


def status() -> dict:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {k: int(fields[k].split()[0]) * 1024 for k in ("RssAnon", "RssFile", "VmHWM")}


def write_random(directory: str, config, shard_bytes: int = 2 * 2**30) -> None:
    """Random bf16 tensors under the Hugging Face names of `config` (jshard.app.hf's table), written a
    file of about `shard_bytes` at a time: never the whole model in memory."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    abstract = dict(nnx.to_flat_state(nnx.state(nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0))), nnx.Param)))
    shapes = {tuple(map(str, path)): leaf.get_value().shape for path, leaf in abstract.items()}
    rng = np.random.default_rng(0)
    pending, files, weight_map = {}, [], {}

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(pending, os.path.join(directory, name), metadata={"format": "pt"})
        files.append(name)
        weight_map.update({k: name for k in pending})
        pending.clear()

    for key, node in hf.weights(config).items():
        layers = node.parts if isinstance(node, hf.Stack) and node.axis == 0 and key[0] == "blocks" else [node]
        shape = shapes[key][1:] if len(layers) > 1 or key[0] == "blocks" else shapes[key]
        for part in layers:
            bits = rng.integers(0x3C00, 0x3D00, size=shape, dtype=np.uint16)  # bf16 in [2^-7, 2^-6): finite
            pending.update({k: np.ascontiguousarray(v) for k, v in
                            hf.stored_tensors(part, bits.view(ml_dtypes.bfloat16)).items()})
            if sum(v.nbytes for v in pending.values()) >= shard_bytes:
                flush()
    if pending:
        flush()
    with open(os.path.join(directory, hf.INDEX), "w") as f:
        json.dump(dict(metadata={}, weight_map=weight_map), f)
    with open(os.path.join(directory, hf.CONFIG), "w") as f:
        json.dump(hf.hf_config(config, "bfloat16"), f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--strategy", default="zero3")
    parser.add_argument("--json")
    args = parser.parse_args()
    config = SIZES[args.model]
    if args.layers:
        config = dataclasses.replace(config, layers=args.layers)
    if not os.path.exists(os.path.join(args.directory, hf.CONFIG)):
        began = time.perf_counter()
        write_random(args.directory, config)
        print(f"wrote {args.directory} in {time.perf_counter() - began:.0f} s")
    config = hf.model_config(hf.read_config(args.directory))
    rules = jshard.preset(args.strategy)
    mesh = jshard.make_mesh(**{"dp": dict(data=8)}.get(args.strategy, dict(fsdp=8)))
    abstract = nnx.state(nnx.eval_shape(lambda: decoder(config, nnx.Rngs(0))), nnx.Param)
    shardings = jshard.shardings(abstract, mesh, rules)
    like = jax.tree.map(lambda p, s: jax.ShapeDtypeStruct(p.shape, jnp.bfloat16, sharding=s), abstract, shardings)
    model_bytes = sum(2 * x.size for x in jax.tree.leaves(like))

    before, peak, done = status(), {}, threading.Event()

    def sample():
        while not done.is_set():
            now = status()
            for k, v in now.items():
                peak[k] = max(peak.get(k, 0), v)
            time.sleep(0.01)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    began = time.perf_counter()
    loaded = jax.block_until_ready(hf.load_params(args.directory, config, like))
    seconds = time.perf_counter() - began
    done.set()
    sampler.join()
    after = status()
    held = sum(s.data.nbytes for x in jax.tree.leaves(loaded) for s in x.addressable_shards)
    result = dict(model=args.model, layers=config.layers, strategy=args.strategy, devices=8, dtype="bfloat16",
                  params=sum(x.size for x in jax.tree.leaves(like)), model_bf16_bytes=model_bytes,
                  devices_hold_bytes=held, load_s=seconds, anon_before=before["RssAnon"],
                  anon_peak=peak["RssAnon"], anon_after=after["RssAnon"], file_peak=peak["RssFile"],
                  loader_transient_bytes=peak["RssAnon"] - after["RssAnon"],
                  loader_peak_over_devices=peak["RssAnon"] - before["RssAnon"] - held,
                  jax=jax.__version__)
    gb = 2**30
    print(f"{args.model} ({config.layers} layers, {result['params'] / 1e9:.2f} B params) under {args.strategy} on 8 "
          f"fake devices, bf16: {seconds:.1f} s; the devices hold {held / gb:.2f} GiB (one bf16 copy "
          f"{model_bytes / gb:.2f} GiB); anonymous memory {before['RssAnon'] / gb:.2f} -> peak "
          f"{peak['RssAnon'] / gb:.2f} -> {after['RssAnon'] / gb:.2f} GiB: the loader's own peak above what the "
          f"devices hold {result['loader_peak_over_devices'] / gb:.2f} GiB; mapped file pages at most "
          f"{peak['RssFile'] / gb:.2f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
