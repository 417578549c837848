"""Tensor parallelism (DeepSpeed AutoTP training) and Ulysses sequence parallelism: the estimate against real
DeepSpeed runs on CPU ranks.

    python benchmarks/parallel_memory.py            # the recorded runs (benchmarks/data/parallel_memory_runs.csv)
                                                    # against today's estimate: median / worst / worst under
    python benchmarks/parallel_memory.py --measure  # run them again (2 and 4 CPU ranks, ~12 min on 2 cores)
    python benchmarks/parallel_memory.py --measure --world 4   # only the 4-rank ones (the others' rows kept)
    python benchmarks/parallel_memory.py --sp                  # only the Ulysses rows (sequence_parallel_size 2)
    python benchmarks/parallel_memory.py --measure --sp        # run only those again
    python benchmarks/parallel_memory.py --measure --offload   # run only the sp rows with ZeRO offload (SP_OFFLOAD)
    python benchmarks/parallel_memory.py --timing   # again, over 16 steps, the AutoTP runs that never met the priced
                                                    # timing (TIMING_STEPS)

The recorded set: hf_memory.py's Llama (GQA 8/2 heads, untied head), Qwen2 (4/2 heads, tied embeddings,
q/k/v biases) and Mistral (6/2 heads) shapes at tp 2 on 2 ranks (dp 1) under ZeRO 0-3, and on 4 ranks
(tp 2 x dp 2) under ZeRO 1-3, bf16 and fp32, with and without checkpointed layers; the same shapes at sp 2 on 2
ranks under ZeRO 0-3 and sp 2 x dp 2 on 4 ranks under ZeRO 1-3 (SP_CONFIGS), and LoRA at sp 2; Llama and Qwen2 at
sp 2 with ZeRO offload (SP_OFFLOAD: offload_optimizer at ZeRO 1-3, offload_param cpu at ZeRO-3, 2 and 4 ranks). A row
whose combination autotune/parallel.py refuses (ZeRO 1-2 offload with sp) is printed as refused and left out of the
summaries: it is the refusal's evidence. Each row is one real trial (autotune.trial.run_trials: 1 warm-up and 2
measured steps, profiler live bytes); `measured_bytes` is the highest rank's lowest step peak, as the tests
judge (tests/steady.py). The bar (issue 31): median |error| at most 1%, worst at most 3%, never more than 1%
under.
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
from steady import larger, steady_peak, unmet_timing  # noqa: E402

from autotune.errors import SpecError  # noqa: E402
from autotune.hardware import parse_gpus  # noqa: E402
from autotune.memory import estimate  # noqa: E402
from autotune.memory.buffers import TIMING_TERMS  # noqa: E402
from autotune.train_config import TrainConfig, check_config  # noqa: E402

CSV = HERE / "data" / "parallel_memory_runs.csv"
STEPS = 6
"""Measured steps of an AutoTP run: enough that a step at the worst timing of its logits gather shows in most runs
(memory/tensor_parallel.py sharded_head; docs/memory.md, "Peaks that depend on timing")."""
TIMING_STEPS = 16
"""Measured steps of an AutoTP run measured again with `--timing` because none of its steps met the logits gather's
worst timing (knobs_on_hf.py TIMING_STEPS)."""
TP_FAMILIES = ("llama", "qwen2", "mistral")
# (world, autotp_size, zero stage, precision, checkpointed layers (-1: all), micro batch, seq len)
CONFIGS = [
    (2, 2, 0, "bf16", 0, 2, 128),
    (2, 2, 1, "fp32", 0, 2, 96),
    (2, 2, 2, "bf16", 1, 2, 128),
    (2, 2, 3, "bf16", -1, 2, 96),
    # tp 2 x dp 2: ZeRO shards over the 2 data-parallel ranks
    (4, 2, 1, "bf16", 0, 2, 64),
    (4, 2, 2, "fp32", 1, 1, 96),
    (4, 2, 3, "bf16", 0, 2, 64),
]
# Ulysses sequence parallelism: (world, sequence_parallel_size, zero stage, precision, checkpointed layers (-1: all),
# micro batch, seq len, method)
SP_CONFIGS = [
    (2, 2, 0, "bf16", 0, 2, 128, "full"),
    (2, 2, 1, "fp32", 0, 2, 96, "full"),
    (2, 2, 2, "bf16", 1, 2, 128, "full"),
    (2, 2, 3, "bf16", -1, 2, 96, "full"),
    # sp 2 x dp 2: ZeRO shards over all 4 ranks (the sequence-data-parallel group)
    (4, 2, 1, "bf16", 0, 2, 64, "full"),
    (4, 2, 2, "fp32", 1, 1, 96, "full"),
    (4, 2, 3, "bf16", 0, 2, 64, "full"),
]
SP_LORA = [(2, 2, 0, "bf16", 0, 2, 128, "lora")]
"""LoRA at sp 2 on Llama only."""
SP4 = {"qwen2": [(4, 4, 1, "bf16", 0, 2, 64, "full")], "llama": [(4, 4, 3, "bf16", 0, 2, 64, "full")]}
"""sp 4 on 4 ranks, above the 2 KV heads (Ulysses repeats them: kv_replication_factor 2); Mistral's 6 heads refuse it."""
SP_OFFLOAD = [
    (2, 2, 1, "bf16", 0, 2, 128, "full", True, "none"),
    (2, 2, 2, "bf16", 0, 2, 128, "full", True, "none"),
    (2, 2, 3, "bf16", 0, 2, 96, "full", True, "none"),
    (2, 2, 3, "bf16", 0, 2, 96, "full", True, "cpu"),
    (2, 2, 3, "bf16", -1, 2, 96, "full", False, "cpu"),
    # sp 2 x dp 2: ZeRO (and its offloaded partitions) over all 4 ranks
    (4, 2, 1, "bf16", 0, 2, 64, "full", True, "none"),
    (4, 2, 2, "fp32", 1, 1, 96, "full", True, "none"),
    (4, 2, 3, "bf16", 0, 2, 64, "full", True, "cpu"),
]
"""Ulysses with ZeRO offload at sp 2 on 2 ranks: SP_CONFIGS' columns, then offload_optimizer and offload_param."""
OFFLOAD_FAMILIES = ("llama", "qwen2")
FIELDS = (
    "autotp_size",
    "sequence_parallel_size",
    "zero_stage",
    "precision",
    "ckpt_layers",
    "micro_batch",
    "seq_len",
    "method",
    "offload_optimizer",
    "offload_param",
)
DEFAULTS = {"sequence_parallel_size": 1, "method": "full", "offload_optimizer": "False", "offload_param": "none"}
"""Columns the first (tp) rows were recorded without."""


def cases(sp_only: bool = False, offload_only: bool = False) -> list[tuple[str, int, TrainConfig]]:
    out = []
    for family in TP_FAMILIES:
        layers = spec_of(family).num_layers
        for world, sp, z, p, k, mb, s, method, oo, op in SP_OFFLOAD if family in OFFLOAD_FAMILIES else []:
            out.append(
                (
                    family,
                    world,
                    TrainConfig(
                        sequence_parallel_size=sp,
                        zero_stage=z,
                        precision=p,
                        micro_batch=mb,
                        ckpt_layers=layers if k < 0 else k,
                        seq_len=s,
                        method=method,
                        offload_optimizer=oo,
                        offload_param=op,
                    ),
                )
            )
        if offload_only:
            continue
        for world, tp, z, p, k, mb, s in [] if sp_only else CONFIGS:
            out.append(
                (
                    family,
                    world,
                    TrainConfig(
                        autotp_size=tp,
                        zero_stage=z,
                        precision=p,
                        micro_batch=mb,
                        ckpt_layers=layers if k < 0 else k,
                        seq_len=s,
                    ),
                )
            )
        for world, sp, z, p, k, mb, s, method in (
            SP_CONFIGS + (SP_LORA if family == "llama" else []) + SP4.get(family, [])
        ):
            out.append(
                (
                    family,
                    world,
                    TrainConfig(
                        sequence_parallel_size=sp,
                        zero_stage=z,
                        precision=p,
                        micro_batch=mb,
                        ckpt_layers=layers if k < 0 else k,
                        seq_len=s,
                        method=method,
                    ),
                )
            )
    return out


def cluster(world: int):
    return parse_gpus(f"{world}xcpu")


def is_offload(row: dict) -> bool:
    return row.get("offload_optimizer") == "True" or row.get("offload_param") not in (None, "", "none")


def _key(family: str, world: int, cfg: TrainConfig) -> tuple:
    return (family, int(world), *(str(getattr(cfg, f)) for f in FIELDS))


def unmet_tp_timing(row: dict, full=None) -> bool:
    """Whether an AutoTP row's largest step never met the logits gather's worst timing its estimate (`full`, else
    computed) prices (steady.unmet_timing)."""
    if int(row.get("autotp_size") or 1) == 1:
        return False
    full = full or estimate(spec_of(row["family"]), cluster(int(row["world"])), train_config(row))
    return bool(unmet_timing(full, judged_bytes(row)))


def measure_all(
    only_world: int | None = None,
    sp_only: bool = False,
    offload_only: bool = False,
    tp_only: bool = False,
    timing: bool = False,
) -> None:
    """Run every case (of one world size, if given; only the sequence-parallel ones with sp_only; only those with
    ZeRO offload with offload_only; only the AutoTP ones with tp_only; with `timing` only the recorded AutoTP runs that
    never met the priced timing, over TIMING_STEPS steps) as a real trial, one process group per world size, and
    rewrite the CSV (keeping the rows not measured again, in their places)."""
    import deepspeed
    import torch
    import transformers

    from autotune.trial import run_trials
    from autotune.trial.record import TrialRequest

    versions = f"torch {torch.__version__}, deepspeed {deepspeed.__version__}, transformers {transformers.__version__}"
    todo = [(f, w, c) for f, w, c in cases(sp_only, offload_only) if only_world in (None, w)]
    if tp_only:
        todo = [(f, w, c) for f, w, c in todo if c.autotp_size > 1]
    rows = []
    if timing:
        recorded = load()
        redo = {_key(r["family"], r["world"], train_config(r)) for r in recorded if unmet_tp_timing(r)}
        todo = [(f, w, c) for f, w, c in todo if _key(f, w, c) in redo]
    elif (only_world is not None or sp_only or offload_only or tp_only) and CSV.exists():
        with CSV.open() as f:
            rows = [
                {**DEFAULTS, **r}
                for r in csv.DictReader(f)
                if not (
                    only_world in (None, int(r["world"]))
                    and (not sp_only or int(r.get("sequence_parallel_size") or 1) > 1)
                    and (not offload_only or is_offload(r))
                    and (not tp_only or int(r.get("autotp_size") or 1) > 1)
                )
            ]
    for world in sorted({w for _, w, _ in todo}):
        mine = [(f, c) for f, w, c in todo if w == world]
        with tempfile.TemporaryDirectory() as tmp:
            reqs = [
                TrialRequest(
                    model=spec_of(f),
                    cluster=cluster(world),
                    config=c,
                    steps=TIMING_STEPS if timing else STEPS if c.autotp_size > 1 else 2,
                    warmup_steps=1,
                    timeout_s=900,
                    out_dir=Path(tmp) / f"{i}-{f}",
                )
                for i, (f, c) in enumerate(mine)
            ]
            for r in reqs:
                check_config(r.config, r.model, r.cluster)
            results = run_trials(reqs)
            steady = [steady_peak(r) if r.status == "ok" and r.peak_bytes else None for r in results]
        for (family, c), res, steady_bytes in zip(mine, results, steady):
            if res.status != "ok" or not res.peak_bytes:
                print(f"  ! {family} {c.short()}: {res.status} {res.reason[:300]}")
                continue
            rows.append(
                {
                    "family": family,
                    "hf_config": json.dumps(FAMILIES[family], sort_keys=True),
                    "world": world,
                    **{f: getattr(c, f) for f in FIELDS},
                    "measured_bytes": steady_bytes,
                    "largest_step_bytes": res.peak_bytes,
                    "measured_by": f"run_trials, {world} CPU ranks (gloo), steps {len(res.step_peak_bytes)} "
                    f"after 1 warm-up, profiler peak, the highest rank's lowest step (tests/steady.py) and the "
                    f"largest step; {versions}",
                }
            )
    if timing:  # in its recorded place, the run with the larger largest step (the worst timing either met)
        fresh = {_key(r["family"], r["world"], train_config(r)): r for r in rows}
        rows = [larger(r, fresh.get(_key(r["family"], r["world"], train_config(r)))) for r in recorded]
    with CSV.open("w", newline="") as f:
        w = csv.DictWriter(
            f,
            fieldnames=["family", "hf_config", "world", *FIELDS, "measured_bytes", "largest_step_bytes", "measured_by"],
        )
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {len(rows)} rows to {CSV}")


OPEN: dict[tuple, str] = {
    ("mistral", 4, 2, "fp32", 1): "ZeRO-2 fp32 under Ulysses, a layer checkpointed: the gradient a collective's thread "
    "frees late, priced at its worst timing (buffers.late_freed_gradient, 691,200 B), reads +4.2% over the steady step "
    "it is judged on, while the run's largest step is 4.5% above the estimate: Ulysses' own timing-dependent peaks are "
    'not priced (docs/memory.md, "Peaks that depend on timing")',
}
"""Ulysses rows outside the bar, (family, world, zero stage, precision, checkpointed layers) -> why;
docs/parallelism.md. The two before (Llama ZeRO-2 fp32 and Mistral ZeRO-1 bf16 on 4 ranks) were closed by gloo's
all-gather after the step (memory/buffers.py gloo_allgather_bytes) and ZeRO-1's fp32 reduction under sp
(memory/sequence_parallel.py zero1_fp32_reduce_phase)."""


def open_reason(row: dict) -> str | None:
    c = train_config(row)
    if c.sequence_parallel_size == 1:
        return None
    return OPEN.get((row["family"], int(row["world"]), c.zero_stage, c.precision, c.ckpt_layers))


def judged_bytes(row: dict) -> int:
    """The measured peak a row is judged against: an AutoTP row's largest step (the worst timing of its logits
    gather, which the estimate prices: memory/tensor_parallel.py sharded_head), a Ulysses row's steady step (its
    timing-dependent peaks are not priced yet: docs/memory.md, "Peaks that depend on timing")."""
    if int(row.get("autotp_size") or 1) > 1:
        return int(row["largest_step_bytes"])
    return int(row["measured_bytes"])


def load() -> list[dict]:
    with CSV.open() as f:
        return list(csv.DictReader(f))


def train_config(row: dict) -> TrainConfig:
    row = {**DEFAULTS, **{k: v for k, v in row.items() if v not in (None, "")}}
    kind = {"precision": str, "method": str, "offload_param": str, "offload_optimizer": lambda v: str(v) == "True"}
    return TrainConfig(**{f: kind.get(f, int)(row[f]) for f in FIELDS})


def report(sp_only: bool = False) -> dict:
    """Print every recorded case (or the Ulysses ones) and the summary (estimated against measured); return it."""
    with CSV.open() as f:
        rows = [r for r in csv.DictReader(f) if not sp_only or int(r.get("sequence_parallel_size") or 1) > 1]
    print(f"== AutoTP and Ulysses on transformers' code: estimated vs measured ({len(rows)} runs, {CSV.name}) ==")
    errors, by_kind, closed, refused, met, unmet = [], {"tp": [], "sp": []}, [], [], [], []
    for row in rows:
        spec, cfg = spec_of(row["family"], json.loads(row["hf_config"])), train_config(row)
        measured = judged_bytes(row)
        full = estimate(spec, cluster(int(row["world"])), cfg)
        est = full.tensor_peak_bytes
        try:
            check_config(cfg, spec, cluster(int(row["world"])))
        except SpecError as e:  # measured to find out; autotune refuses it (the reason quotes these rows)
            refused.append(est / measured - 1)
            print(
                f"  {row['family']:<8} world {row['world']} tp {cfg.autotp_size} sp {cfg.sequence_parallel_size} "
                f"{cfg.short():<28} s{cfg.seq_len:<4} measured {measured:>12,}  estimated {est:>12,}  "
                f"{100 * refused[-1]:+7.3f}%  (refused: {str(e).split(':')[0]})"
            )
            continue
        errors.append(est / measured - 1)
        by_kind["sp" if cfg.sequence_parallel_size > 1 else "tp"].append(errors[-1])
        if unmet_tp_timing(row, full):
            unmet.append(errors[-1])
        else:
            met.append(errors[-1])
        why = open_reason(row)
        if cfg.sequence_parallel_size > 1 and not why:
            closed.append(errors[-1])
        print(
            f"  {row['family']:<8} world {row['world']} tp {cfg.autotp_size} sp {cfg.sequence_parallel_size} "
            f"{cfg.short():<28} s{cfg.seq_len:<4} measured {measured:>12,}  estimated {est:>12,}  {100 * errors[-1]:+7.3f}%"
            + (f"  (open: {why.split(':')[0]})" if why else "")
        )
    for kind, errs in by_kind.items():
        if errs:
            k = summary(errs)
            print(
                f"  {kind} ({len(errs)} runs): median |error| {k['median']:.3f}%, worst {k['max']:.3f}%, "
                f"worst under {k['under']:.3f}%"
            )
    if closed and len(closed) < len(by_kind["sp"]):
        k = summary(closed)
        print(
            f"  sp without the {len(by_kind['sp']) - len(closed)} open rows (OPEN): median |error| {k['median']:.3f}%, "
            f"worst {k['max']:.3f}%, worst under {k['under']:.3f}%"
        )
    if refused:
        k = summary(refused)
        print(
            f"  refused ({len(refused)} runs, not in the summaries; autotune/parallel.py): median |error| "
            f"{k['median']:.3f}%, worst {k['max']:.3f}%, worst under {k['under']:.3f}%"
        )
    s = summary(errors)
    print(
        f"  all: median |error| {s['median']:.3f}%, worst {s['max']:.3f}%, worst under {s['under']:.3f}% "
        f"(bar: 1%, 3%, 1%)"
    )
    if unmet:
        m = summary(met)
        print(
            f"  {len(unmet)} runs never met the worst timing the estimate prices ({', '.join(TIMING_TERMS)}); the other "
            f"{len(met)}: median |error| {m['median']:.3f}%, worst {m['max']:.3f}%, worst under {m['under']:.3f}%"
        )
    return {
        **s,
        "sp": summary(by_kind["sp"]) if by_kind["sp"] else None,
        "sp_closed": summary(closed) if closed else None,
    }


if __name__ == "__main__":
    if "--measure" in sys.argv or "--timing" in sys.argv:
        measure_all(
            int(sys.argv[sys.argv.index("--world") + 1]) if "--world" in sys.argv else None,
            sp_only="--sp" in sys.argv,
            offload_only="--offload" in sys.argv,
            tp_only="--tp" in sys.argv,
            timing="--timing" in sys.argv,
        )
    report(sp_only="--sp" in sys.argv)
