"""Which Hugging Face families train under AutoTP and Ulysses on 2 CPU ranks, as autotune runs them.

    python benchmarks/parallel_families.py [--zero 1 3] [MODEL_TYPE ...]

For each transformers model_type of benchmarks/hf_families.py whose layers are all attention (the hybrids are
refused under sp by autotune/parallel.py, with measured logits: docs/parallelism.md), a 3-layer config of that
file's shape (hidden 64, 4 heads, 2 KV heads where the family has them, vocab 512, random init) runs one real
`autotune trial` per case: tp 2 and sp 2, each at the ZeRO stages given (default 1 and 3), fp32, micro batch 1,
seq 32, 1 warm-up and 1 measured step, on 2 gloo ranks. Printed per case: ok (with the estimate's error against
the measured peak), refused (autotune's reason, before any rank starts: exit 2) or failed (the trial's status and
the last line of its reason, as the study records a crashed trial). Nothing is asserted: a row that fails inside
DeepSpeed is what autotune/parallel.py should refuse before it costs a trial.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hf_families import COMMON, FAMILIES

HYBRID = ("jamba", "bamba", "granitemoehybrid", "qwen3_next", "lfm2")
"""Families whose layers are not all softmax attention: refused under sp (autotune/parallel.py)."""


def config(fam: str) -> dict:
    from transformers import AutoConfig

    return AutoConfig.for_model(fam, **{**COMMON, **FAMILIES[fam]}).to_dict()


def case(fam: str, mode: str, zero: int, tmp: Path) -> tuple[str, str]:
    d = tmp / fam
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(config(fam)))
    flag = ["--autotp-size", "2"] if mode == "tp" else ["--sequence-parallel-size", "2"]
    cmd = [
        sys.executable,
        "-m",
        "autotune",
        "trial",
        "--model",
        str(d),
        "--gpus",
        "2xcpu",
        "--zero",
        str(zero),
        "--precision",
        "fp32",
        "--micro-batch",
        "1",
        "--seq-len",
        "32",
        "--steps",
        "1",
        "--warmup-steps",
        "1",
        "--timeout",
        "3m",
        "--out",
        str(d / f"{mode}-z{zero}"),
        "--json",
        *flag,
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp)
    if run.returncode == 2:
        return "refused", (run.stderr.strip().splitlines() or [""])[-1][:300]
    try:
        out = json.loads(run.stdout[run.stdout.index("{") :])
    except ValueError:
        return "failed", (run.stderr.strip().splitlines() or ["no output"])[-1][:300]
    if out.get("status") == "ok":
        est, peak = out.get("estimate", {}).get("tensor_peak_bytes"), out.get("peak_bytes")
        err = f"estimate {100 * (est / peak - 1):+.3f}%" if est and peak else ""
        return "ok", err
    return out.get("status", "failed"), (str(out.get("reason", "")).strip().splitlines() or [""])[-1][:300]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("families", nargs="*", default=[f for f in FAMILIES if f not in HYBRID])
    p.add_argument("--zero", type=int, nargs="+", default=[1, 3])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for fam in args.families:
            for mode in ("tp", "sp"):
                for zero in args.zero:
                    status, why = case(fam, mode, zero, Path(tmp))
                    print(f"{fam:16s} {mode} 2 ZeRO-{zero}  {status:8s} {why}", flush=True)


if __name__ == "__main__":
    main()
