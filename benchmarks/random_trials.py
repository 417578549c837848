"""Randomly drawn real trials against the memory model: configurations no test or recorded set
chose, to find the estimate's errors where nobody looked.

    python benchmarks/random_trials.py --seed 1 --n 16     # ~1 min on 2 cores, one process group

Each draw: transformers' GPT-2 or Llama (tiny-gpt2, tiny-llama), ZeRO 0-3, fp32 or bf16, micro batch
1-3, seq 32-64, 0-2 checkpointed layers, grad_accum 1-2; at ZeRO 1-2 overlap_comm, a reduce bucket
and optimizer offload; at ZeRO-3 offload and a prefetch bucket; sometimes fp32 accumulation or
LoRA. Configurations autotune refuses are drawn again. All run on 2 CPU ranks (gloo) in one process
group (autotune.trial.run_trials); each measured peak (the largest rank's) is set against
`autotune.memory.estimate`, flagged UNDER below -1% and OVER above +3% (tests/test_trial.py's
tolerance). docs/measurements/memory.md ("Known open errors") lists what the draws of 2026-12-02 found.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from autotune.errors import SpecError
from autotune.hardware import parse_gpus
from autotune.memory import estimate
from autotune.models import resolve_model
from autotune.train_config import TrainConfig
from autotune.trial import run_trials
from autotune.trial.record import TrialRequest

CLUSTER = parse_gpus("2xcpu")
KNOBS = (
    "overlap_comm",
    "reduce_bucket_size",
    "offload_optimizer",
    "grad_accum_dtype",
    "method",
    "stage3_prefetch_bucket_size",
)


def draw(rng: random.Random) -> tuple[object, TrainConfig]:
    z = rng.choice([0, 1, 2, 3])
    kw = dict(
        zero_stage=z,
        precision=rng.choice(["fp32", "bf16"]),
        micro_batch=rng.choice([1, 2, 3]),
        seq_len=rng.choice([32, 48, 64]),
        ckpt_layers=rng.choice([0, 1, 2]),
        grad_accum=rng.choice([1, 1, 2]),
    )
    if z in (1, 2):
        kw.update(
            overlap_comm=rng.choice([False, True]),
            reduce_bucket_size=rng.choice([0, 50_000, 300_000]),
            offload_optimizer=rng.choice([False, False, True]),
        )
    if z == 3:
        kw.update(offload_optimizer=rng.choice([False, True]), stage3_prefetch_bucket_size=rng.choice([0, 100_000]))
    if kw["precision"] == "bf16" and z in (2, 3) and rng.random() < 0.3:
        kw.update(grad_accum_dtype="fp32")
    if rng.random() < 0.25:
        kw.update(method="lora", lora_rank=rng.choice([4, 8]))
    return resolve_model(rng.choice(["tiny-gpt2", "tiny-llama"])), TrainConfig(**kw)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--n", type=int, default=16)
    args = p.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="random-trials-"))
    reqs = []
    while len(reqs) < args.n:
        model, cfg = draw(rng)
        try:
            estimate(model, CLUSTER, cfg)  # what autotune refuses is drawn again
        except SpecError:
            continue
        reqs.append(
            TrialRequest(
                model=model,
                cluster=CLUSTER,
                config=cfg,
                out_dir=root / str(len(reqs)),
                steps=2,
                warmup_steps=1,
                timeout_s=300,
            )
        )
    flagged = 0
    for q, r in zip(reqs, run_trials(reqs)):
        knobs = " ".join(
            f"{k}={getattr(q.config, k)}" for k in KNOBS if getattr(q.config, k) not in (False, 0, "auto", "full")
        )
        head = f"{q.model.name:10} {q.config.short():34} seq {q.config.seq_len:<3} {knobs}"
        if r.status != "ok":
            print(f"{head}: {r.status} {r.reason[:150]}")
            continue
        est = estimate(q.model, CLUSTER, q.config)
        err = est.tensor_peak_bytes / r.peak_bytes - 1
        flag = "UNDER" if err < -0.01 else "OVER" if err > 0.03 else ""
        flagged += bool(flag)
        print(
            f"{head}: measured {r.peak_bytes:,} B, estimate {est.tensor_peak_bytes:,} B ({100 * err:+.2f}%, "
            f"{est.phase}) {flag}"
        )
    print(f"\n{flagged} of {len(reqs)} outside -1% .. +3%")


if __name__ == "__main__":
    main()
