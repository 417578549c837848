"""Seconds a trial spends outside its measured steps: spawn, init, teardown, and under Ray the
placement and the task round trip. Target: at most 5 s for a local 2-rank trial.

    python benchmarks/trial_overhead.py [--model tiny-llama] [--gpus 2xcpu] [--repeats 3] [--no-ray]

Every figure is measured by the trial itself (TrialResult.timings_s); "other" is the wall time no
named phase accounts for (the launcher's reading, writing result files, process start latency).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from autotune.hardware import parse_gpus
from autotune.models import resolve_model
from autotune.train_config import TrainConfig
from autotune.trial.record import TrialRequest, TrialResult

TARGET_S = 5.0
ORDER = [
    "spawn_s",
    "setup_s",
    "build_s",
    "initialize_s",
    "warmup_s",
    "profiler_stop_s",
    "analysis_s",
    "teardown_s",
    "exit_s",
    "placement_s",
    "ray_s",
]
WHAT = {
    "spawn_s": "start ranks: python, import torch+deepspeed, gloo rendezvous",
    "setup_s": "DeepSpeed config, batch, profiler start",
    "build_s": "build + init the model (meta device / zero.Init; imports torch._dynamo once)",
    "initialize_s": "deepspeed.initialize (optimizer states allocated here)",
    "warmup_s": "warm-up steps (and the per-step loss all-reduce)",
    "profiler_stop_s": "stop the profiler (collects the events)",
    "analysis_s": "memory curve, peaks, memory_summary.txt",
    "teardown_s": "engine.destroy, release DeepSpeed's references, gc",
    "exit_s": "ranks exit after the last config",
    "placement_s": "Ray: submit until the node task starts (placement group, worker lease)",
    "ray_s": "Ray: task end until the driver has the result",
}


def request(out: Path, args) -> TrialRequest:
    cfg = TrainConfig(zero_stage=args.zero, precision="bf16", seq_len=args.seq_len)
    return TrialRequest(
        model=resolve_model(args.model),
        cluster=parse_gpus(args.gpus),
        config=cfg,
        out_dir=out,
        steps=args.steps,
        warmup_steps=1,
        timeout_s=300,
    )


def local(args, root: Path) -> tuple[list[TrialResult], float]:
    """The trials, and the median CPU seconds (user + system) all ranks of one trial used: unlike wall
    time, that does not grow when other work shares the cores."""
    from autotune.trial import run_trial

    results, cpu = [], []
    for i in range(args.repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        results.append(run_trial(request(root / f"local{i}", args)))
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return results, statistics.median(cpu)


def on_ray(args, root: Path) -> tuple[list[TrialResult], float, float]:
    from autotune.executors.ray_executor import RayExecutor

    t0 = time.perf_counter()
    ex = RayExecutor(parse_gpus(args.gpus))
    start_s = time.perf_counter() - t0
    results = []
    try:
        for i in range(args.repeats):
            ex.submit(request(root / f"ray{i}", args))
            results += [r for _, r in ex.wait_any()]
    finally:
        t1 = time.perf_counter()
        ex.close()
    return results, start_s, time.perf_counter() - t1


def table(title: str, results: list[TrialResult]) -> float:
    bad = [r for r in results if r.status != "ok"]
    if bad:
        raise SystemExit(f"{title}: trial {bad[0].status}: {bad[0].reason}\n{bad[0].log_tail}")
    med = lambda xs: statistics.median(xs)  # noqa: E731
    wall = med([r.wall_s for r in results])
    measured = med([r.timings_s["measured_s"] for r in results])
    overhead = med([r.overhead_s for r in results])
    print(f"\n{title}: median of {len(results)} trials")
    print(f"  {'wall':<16} {wall:6.2f} s")
    print(f"  {'measured steps':<16} {measured:6.2f} s")
    print(
        f"  {'overhead':<16} {overhead:6.2f} s   (target <= {TARGET_S:g} s: "
        f"{'met' if overhead <= TARGET_S else 'NOT met'})"
    )
    named = 0.0
    for key in ORDER:
        vals = [r.timings_s.get(key) for r in results if key in r.timings_s]
        if vals:
            named += med(vals)
            print(f"    {key[:-2]:<14} {med(vals):6.2f} s   {WHAT[key]}")
    print(f"    {'other':<14} {overhead - named:6.2f} s   launcher bookkeeping, process start latency")
    return overhead


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--gpus", default="2xcpu")
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray executor")
    args = ap.parse_args()
    print(
        f"{args.model} on {args.gpus}, ZeRO-{args.zero} bf16, seq {args.seq_len}, 1 warm-up + {args.steps} "
        f"measured steps"
    )
    with tempfile.TemporaryDirectory() as tmp:
        results, cpu_s = local(args, Path(tmp))
        table("local (autotune.trial.run_trial)", results)
        print(
            f"  CPU time of all ranks together: {cpu_s:.2f} s per trial ({os.cpu_count()} cores here; "
            f"load average {os.getloadavg()[0]:.1f})"
        )
        if not args.no_ray:
            results, start_s, stop_s = on_ray(args, Path(tmp))
            table("Ray executor (local Ray, one trial at a time)", results)
            print(f"  once per study: Ray start {start_s:.2f} s, Ray shutdown {stop_s:.2f} s")


if __name__ == "__main__":
    main()
