"""Writes autotune/data/shipped_traces.json.gz: the trace cache's entries (autotune/trace_cache.py)
that `autotune estimate` of every preset model needs, so that a first estimate of a preset reads
them instead of importing torch and transformers and tracing (3-5 s on a 2-core machine).

    python -m autotune.trace_pack        # 18-22 minutes on 2 cores (12-15 of them the two planned spaces)

The estimates run are `commands()`: each preset, with transformers' code and with the stand-in, on
1 to 64 A100s and V100s (powers of two; bf16 and fp16; the programs depend on the precision, not on the
GPU), at ZeRO 0-3; on 4 GPUs also with --max-seq-len and --max-micro-batch (the families over
sequence lengths and micro batches); LoRA and QLoRA on as many A100s at ZeRO 0-3; and the
simulated 13B x 4xA100 search of search_spaces/lora.yaml and full.yaml (`PLANNED_SPACES`). They
run here, in this process, against an empty cache folder; what they store there is the file.
The entries are what a first run would trace, under the same fingerprint (trace_cache.fingerprint:
torch, transformers, peft and every autotune source), so the file holds only until one of them
changes: run this again after changing autotune's code or the versions in constraints.txt
(tests/test_trace_pack.py says so when it is stale, and re-traces a sample of its entries).
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

GPUS = (("A100", []), ("V100", ["--precision", "fp16"]))
"""A GPU with bf16 (its default precision) and one without, at fp16: the programs depend on the
precision, not on the GPU."""
COUNTS = (1, 2, 4, 8, 16, 32, 64)
"""GPUs per run: the optimizer step's traced peak depends on the partition each GPU steps."""


SPACES = Path(__file__).resolve().parents[1] / "search_spaces"
PLANNED_SPACES = ("lora.yaml", "full.yaml")
"""The shipped spaces whose simulated 13B x 4xA100 plan (the reference article's case) a first run
should answer without tracing: every candidate's estimate and cost-model profile (a search that runs
one trial asks them all)."""


def commands() -> list[list[str]]:
    from autotune.models import presets

    out = []
    for name in presets():
        for gpu, precision in GPUS:
            for n in COUNTS:
                for impl in ("hf", "builtin"):
                    for zero in (0, 1, 2, 3):
                        # the families over lengths and micro batches hold for any count: traced at 4
                        for extra in ([], ["--max-seq-len"], ["--max-micro-batch"]) if n == 4 else ([],):
                            out.append(
                                [
                                    "estimate",
                                    "--model",
                                    name,
                                    "--gpus",
                                    f"{n}x{gpu}",
                                    *precision,
                                    "--impl",
                                    impl,
                                    "--zero",
                                    str(zero),
                                    *extra,
                                ]
                            )
        for n in COUNTS:
            for method in ("lora", "qlora"):
                for zero in (0, 1, 2, 3):
                    out.append(
                        [
                            "estimate",
                            "--model",
                            name,
                            "--gpus",
                            f"{n}x{GPUS[0][0]}",
                            "--method",
                            method,
                            "--zero",
                            str(zero),
                        ]
                    )
    for space in PLANNED_SPACES:
        out.append(
            [
                "search",
                "--model",
                "13b",
                "--gpus",
                "4xA100",
                "--space",
                str(SPACES / space),
                "--executor",
                "simulated",
                "--n-trials",
                "1",
                "--no-progress",
                "--study",
                f"pack-{Path(space).stem}",
            ]
        )
    return out


def entries_of(folder: Path) -> dict[str, dict]:
    """The cache folder's entries by their key's repr."""
    out = {}
    for path in sorted(folder.rglob("*.json")):
        entry = json.loads(path.read_text())
        out[entry["key"]] = entry["value"]
    return out


def main() -> int:
    from autotune import trace_cache
    from autotune.cli import main as cli

    todo = commands()
    with (
        tempfile.TemporaryDirectory(prefix="autotune-pack-") as root,
        tempfile.TemporaryDirectory(prefix="autotune-pack-studies-") as studies,
    ):
        os.environ["AUTOTUNE_CACHE_DIR"] = root
        os.environ["AUTOTUNE_TRIALS_DIR"] = studies  # the searches' studies, thrown away
        os.environ["AUTOTUNE_SHIPPED_TRACES"] = "0"  # what a first run traces, not what the old file holds
        t0 = time.perf_counter()
        for i, argv in enumerate(todo, 1):
            with contextlib.redirect_stdout(io.StringIO()):
                rc = cli(argv)
            if rc != 0:
                print(f"`autotune {' '.join(argv)}` exited {rc}", file=sys.stderr)
                return 1
            print(f"\r[{i}/{len(todo)}] {time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        entries = entries_of(Path(root))
    pack = {
        "fingerprint": trace_cache.fingerprint(),
        "libraries": trace_cache.libraries(),
        "commands": [" ".join(c) for c in todo],
        "entries": entries,
    }
    tmp = trace_cache.SHIPPED.with_suffix(".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f:
        f.write(json.dumps(pack, sort_keys=True, separators=(",", ":")).encode())  # the same bytes each time
    os.replace(tmp, trace_cache.SHIPPED)
    print(
        f"{trace_cache.SHIPPED}: {len(entries)} entries from {len(todo)} estimates, "
        f"{trace_cache.SHIPPED.stat().st_size:,} bytes, fingerprint {pack['fingerprint']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
