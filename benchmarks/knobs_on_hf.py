"""DeepSpeed's knobs on transformers' code: the estimate against real DeepSpeed runs on 2 CPU ranks.

    python benchmarks/knobs_on_hf.py              # the recorded runs (benchmarks/data/knob_memory_runs.csv)
                                                  # against today's estimate, with median / worst / worst under
    python benchmarks/knobs_on_hf.py --measure    # run them again (one process group, ~10 min on 2 cores)
    python benchmarks/knobs_on_hf.py --test-configs   # tests/test_knobs.py's 33 configurations on tiny-llama

The recorded set: hf_memory.py's GPT-2, Llama, Qwen2 and GPT-NeoX shapes (tests/cases.py FAMILIES) times the
knob configurations below: overlap_comm with the default bucket (hidden^2) and with one bucket larger
than the model (2e7 elements) at ZeRO 1 and 2, fp32 gradient accumulation at ZeRO 1 and 2 in bf16, a
2e6-element reduce bucket at ZeRO-2 fp32, with k = 0, some and all checkpointed layers. Each row is
one real trial (autotune.trial.run_trials: 1 warm-up and 2 measured steps, profiler live bytes):
`measured_bytes` is the highest rank's lowest step peak, as the tests judge (tests/steady.py: a step
where gloo's worker thread frees a buffer late is higher by it; measured: GPT-NeoX ZeRO-2 fp32 with a
2e6 bucket, rank 1's second step +2,213,376 B, a third gradient partition), `largest_step_bytes` the
largest of all. Issue 30's bar: median |error| at most 1%, worst at most 3%, never more than 1%
under.

--test-configs: tests/test_knobs.py checks each knob's memory terms on the stand-in, whose
activations the analytic model prices exactly; this runs the same configurations (tiny-llama, micro
batch 1, seq 32) on the Hugging Face code with the test's tolerances.
"""

from __future__ import annotations

import csv
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from cases import FAMILIES, spec_of, summary  # noqa: E402  hf_memory.py's shapes; the bar's figures
from steady import steady_peak  # noqa: E402
from test_knobs import CLUSTER, IDS, KNOBS, OVER, UNDER, UNDER_ONE_BUCKET, _cfg  # noqa: E402

from autotune.memory import estimate  # noqa: E402
from autotune.models import resolve_model  # noqa: E402
from autotune.train_config import TrainConfig  # noqa: E402

CSV = HERE / "data" / "knob_memory_runs.csv"
KNOB_FAMILIES = ("gpt2", "llama", "qwen2", "gpt_neox")
# (zero stage, precision, checkpointed layers (-1: all), micro batch, seq len, knobs)
CONFIGS = [
    (1, "fp32", 0, 2, 128, dict(overlap_comm=True, reduce_bucket_size=20_000_000)),
    (2, "bf16", 1, 2, 128, dict(overlap_comm=True, reduce_bucket_size=20_000_000)),
    (1, "bf16", -1, 2, 96, dict(overlap_comm=True)),
    (2, "fp32", 0, 3, 96, dict(overlap_comm=True)),
    (1, "bf16", 0, 2, 128, dict(grad_accum_dtype="fp32")),
    (2, "bf16", 1, 3, 96, dict(grad_accum_dtype="fp32")),
    (2, "fp32", 0, 2, 128, dict(reduce_bucket_size=2_000_000)),
    (2, "fp32", -1, 1, 192, dict(reduce_bucket_size=2_000_000, overlap_comm=True)),
]
FIELDS = (
    "zero_stage",
    "precision",
    "ckpt_layers",
    "micro_batch",
    "seq_len",
    "overlap_comm",
    "reduce_bucket_size",
    "grad_accum_dtype",
)


def cases() -> list[tuple[str, TrainConfig]]:
    out = []
    for family in KNOB_FAMILIES:
        layers = spec_of(family).num_layers
        for z, p, k, mb, s, knobs in CONFIGS:
            out.append(
                (
                    family,
                    TrainConfig(
                        zero_stage=z,
                        precision=p,
                        ckpt_layers=layers if k < 0 else k,
                        micro_batch=mb,
                        seq_len=s,
                        **knobs,
                    ),
                )
            )
    return out


def train_config(row: dict) -> TrainConfig:
    kinds = {"precision": str, "grad_accum_dtype": str, "overlap_comm": lambda v: v == "True"}
    return TrainConfig(**{f: kinds.get(f, int)(row[f]) for f in FIELDS})


def measure_all() -> None:
    """Run every case as a real trial (one process group) and rewrite the CSV."""
    import deepspeed
    import torch
    import transformers

    from autotune.trial import run_trials
    from autotune.trial.record import TrialRequest

    todo = cases()
    versions = f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}"
    with tempfile.TemporaryDirectory() as tmp:
        reqs = [
            TrialRequest(
                model=spec_of(f),
                cluster=CLUSTER,
                config=c,
                steps=2,
                warmup_steps=1,
                timeout_s=600,
                out_dir=Path(tmp) / f"{i}-{f}",
            )
            for i, (f, c) in enumerate(todo)
        ]
        results = run_trials(reqs)
        steady = [steady_peak(r) if r.status == "ok" and r.peak_bytes else None for r in results]
    rows = []
    for (family, c), res, steady_bytes in zip(todo, results, steady):
        if res.status != "ok" or not res.peak_bytes:
            print(f"  ! {family} {c.short()}: {res.status} {res.reason[:300]}")
            continue
        rows.append(
            {
                "family": family,
                "hf_config": json.dumps(FAMILIES[family], sort_keys=True),
                **{f: getattr(c, f) for f in FIELDS},
                "measured_bytes": steady_bytes,
                "largest_step_bytes": res.peak_bytes,
                "measured_by": f"run_trials, 2 CPU ranks (gloo), steps 2 after 1 warm-up, profiler peak, "
                f"the highest rank's lowest step (tests/steady.py); {versions}",
            }
        )
    with CSV.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {len(rows)} rows to {CSV}")


def report() -> dict:
    """Print every recorded case and the summary (estimated against measured); return the summary."""
    with CSV.open() as f:
        rows = list(csv.DictReader(f))
    print(
        f"== DeepSpeed knobs on transformers' code, 2 CPU ranks: estimated vs measured ({len(rows)} runs, {CSV.name}) =="
    )
    errors = []
    for row in rows:
        spec, cfg = spec_of(row["family"], json.loads(row["hf_config"])), train_config(row)
        measured = int(row["measured_bytes"])
        est = estimate(spec, CLUSTER, cfg).tensor_peak_bytes
        errors.append(est / measured - 1)
        knobs = " ".join(
            f"{k}={getattr(cfg, k)}"
            for k in ("overlap_comm", "reduce_bucket_size", "grad_accum_dtype")
            if getattr(cfg, k) not in (False, 0, "auto")
        )
        print(
            f"  {row['family']:<9} {cfg.short():<30} s{cfg.seq_len:<4} {knobs:<50} measured {measured:>12,}  "
            f"estimated {est:>12,}  {100 * errors[-1]:+7.3f}%"
        )
    s = summary(errors)
    print(
        f"  median |error| {s['median']:.3f}%, worst {s['max']:.3f}%, worst under {s['under']:.3f}% (bar: 1%, 3%, 1%)"
    )
    return s


def test_configs() -> None:
    model = resolve_model("tiny-llama")
    from autotune.trial import run_trials
    from autotune.trial.record import TrialRequest

    with tempfile.TemporaryDirectory() as root:
        reqs = [
            TrialRequest(
                model=model,
                cluster=CLUSTER,
                config=_cfg(kw),
                out_dir=Path(root, str(i)),
                steps=2,
                warmup_steps=1,
                timeout_s=300,
            )
            for i, kw in enumerate(KNOBS)
        ]
        results = run_trials(reqs)
    misses = 0
    for name, req, res in zip(IDS, reqs, results):
        if res.status != "ok":
            print(f"{name}: {res.status} {res.reason}")
            continue
        est = estimate(model, CLUSTER, req.config).tensor_peak_bytes
        err = est / res.peak_bytes - 1
        under = UNDER_ONE_BUCKET if req.config.reduce_bucket_size >= model.num_params else UNDER
        over = OVER
        miss = not -under <= err <= over
        misses += miss
        print(
            f"{name:90s} measured {res.peak_bytes:>11,} B, estimate {est:>11,} B ({100 * err:+.2f}%)"
            + ("  MISS" if miss else "")
        )
    print(f"\n{misses} of {len(reqs)} outside the test's tolerance")


if __name__ == "__main__":
    if "--test-configs" in sys.argv:
        test_configs()
    else:
        if "--measure" in sys.argv:
            measure_all()
        report()
