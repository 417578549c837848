"""Record a fixed landscape of real trials on this machine's CPU: every config of a small grid,
each run once by the trial runner (autotune.trial.launch.run_trial, one process group per trial,
so `wall_s` is what the trial really cost), written to benchmarks/data/<landscape>.csv.

    python benchmarks/record_cpu_landscape.py            # ~25 min on 2 idle cores
    python benchmarks/record_cpu_landscape.py --landscape cpu_landscape_gpt2   # the held-out one
    python benchmarks/record_cpu_landscape.py --resume   # keep clean rows, measure the rest again
    python benchmarks/record_cpu_landscape.py --best-of benchmarks/data/cpu_landscape.csv
                                                         # measure again, keep the faster of the two
    python benchmarks/record_cpu_landscape.py --limit 3  # a quick look
    python benchmarks/record_cpu_landscape.py --from-study neox-exh1 --out benchmarks/data/cpu_landscape_neox.csv \
        --recorded 2026-12-06 --space-note "ZeRO 0-3 x mb 1-16 x ckpt 0/2/4 x ga 1/2, fp32"
                                                         # a landscape from an `autotune search --exhaustive` study
                                                         # (run where its trials/ folder is)

On a shared machine other work would be measured too: a trial starts only once the 1-minute load
average is below --max-load, and the load after it is recorded; --resume re-measures the rows whose
load_after exceeds --max-load-after (the trial's own two ranks add about 2). Contention only
slows a trial down, so --best-of keeps, per config, the faster of two measurements.

benchmarks/search_efficiency.py replays the table: a strategy "runs" a config by reading its row.
Two landscapes (SETUPS). `cpu_landscape`: a Llama-style model small enough for CPU with a large
vocabulary, so per-step costs (optimizer, gloo reductions) and the logits' memory shape it: larger
micro batches amortise the step until the per-rank cap stops them, and micro batch 16 fits only
with checkpointing. `cpu_landscape_gpt2`: a GPT-2-style model of another shape (LayerNorm, GELU,
biases, learned positions, tied embeddings, longer sequences), recorded after the CPU prior
(autotune/search/cpu_prior.py) was written, to judge it on a landscape it was not developed on. It found
one bug (the probe's model lacked the trial's initialisation); no constant was set from it.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import json
import os
import platform
import tempfile
import time
from pathlib import Path

from autotune.hardware import parse_gpus
from autotune.models import ModelSpec, from_shape
from autotune.train_config import TrainConfig
from autotune.trial.record import TrialRequest

DATA = Path(__file__).parent / "data"
SOURCE = "benchmarks/record_cpu_landscape.py"


@dataclasses.dataclass(frozen=True)
class Setup:
    model: ModelSpec
    gpus: str
    grid: dict
    fixed: dict


SETUPS = {
    "cpu_landscape": Setup(
        from_shape(
            "landscape-tiny",
            "llama",
            num_layers=4,
            hidden_size=256,
            num_heads=4,
            ffn_hidden_size=688,
            vocab_size=16000,
            max_seq_len=512,
            source=SOURCE,
        ),
        "2xcpu@640MiB",
        {"zero_stage": [0, 1, 2, 3], "micro_batch": [1, 2, 4, 8, 16], "ckpt_layers": [0, 2, 4]},
        {"precision": "fp32", "seq_len": 128, "grad_accum": 1},
    ),
    "cpu_landscape_gpt2": Setup(
        from_shape(
            "landscape-gpt2",
            "gpt2",
            num_layers=6,
            hidden_size=192,
            num_heads=6,
            ffn_hidden_size=768,
            vocab_size=8192,
            max_seq_len=512,
            source=SOURCE,
        ),
        "2xcpu@560MiB",
        {"zero_stage": [0, 1, 2, 3], "micro_batch": [1, 2, 4, 8, 16], "ckpt_layers": [0, 3, 6]},
        {"precision": "fp32", "seq_len": 256, "grad_accum": 1},
    ),
}
STEPS, WARMUP, TIMEOUT_S = 3, 1, 180.0  # as search_spaces/tiny-cpu.yaml
COLUMNS = [
    "zero_stage",
    "micro_batch",
    "ckpt_layers",
    "grad_accum",
    "precision",
    "seq_len",
    "status",
    "samples_per_s",
    "step_time_s",
    "peak_bytes",
    "wall_s",
    "load_before",
    "load_after",
    "reason",
]


def wait_for_quiet(max_load: float, max_wait_s: float) -> float:
    """Other work on a shared machine would be measured too: wait until the 1-minute load average
    is below `max_load` (or `max_wait_s` passed) and return the load the trial starts under."""
    t0 = time.monotonic()
    while os.getloadavg()[0] >= max_load and time.monotonic() - t0 < max_wait_s:
        time.sleep(10)
    return os.getloadavg()[0]


def grid(setup: Setup) -> list[TrainConfig]:
    keys = list(setup.grid)
    return [TrainConfig(**dict(zip(keys, values)), **setup.fixed) for values in itertools.product(*setup.grid.values())]


def header(setup: Setup) -> list[str]:
    import deepspeed
    import torch

    meta = {
        "model": dataclasses.asdict(setup.model),
        "gpus": setup.gpus,
        "steps": STEPS,
        "warmup_steps": WARMUP,
        "recorded": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
    }
    return [f"# {k}: {json.dumps(v)}" for k, v in meta.items()]


def record(
    setup: Setup,
    configs: list[TrainConfig],
    out: Path,
    keep: list[dict],
    max_load: float,
    max_wait_s: float,
    earlier: dict[tuple, dict] | None = None,
) -> None:
    from autotune.trial.launch import run_trial

    cluster = parse_gpus(setup.gpus)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="") as f, tempfile.TemporaryDirectory() as tmp:
        f.write("\n".join(header(setup)) + "\n")
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(keep)
        f.flush()
        for i, cfg in enumerate(configs):
            req = TrialRequest(
                model=setup.model,
                cluster=cluster,
                config=cfg,
                out_dir=Path(tmp, f"trial-{i:03d}"),
                steps=STEPS,
                warmup_steps=WARMUP,
                timeout_s=TIMEOUT_S,
                trial_id=i,
            )
            load = wait_for_quiet(max_load, max_wait_s)
            res = run_trial(req)
            row = {
                **{k: getattr(cfg, k) for k in COLUMNS[:6]},
                "status": res.status,
                "samples_per_s": res.samples_per_s,
                "step_time_s": res.step_time_s,
                "peak_bytes": res.peak_bytes,
                "wall_s": round(res.wall_s or 0.0, 3),
                "load_before": round(load, 2),
                "load_after": round(os.getloadavg()[0], 2),
                "reason": res.reason.replace("\n", " ")[:200],
            }
            w.writerow(faster(row, (earlier or {}).get(row_key(row))))
            f.flush()
            print(
                f"[{i + 1}/{len(configs)}] {cfg.short()}: {res.status} {res.samples_per_s or 0:.3f} samples/s, "
                f"{res.wall_s or 0:.1f} s",
                flush=True,
            )


def clean_rows(path: Path, max_load_after: float) -> list[dict]:
    """Rows of an earlier recording measured on a quiet machine."""
    if not path.exists():
        return []
    rows = csv.DictReader(ln for ln in path.read_text().splitlines() if not ln.startswith("#"))
    return [r for r in rows if r.get("load_after") and float(r["load_after"]) <= max_load_after]


def faster(new: dict, old: dict | None) -> dict:
    """The earlier row if it ran and beat the new one (or the new one did not run), else the new."""
    if old is None or old["status"] != "ok":
        return new
    if new["status"] != "ok" or float(old["samples_per_s"]) > float(new["samples_per_s"]):
        return old
    return new


def row_key(row: dict) -> tuple:
    return tuple(str(row[k]) for k in COLUMNS[:6])


def from_study(name: str, out: Path, recorded: str, space_note: str) -> int:
    """Write the runs of `autotune search --exhaustive` study `name` (one per group: the group's first member
    that fits) as a landscape: the NeoX and Phi-3 ones (from neox-exh1 it writes cpu_landscape_neox.csv's
    values exactly; the Granite one has the same form, from a study no longer at hand). Its trials ran as a
    search runs them (through Ray, one at a time), not under this script's quiet-load wait, so the load columns
    are empty. Returns the rows."""
    from autotune.search import study as st
    from autotune.search.space import parse_space

    study = st.load_study(name)
    model, _, attrs = st.specs_of(study)
    trial = parse_space(attrs["space_text"]).trial
    meta = {
        "model": dataclasses.asdict(model),
        "gpus": attrs["gpus"],
        "steps": trial.steps,
        "warmup_steps": trial.warmup_steps,
        "recorded": recorded,
        "source": f"autotune search --exhaustive, study {name} (space: {space_note})",
    }
    runs = [
        r
        for r in st.records(study)
        if r.config is not None and r.result is not None and r.status not in ("pruned", "running", "interrupted")
    ]
    with out.open("w", newline="") as f:
        f.write("\n".join(f"# {k}: {json.dumps(v)}" for k, v in meta.items()) + "\n")
        w = csv.DictWriter(f, fieldnames=COLUMNS, lineterminator="\n")
        w.writeheader()
        for r in runs:
            ok, res = r.status == "ok", r.result
            w.writerow(
                {
                    **{k: getattr(r.config, k) for k in COLUMNS[:6]},
                    "status": r.status,
                    "samples_per_s": res.samples_per_s if ok else "",
                    "step_time_s": res.step_time_s if ok else "",
                    "peak_bytes": res.peak_bytes if ok and res.peak_bytes else "",
                    "wall_s": round(res.wall_s or 0.0, 3),
                    "load_before": "",
                    "load_after": "",
                    "reason": "" if ok else res.reason.replace("\n", " ")[:200],
                }
            )
    return len(runs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=None, help="record only the first N configs")
    p.add_argument("--landscape", choices=list(SETUPS), default="cpu_landscape")
    p.add_argument("--out", type=Path, default=None, help="default: benchmarks/data/<landscape>.csv")
    p.add_argument(
        "--max-load",
        type=float,
        default=1.0,
        help="start a trial only when the 1-minute load average is below this (default 1.0)",
    )
    p.add_argument("--max-wait", type=float, default=6 * 3600.0, help="seconds to wait for that, per trial")
    p.add_argument("--resume", action="store_true", help="keep the rows of --out measured quietly")
    p.add_argument(
        "--max-load-after",
        type=float,
        default=3.0,
        help="with --resume: a row is clean if the load after its trial was at most this",
    )
    p.add_argument(
        "--best-of",
        type=Path,
        default=None,
        help="an earlier recording: measure every config again and keep the faster row",
    )
    p.add_argument(
        "--from-study",
        default=None,
        metavar="NAME",
        help="write the runs of an `autotune search --exhaustive` study as a landscape (no trial runs)",
    )
    p.add_argument("--recorded", default=time.strftime("%Y-%m-%d"), help="with --from-study: the day it ran")
    p.add_argument("--space-note", default="", help="with --from-study: the space, in words, for the header")
    args = p.parse_args()
    if args.from_study:
        if args.out is None:
            p.error("--from-study needs --out")
        print(f"{from_study(args.from_study, args.out, args.recorded, args.space_note)} runs -> {args.out}")
        return
    setup = SETUPS[args.landscape]
    args.out = args.out or DATA / f"{args.landscape}.csv"
    earlier = {row_key(r): r for r in clean_rows(args.best_of, float("inf"))} if args.best_of else None
    keep = clean_rows(args.out, args.max_load_after) if args.resume else []
    done = {row_key(r) for r in keep}
    todo = [c for c in grid(setup) if tuple(str(getattr(c, k)) for k in COLUMNS[:6]) not in done][: args.limit]
    print(f"{len(keep)} clean rows kept, {len(todo)} configs to measure", flush=True)
    record(setup, todo, args.out, keep, args.max_load, args.max_wait, earlier)


if __name__ == "__main__":
    main()
