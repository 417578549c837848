"""How fast the memory model prices the whole 13B x 4xA100 space.

Space: ZeRO 0-3 x k in 0..40 x micro batch 1..64 x {fp32, fp16, bf16} = 31,488 candidates.
Target: under 0.1 s. Prints the grid path (what the search uses) and the point-by-point path,
and the ratio between them measured in the same run, for the stand-in model (analytic terms),
then for the Hugging Face Llama-2-13B (traced terms: the one-time trace of its small programs,
then the whole space again from the cache, then as a later run finds it: its programs read back
from the disk cache, autotune/trace_cache.py).

Last, the whole `autotune estimate --model 13b --gpus 4xA100 --zero 3 --max-seq-len` (issue
target: under a second) as a user runs it, wall clock, with each implementation: as a first run
(the traces shipped for the presets), as a first run of a model nothing was shipped for, and as a
later run.

    python benchmarks/estimate_speed.py
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from autotune.hardware import parse_gpus
from autotune.memory import estimate
from autotune.memory.grid import grid_total_bytes
from autotune.models import resolve_model
from autotune.train_config import TrainConfig


def main() -> None:
    # A cache of our own, empty: "first" below is a first run's tracing (autotune/trace_cache.py)
    root = os.environ["AUTOTUNE_CACHE_DIR"] = tempfile.mkdtemp(prefix="estimate-speed-")
    os.environ["AUTOTUNE_SHIPPED_TRACES"] = "0"  # the grids below time tracing; max_seq_len says per run
    try:
        builtin()
        hugging_face()
        max_seq_len()
    finally:
        shutil.rmtree(root, ignore_errors=True)


COMMAND = ["estimate", "--model", "13b", "--gpus", "4xA100", "--zero", "3", "--max-seq-len"]


def max_seq_len() -> None:
    """`autotune estimate --model 13b --gpus 4xA100 --zero 3 --max-seq-len` as a user runs it: the
    whole command in a fresh process, wall clock from start to exit (the interpreter's start and
    every import included), with transformers' code (the default) and with `--impl builtin` (the
    stand-in), each run three ways:
    - a first run: an empty disk cache, the traces shipped for the presets (autotune/trace_pack.py)
      read in its place, no torch or transformers imported;
    - a first run of a model nothing was shipped for, as any config.json or a changed autotune meets
      (AUTOTUNE_SHIPPED_TRACES=0): the memory model's programs and their family over sequence
      lengths, and the cost model's op profile, are traced, which needs torch and transformers;
    - a later run: all read back from the disk cache (autotune/trace_cache.py)."""
    print()
    root = os.environ["AUTOTUNE_CACHE_DIR"]
    for impl in ("hf", "builtin"):
        times: dict[str, list[float]] = {
            "first run (shipped traces)": [],
            "first run (nothing shipped)": [],
            "a later run": [],
        }
        for _ in range(3):
            cache = tempfile.mkdtemp(dir=root)
            for run in times:
                cmd = [sys.executable, "-m", "autotune", *COMMAND] + (
                    ["--impl", "builtin"] if impl == "builtin" else []
                )
                env = {
                    **os.environ,
                    "AUTOTUNE_CACHE_DIR": tempfile.mkdtemp(dir=root) if "shipped)" in run else cache,
                    "AUTOTUNE_SHIPPED_TRACES": "0" if "nothing" in run else "1",
                }
                t0 = time.perf_counter()
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                times[run].append(time.perf_counter() - t0)
                last = out.strip().splitlines()[-1]
        for run, ts in times.items():
            print(
                f"--max-seq-len ({impl}, {run}): {last}; the whole command {min(ts):.2f}-{max(ts):.2f} s "
                f"wall over 3 runs -> target under 1 s: {'met' if max(ts) < 1 else 'MISSED'}"
            )
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, transformers.models.llama.modeling_llama"], check=True)
    print(
        f"(for scale: importing torch and transformers' Llama alone takes {time.perf_counter() - t0:.2f} s "
        f"here, which a first run that traces cannot avoid)"
    )


def hugging_face() -> None:
    from autotune.memory import code_trace

    model, cluster = resolve_model("13b"), parse_gpus("4xA100")
    mbs, ks = np.arange(1, 65), np.arange(0, model.num_layers + 1)
    bases = [TrainConfig(zero_stage=z, precision=p, seq_len=2048) for z in range(4) for p in ("fp32", "fp16", "bf16")]
    n = len(bases) * len(mbs) * len(ks)
    print(f"\n{model.code_name} ({model.num_params:,} parameters), traced terms:")
    t0 = time.perf_counter()
    fits = sum(int((grid_total_bytes(model, cluster, b, mbs, ks) <= cluster.capacity_bytes).sum()) for b in bases)
    first = time.perf_counter() - t0
    print(
        f"first grid:  {first:.1f} s, the one-time trace of {len(code_trace._PROGRAMS)} small programs "
        f"(3 precisions x micro batch 1, 2 x k 0, 1, 2; each 2-5 layers at seq 2048)"
    )
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        fits = sum(int((grid_total_bytes(model, cluster, b, mbs, ks) <= cluster.capacity_bytes).sum()) for b in bases)
        best = min(best, time.perf_counter() - t0)
    print(
        f"cached grid: {n:,} candidates in {best * 1e3:.1f} ms; {fits:,} fit "
        f"-> target well under 1 s: {'met' if best < 0.5 else 'MISSED'}"
    )
    code_trace._PROGRAMS.clear()
    t0 = time.perf_counter()
    sum(int((grid_total_bytes(model, cluster, b, mbs, ks) <= cluster.capacity_bytes).sum()) for b in bases)
    print(
        f"a later run's first grid: {time.perf_counter() - t0:.2f} s, the {len(code_trace._PROGRAMS)} programs "
        f"read back from the disk cache"
    )


def builtin() -> None:
    model, cluster = resolve_model("13b", implementation="builtin"), parse_gpus("4xA100")
    print(f"{model.code_name}, analytic terms:")
    mbs, ks = np.arange(1, 65), np.arange(0, model.num_layers + 1)
    bases = [TrainConfig(zero_stage=z, precision=p, seq_len=2048) for z in range(4) for p in ("fp32", "fp16", "bf16")]
    n = len(bases) * len(mbs) * len(ks)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        fits = sum(int((grid_total_bytes(model, cluster, b, mbs, ks) <= cluster.capacity_bytes).sum()) for b in bases)
        best = min(best, time.perf_counter() - t0)
    print(
        f"grid:        {n:,} candidates in {best * 1e3:.1f} ms ({best / n * 1e6:.2f} us each); {fits:,} fit "
        f"-> target < 100 ms: {'met' if best < 0.1 else 'MISSED'}"
    )
    sample = [(b, int(mb), int(k)) for b in bases for mb in mbs[::8] for k in ks[::8]]
    t0 = time.perf_counter()
    for b, mb, k in sample:
        estimate(model, cluster, dataclasses.replace(b, micro_batch=mb, ckpt_layers=k))
    per = (time.perf_counter() - t0) / len(sample)
    print(
        f"pointwise:   {per * 1e6:.1f} us per estimate -> whole space would take {per * n:.2f} s "
        f"({per * n / best:.0f}x the grid)"
    )


if __name__ == "__main__":
    main()
