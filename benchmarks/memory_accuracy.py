"""How exact is the memory model? Estimates against real DeepSpeed runs on 2 CPU ranks.

    python benchmarks/memory_accuracy.py                 # Hugging Face models: the recorded runs
                                                         # (benchmarks/data/hf_memory_runs.csv) against
                                                         # today's estimate, per family; then the recorded
                                                         # LoRA, knob, AutoTP/Ulysses and user-loop runs
                                                         # (lora_memory.py, knobs_on_hf.py, parallel_memory.py,
                                                         # user_loops.py) and every set against the bar: median,
                                                         # worst and worst under; ~3-5 min of tracing
    python benchmarks/memory_accuracy.py --run           # re-measure those runs first (~10-15 min on 2 cores)
    python benchmarks/memory_accuracy.py --run held-out  # only the held-out set (other shapes)
    python benchmarks/memory_accuracy.py --builtin       # the stand-in model: analytic vs measured runs,
                                                         # vs the traced tier, and the two rules people use
                                                         # instead (DeepSpeed's estimators, 18 B/param)
    python benchmarks/memory_accuracy.py --builtin --quick

Hugging Face section (hf_memory.py holds the cases): five families (GPT-2 with dropout, Llama with
grouped-query heads, Mistral, Qwen2 with tied embeddings and qkv bias, GPT-NeoX with parallel
residual), ZeRO 0-3, fp32 and bf16, sdpa and eager, micro batch, sequence length and checkpointed
layers varied. No test uses these shapes and nothing in the memory model was fitted to them: the
traced terms come from the module's code, the state terms from DeepSpeed's.

Builtin section:
The measured cases use shapes, sequence lengths and micro batches the model was not tuned on
(the tests use tiny-llama / tiny-gpt2 at seq 64-128, micro batch 2): a 3-layer Llama-style
model with hidden 192 and GQA 6/2 heads and a 3-layer GPT-2 with hidden 160, seq 96, micro
batch 1 and 3, on 2 and 4 CPU ranks. The baselines price model states only (DeepSpeed) or
18 B/param + b*s*h*L*15 (article); their errors are against the same measured peaks.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from autotune.hardware import parse_gpus
from autotune.memory import estimate
from autotune.memory.baselines import article_bytes, deepspeed_estimator_bytes
from autotune.models import from_shape
from autotune.train_config import TrainConfig
from autotune.trial.record import TrialRequest

UNSEEN = {  # the stand-in model (implementation builtin), as the analytic terms describe it
    "llama-h192": replace(
        from_shape(
            "llama-h192",
            "llama",
            num_layers=3,
            hidden_size=192,
            num_heads=6,
            num_kv_heads=2,
            ffn_hidden_size=512,
            vocab_size=3000,
            max_seq_len=256,
            source="benchmark shape, not used by any test",
        ),
        implementation="builtin",
    ),
    "gpt2-h160": replace(
        from_shape(
            "gpt2-h160",
            "gpt2",
            num_layers=3,
            hidden_size=160,
            num_heads=5,
            ffn_hidden_size=640,
            vocab_size=3000,
            max_seq_len=256,
            source="benchmark shape, not used by any test",
        ),
        implementation="builtin",
    ),
}


def measured_cases(quick: bool) -> list[tuple]:
    cases = []
    for ranks in (2, 4):
        stages = range(4)
        mbs = (1, 3) if ranks == 2 and not quick else (3,)
        ks = (0, 1, 3) if ranks == 2 and not quick else (0, 3)
        for name, z, p, k, mb in itertools.product(UNSEEN, stages, ("fp32", "bf16"), ks, mbs):
            cases.append(
                (ranks, name, TrainConfig(zero_stage=z, precision=p, ckpt_layers=k, micro_batch=mb, seq_len=96))
            )
    return cases


def run_measured(cases, root: Path) -> list[dict]:
    from autotune.trial.launch import run_trials

    rows = []
    for ranks in sorted({c[0] for c in cases}):
        cluster = parse_gpus(f"{ranks}xcpu")
        batch = [c for c in cases if c[0] == ranks]
        reqs = [
            TrialRequest(
                model=UNSEEN[name],
                cluster=cluster,
                config=cfg,
                steps=2,
                warmup_steps=1,
                out_dir=root / f"{ranks}-{name}-{cfg.short().replace(' ', '_')}",
            )
            for _, name, cfg in batch
        ]
        t0 = time.perf_counter()
        results = run_trials(reqs)
        print(f"  {len(reqs)} configs on {ranks} ranks measured in {time.perf_counter() - t0:.0f} s", flush=True)
        for req, res in zip(reqs, results):
            if res.status != "ok" or not res.peak_bytes:
                print(f"  ! {req.model.name} {req.config.short()}: {res.status} {res.reason}")
                continue
            est = estimate(req.model, cluster, req.config)
            rows.append(
                {
                    "case": f"{ranks}r {req.model.name} {req.config.short()}",
                    "measured": res.peak_bytes,
                    "ours": est.tensor_peak_bytes,
                    "deepspeed": deepspeed_estimator_bytes(req.model, cluster, req.config),
                    "article": article_bytes(req.model, cluster, req.config),
                }
            )
    return rows


def traced_rows(quick: bool) -> list[dict]:
    from autotune.memory.traced import trace
    from autotune.models import resolve_model

    rows = []
    models = ["gpt2", "llama-2-7b", "llama-2-13b"] + ([] if quick else ["llama-2-70b", "mistral-7b"])
    for name in models:
        spec = resolve_model(name, implementation="builtin")
        cluster = parse_gpus("8xA100")
        for p, mb, k in itertools.product(("fp32", "bf16"), (1, 4), (0, spec.num_layers // 2, spec.num_layers)):
            cfg = TrainConfig(
                zero_stage=3, precision=p, micro_batch=mb, ckpt_layers=k, seq_len=min(2048, spec.max_seq_len)
            )
            t0 = time.perf_counter()
            tr = trace(spec, cluster, cfg)
            rows.append(
                {
                    "case": f"{name} {cfg.short()}",
                    "traced": tr.tensor_peak_bytes,
                    "ours": estimate(spec, cluster, cfg).tensor_peak_bytes,
                    "s": time.perf_counter() - t0,
                }
            )
    return rows


def summarize(rows: list[dict], truth: str, columns: list[str]) -> None:
    print(f"  {'rule':<10} {'median |err|':>13} {'max |err|':>10}   (n = {len(rows)}, against {truth})")
    for col in columns:
        errs = [abs(r[col] / r[truth] - 1) for r in rows]
        print(f"  {col:<10} {100 * statistics.median(errs):>12.2f}% {100 * max(errs):>9.2f}%")
    worst = sorted(rows, key=lambda r: -abs(r["ours"] / r[truth] - 1))[:10]
    print("  ten worst cases for ours:")
    for r in worst:
        print(
            f"    {r['case']:<44} {truth} {r[truth]:>13,}  ours {r['ours']:>13,}  {100 * (r['ours'] / r[truth] - 1):+.3f}%"
        )


BAR = {"median": 1.0, "max": 3.0, "under": 1.0}
"""Issues 30, 31 and 51: median |error| at most 1%, worst at most 3%, never more than 1% under (percent)."""


def recorded_sets(hf: dict[str, dict]) -> None:
    """The recorded LoRA, knob, AutoTP/Ulysses and user-loop runs (lora_memory.py, knobs_on_hf.py, parallel_memory.py,
    user_loops.py: estimated against measured), then every set with `hf` (hf_memory.report's) against the bar."""
    import knobs_on_hf
    import lora_memory
    import parallel_memory
    import user_loops

    sets = {f"hf {w}": s for w, s in hf.items()}
    print()
    sets["lora"] = lora_memory.report()
    print()
    sets["knobs"] = knobs_on_hf.report()
    print()
    par = parallel_memory.report()
    sets["tp+sp"] = {k: par[k] for k in ("n", "median", "max", "under")}
    if par.get("sp"):
        sets["sp"] = par["sp"]
    print()
    sets.update({f"user {loop}": s for loop, s in user_loops.report().items()})
    print("\n== every recorded set against the bar (median |error| <= 1%, worst <= 3%, worst under <= 1%) ==")
    print(f"  {'set':<14} {'runs':>5} {'median':>9} {'worst':>9} {'under':>9}")
    for name, s in sets.items():
        misses = [k for k, limit in BAR.items() if s[k] > limit]
        print(
            f"  {name:<14} {s['n']:>5} {s['median']:>8.3f}% {s['max']:>8.3f}% {s['under']:>8.3f}%  "
            + ("meets the bar" if not misses else f"MISSES ({', '.join(misses)})")
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--run",
        nargs="*",
        metavar="SET",
        choices=["main", "held-out"],
        help="re-measure the Hugging Face runs of these sets (all if none named), rewrite their rows",
    )
    ap.add_argument("--builtin", action="store_true", help="the stand-in model's sections instead")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--skip-traced", action="store_true")
    args = ap.parse_args()
    if not args.builtin:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import hf_memory

        if args.run is not None:
            hf_memory.measure_all(tuple(args.run) or tuple(hf_memory.SETS))
        recorded_sets(hf_memory.report())
        return 0
    print("== analytic (ours) vs measured DeepSpeed runs on CPU (tensor peak, max over ranks) ==")
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_measured(measured_cases(args.quick), Path(tmp))
    summarize(rows, "measured", ["ours", "deepspeed", "article"])
    if not args.skip_traced:
        print("\n== analytic vs traced (fake tensors, ZeRO-3 on 8xA100, seq 2048) ==")
        rows = traced_rows(args.quick)
        summarize(rows, "traced", ["ours"])
        print(
            f"  trace time: median {statistics.median(r['s'] for r in rows):.1f} s, max {max(r['s'] for r in rows):.1f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
