"""How fast the memory model prices the whole 13B x 4xA100 space.

Space: ZeRO 0-3 x k in 0..40 x micro batch 1..64 x {fp32, fp16, bf16} = 31,488 candidates.
Target: under 0.1 s. Prints the grid path (what the search uses) and the point-by-point path,
and the ratio between them measured in the same run, for the stand-in model (analytic terms),
then for the Hugging Face Llama-2-13B (traced terms: the one-time trace of its small programs,
then the whole space again from the cache, then as a later run finds it: its programs read back
from the disk cache, memory/trace_cache.py).

Last, `--max-seq-len` for ZeRO-3 (issue target: under a second) with each implementation, and
for transformers' code as a first and as a later run, beside the configuration's estimate alone.

    python benchmarks/estimate_speed.py
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time

import numpy as np

from autotune.hardware import parse_gpus
from autotune.memory import estimate
from autotune.memory.grid import grid_total_bytes
from autotune.models import resolve_model
from autotune.train_config import TrainConfig


def main() -> None:
    # A cache of our own, empty: "first" below is a first run's tracing (memory/trace_cache.py)
    root = os.environ["AUTOTUNE_CACHE_DIR"] = tempfile.mkdtemp(prefix="estimate-speed-")
    try:
        builtin()
        hugging_face()
        max_seq_len()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def max_seq_len() -> None:
    """`autotune estimate --model 13b --gpus 4xA100 --zero 3 --max-seq-len` after the imports, as the
    CLI runs it (memory/limits.py traced_once: the configuration's estimate and the answer from one
    build of each traced program), beside the configuration's estimate alone; for transformers' code
    as a first run traces it (an empty disk cache) and as a later run finds it."""
    from autotune.memory import code_trace, limits

    cluster = parse_gpus("4xA100")
    cfg = TrainConfig(zero_stage=3, precision="bf16", seq_len=2048)
    root = os.environ["AUTOTUNE_CACHE_DIR"]
    print()
    for impl, run in (("builtin", ""), ("hf", "first run"), ("hf", "a later run")):
        model = resolve_model("13b", implementation=impl)
        estimate(model, cluster, dataclasses.replace(cfg, micro_batch=3, seq_len=100))  # imports, first calls
        builds = []
        original = code_trace._run
        code_trace._run = lambda *a, **k: builds.append(k.get("vary")) or original(*a, **k)
        try:
            times = {}
            for asked in (None, "seq_len"):
                if run == "first run":   # an empty cache each time, under main()'s
                    os.environ["AUTOTUNE_CACHE_DIR"] = tempfile.mkdtemp(dir=root)
                code_trace._PROGRAMS.clear()
                code_trace._FAMILIES.clear()
                builds.clear()
                t0 = time.perf_counter()
                with limits.traced_once(model, cfg, asked):
                    estimate(model, cluster, cfg)
                    v = limits.largest_fitting(model, cluster, cfg, "seq_len") if asked else None
                times[asked] = time.perf_counter() - t0
        finally:
            code_trace._run = original
        steps = sum(3 if b else 1 for b in builds)
        print(f"max seq len ({impl}{', ' + run if run else ''}, ZeRO-3 bf16 micro batch 1): {v}; the estimate "
              f"alone {times[None]:.2f} s, with the answer {times['seq_len']:.2f} s ({len(builds)} builds traced, "
              f"{steps} steps): the answer adds {times['seq_len'] - times[None]:.2f} s -> target under 1 s in all: "
              f"{'met' if times['seq_len'] < 1 else 'MISSED'}")


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
    print(f"first grid:  {first:.1f} s, the one-time trace of {len(code_trace._PROGRAMS)} small programs "
          f"(3 precisions x micro batch 1, 2 x k 0, 1, 2; each 2-5 layers at seq 2048)")
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        fits = sum(int((grid_total_bytes(model, cluster, b, mbs, ks) <= cluster.capacity_bytes).sum()) for b in bases)
        best = min(best, time.perf_counter() - t0)
    print(f"cached grid: {n:,} candidates in {best * 1e3:.1f} ms; {fits:,} fit "
          f"-> target well under 1 s: {'met' if best < 0.5 else 'MISSED'}")
    code_trace._PROGRAMS.clear()
    t0 = time.perf_counter()
    sum(int((grid_total_bytes(model, cluster, b, mbs, ks) <= cluster.capacity_bytes).sum()) for b in bases)
    print(f"a later run's first grid: {time.perf_counter() - t0:.2f} s, the {len(code_trace._PROGRAMS)} programs "
          f"read back from the disk cache")


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
    print(f"grid:        {n:,} candidates in {best * 1e3:.1f} ms ({best / n * 1e6:.2f} us each); {fits:,} fit "
          f"-> target < 100 ms: {'met' if best < 0.1 else 'MISSED'}")
    sample = [(b, int(mb), int(k)) for b in bases for mb in mbs[::8] for k in ks[::8]]
    t0 = time.perf_counter()
    for b, mb, k in sample:
        estimate(model, cluster, dataclasses.replace(b, micro_batch=mb, ckpt_layers=k))
    per = (time.perf_counter() - t0) / len(sample)
    print(f"pointwise:   {per * 1e6:.1f} us per estimate -> whole space would take {per * n:.2f} s "
          f"({per * n / best:.0f}x the grid)")


if __name__ == "__main__":
    main()
