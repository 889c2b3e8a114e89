"""What checking an export's files costs at load, against loading its weights.

An export records the size and sha256 of each of its files (``common.file_records``);
``load_export`` checks them before it loads anything. This writes a ``model.safetensors`` of
a preset's float32 weights (default ``medium``: GPT-2 medium's shape over GPT-2's 50257 tokens,
the size of the exports of configs/medium.yaml) and times, each from the page cache (the file
was just written; a cold read adds the disk's time to the hashing and the load alike):

  sizes     the size check alone (one stat per file)
  sha256    hashing the file (``common.file_records.sha256_file``, one thread)
  load      ``safetensors.torch.load_file`` of it and ``load_state_dict`` into the network (built
            once beforehand), what ``load_export`` does next
  build     building the network ``load_export`` loads into (random initialisation)
  overlap   the build while another thread hashes the file, as ``load_export`` does: what a full
            check of the digests adds to a load is ``overlap - build``

    python bench/export_integrity.py [--preset medium] [--repeats 3] [--dir /tmp]

Prints one JSON object after a line describing the machine. The weights are zeros: neither
hashing nor loading depends on the values.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from common.file_records import sha256_file
from model.transformer import Transformer, preset

GPT2_VOCAB = 50257  # the vocabulary of configs/medium.yaml's exports (padded rows are dropped on export)


def _median_seconds(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where the file is written (default: the system's temp dir)")
    args = parser.parse_args()
    print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                      "torch": torch.__version__}))
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Transformer(preset(args.preset, GPT2_VOCAB)).state_dict().items()}
    tensors = {name: torch.zeros(shape) for name, shape in shapes.items()}
    with tempfile.TemporaryDirectory(dir=args.dir) as scratch:
        path = Path(scratch) / "model.safetensors"
        save_file(tensors, str(path))
        del tensors
        size = path.stat().st_size
        build = _median_seconds(lambda: Transformer(preset(args.preset, GPT2_VOCAB)), args.repeats)
        overlap = _median_seconds(lambda: _build_while_hashing(path, args.preset), args.repeats)
        network = Transformer(preset(args.preset, GPT2_VOCAB))
        sizes = _median_seconds(lambda: path.stat().st_size, args.repeats)
        digest = _median_seconds(lambda: sha256_file(path), args.repeats)
        load = _median_seconds(lambda: network.load_state_dict(load_file(str(path))), args.repeats)
    print(json.dumps({"preset": args.preset, "bytes": size, "sizes_s": round(sizes, 6), "sha256_s": round(digest, 3),
                      "sha256_gb_per_s": round(size / digest / 1e9, 2), "load_s": round(load, 3),
                      "build_s": round(build, 3), "build_while_hashing_s": round(overlap, 3),
                      "full_check_adds_s": round(overlap - build, 3),
                      "sha256_over_build_and_load": round(digest / (build + load), 2)}))


def _build_while_hashing(path: Path, preset_name: str) -> None:
    """``load_export``'s order: the weights hashed by one thread while the network is built."""
    with ThreadPoolExecutor(1) as pool:
        hashing = pool.submit(sha256_file, path)
        Transformer(preset(preset_name, GPT2_VOCAB))
        hashing.result()


if __name__ == "__main__":
    main()
