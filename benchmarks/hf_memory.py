"""Hugging Face models of five families on 2 CPU ranks: the real DeepSpeed runs memory_accuracy.py
judges the estimate with (`measure_all` records them, `report` prints the per-family table).

Each row of benchmarks/data/hf_memory_runs.csv is one real trial: autotune.trial.launch.run_trials,
2 CPU ranks (gloo), the model built by autotune/impl/'s hf implementation (AutoModelForCausalLM
from the row's config, random init), 1 warm-up and 2 measured optimizer steps; `measured_bytes` is
the largest per-rank tensor peak of the measured steps, from the profiler's live CPU bytes
(autotune/trial/memprof.py). The versions that measured it are in the row. The shapes (FAMILIES,
HELD_OUT) and spec_of are tests/cases.py's.
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from cases import FAMILIES, HELD_OUT, spec_of, summary

from autotune.hardware import parse_gpus
from autotune.train_config import TrainConfig

CSV = Path(__file__).resolve().parent / "data" / "hf_memory_runs.csv"
RANKS = 2

HELD_OUT_CONFIGS = [(1, "bf16", 2, 2, 200, "sdpa", 1), (3, "fp32", 0, 1, 144, "eager", 1)]
"""The held-out set (tests/cases.py HELD_OUT: other shapes, two configs each), judged with nothing changed."""

# (zero stage, precision, checkpointed layers (-1: all), micro batch, seq len, attention, grad_accum)
CONFIGS = [
    (0, "fp32", 0, 2, 128, "sdpa", 1),
    (1, "bf16", 1, 3, 96, "sdpa", 1),
    (2, "fp32", 2, 1, 256, "eager", 1),
    (3, "bf16", 0, 4, 128, "sdpa", 1),
    (0, "bf16", -1, 2, 192, "eager", 1),
    (1, "fp32", 0, 1, 160, "eager", 1),
    (2, "bf16", 0, 2, 224, "sdpa", 1),
    (3, "fp32", 1, 2, 96, "eager", 1),
    (2, "bf16", -1, 3, 128, "sdpa", 2),
]


def train_config(row: dict) -> TrainConfig:
    return TrainConfig(
        zero_stage=int(row["zero_stage"]),
        precision=row["precision"],
        ckpt_layers=int(row["ckpt_layers"]),
        micro_batch=int(row["micro_batch"]),
        seq_len=int(row["seq_len"]),
        attention=row["attention"],
        grad_accum=int(row["grad_accum"]),
    )


SETS = {"main": (FAMILIES, CONFIGS), "held-out": (HELD_OUT, HELD_OUT_CONFIGS)}


def cases(which: str = "main") -> list[tuple[str, dict, TrainConfig]]:
    families, configs = SETS[which]
    out = []
    for family, config in families.items():
        layers = spec_of(family, config).num_layers
        for z, p, k, mb, s, att, ga in configs:
            out.append(
                (
                    family,
                    config,
                    TrainConfig(
                        zero_stage=z,
                        precision=p,
                        ckpt_layers=layers if k < 0 else k,
                        micro_batch=mb,
                        seq_len=s,
                        attention=att,
                        grad_accum=ga,
                    ),
                )
            )
    return out


def measure_all(which: tuple[str, ...] = tuple(SETS)) -> None:
    """Run every case of the sets `which` as real trials (one process group for all) and rewrite
    their rows of the CSV (the other sets' rows are kept)."""
    import deepspeed
    import torch
    import transformers

    from autotune.trial.launch import run_trials
    from autotune.trial.record import TrialRequest

    cluster = parse_gpus(f"{RANKS}xcpu")
    todo = [(w, *c) for w in which for c in cases(w)]
    versions = f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}"
    with tempfile.TemporaryDirectory() as tmp:
        reqs = [
            TrialRequest(
                model=spec_of(f, d), cluster=cluster, config=c, steps=2, warmup_steps=1, out_dir=Path(tmp) / f"{i}-{f}"
            )
            for i, (_, f, d, c) in enumerate(todo)
        ]
        t0 = time.perf_counter()
        results = run_trials(reqs)
        print(f"{len(reqs)} trials on {RANKS} CPU ranks in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = [r for r in (load() if CSV.exists() else []) if r.get("set", "main") not in which]
    for (which_set, family, config, c), res in zip(todo, results):
        if res.status != "ok" or not res.peak_bytes:
            print(f"  ! {family} {c.short()}: {res.status} {res.reason[:300]}")
            continue
        rows.append(
            {
                "set": which_set,
                "family": family,
                "hf_config": json.dumps(config, sort_keys=True),
                "ranks": RANKS,
                "zero_stage": c.zero_stage,
                "precision": c.precision,
                "ckpt_layers": c.ckpt_layers,
                "micro_batch": c.micro_batch,
                "seq_len": c.seq_len,
                "attention": c.attention,
                "grad_accum": c.grad_accum,
                "measured_bytes": res.peak_bytes,
                "measured_by": f"run_trials, {RANKS} CPU ranks (gloo), steps 2 after 1 warm-up, "
                f"profiler peak, max over ranks; {versions}",
            }
        )
    CSV.parent.mkdir(parents=True, exist_ok=True)
    rows.sort(key=lambda r: list(SETS).index(r["set"]))
    with CSV.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[-1]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {len(rows)} rows to {CSV}")


def load() -> list[dict]:
    with CSV.open() as f:
        return list(csv.DictReader(f))


def rows_with_estimates() -> list[dict]:
    """Each recorded run with today's estimate (traced code) and the stand-in's analytic estimate
    of the same shape (what `autotune estimate` said before the traced code tier)."""
    from dataclasses import replace

    from autotune.memory import estimate

    cluster = parse_gpus(f"{RANKS}xcpu")
    out = []
    for row in load():
        spec, cfg = spec_of(row["family"], json.loads(row["hf_config"])), train_config(row)
        measured = int(row["measured_bytes"])
        ours = estimate(spec, cluster, cfg).tensor_peak_bytes
        standin = estimate(replace(spec, implementation="builtin"), cluster, cfg).tensor_peak_bytes
        out.append(
            {
                **row,
                "measured": measured,
                "ours": ours,
                "standin": standin,
                "err": ours / measured - 1,
                "standin_err": standin / measured - 1,
            }
        )
    return out


def report() -> dict[str, dict]:
    """Print the per-family table of each set; return each set's summary (cases.summary: n, median, worst and worst
    under in percent)."""
    t0 = time.perf_counter()
    every = rows_with_estimates()
    print(
        f"Hugging Face models: estimate vs real DeepSpeed runs on {RANKS} CPU ranks ({CSV.name}; "
        f"{len(every)} runs estimated in {time.perf_counter() - t0:.0f} s)"
    )
    out = {}
    for w in SETS:
        rows = [r for r in every if r.get("set", "main") == w]
        _table(rows, w)
        if rows:
            out[w] = summary([r["err"] for r in rows])
    return out


def _table(rows: list[dict], which: str) -> dict[str, dict]:
    if not rows:
        return {}
    print(f"== {which} set: {len(rows)} runs ==")
    print(
        f"  {'family':<10} {'runs':>4} {'median |err|':>13} {'max |err|':>10}   "
        f"{'stand-in analytic: median':>26} {'max':>8}"
    )
    table = {}
    for family in [*FAMILIES, "all"]:
        sel = [r for r in rows if family in ("all", r["family"])]
        if not sel:
            continue
        e = [100 * abs(r["err"]) for r in sel]
        se = [100 * abs(r["standin_err"]) for r in sel]
        table[family] = {"n": len(sel), "median": statistics.median(e), "max": max(e)}
        print(
            f"  {family:<10} {len(sel):>4} {statistics.median(e):>12.3f}% {max(e):>9.3f}%   "
            f"{statistics.median(se):>25.1f}% {max(se):>7.1f}%"
        )
    ranked = sorted(rows, key=lambda r: -abs(r["err"]))
    worst = min(5, len(ranked) - 1)
    print(
        f"  {worst} worst (the other {len(ranked) - worst} within "
        f"{100 * max(abs(r['err']) for r in ranked[worst:]):.3f}%):"
    )
    for r in ranked[:worst]:
        cfg = train_config(r)
        print(
            f"    {r['family']:<9} {cfg.short()} s{cfg.seq_len}: measured {r['measured']:,}, "
            f"estimate {r['ours']:,} ({100 * r['err']:+.3f}%)"
        )
    return table
