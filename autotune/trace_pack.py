"""Writes autotune/data/shipped_traces.json.gz: the trace cache's entries (autotune/trace_cache.py) that
`autotune estimate` of every preset model needs, so that a first estimate of a preset reads them instead of
importing torch and transformers and tracing (3-5 s on a 2-core machine).

    python -m autotune.trace_pack        # 12-22 minutes on 2 cores (most of it the planned spaces)

The work is `jobs()`, each a library call (autotune.estimate, autotune.search.open_search) with the command
that does the same (`commands()`, stored in the pack): each preset, with transformers' code and the stand-in,
on 1 to 64 A100s and V100s at ZeRO 0-3 (`GPUS`, `COUNTS`); on 4 GPUs also the largest sequence length and
micro batch (their families); LoRA and QLoRA on as many A100s; and the simulated 13B x 4xA100 searches of
`PLANNED_SPACES`, the longest Ulysses sequence of docs/parallelism.md, and `autotune plan` of 13B over every
priced option. They run in this process against an empty cache folder; what they store there is the file.
Its entries hold under trace_cache.fingerprint() (the torch, transformers and peft versions and TRACE_FORMAT):
run this again after a change to what is traced or to constraints.txt (tests/test_trace_pack.py fails then).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

GPUS = (("A100", None), ("V100", "fp16"))
"""A GPU with bf16 (its default precision) and one without, at fp16: the programs depend on the
precision, not on the GPU."""
COUNTS = (1, 2, 4, 8, 16, 32, 64)
"""GPUs per run: the optimizer step's traced peak depends on the partition each GPU steps."""


SPACES = Path(__file__).resolve().parents[1] / "search_spaces"
PLANNED_SPACES = ("default.yaml", "lora.yaml", "full.yaml")
"""The shipped spaces whose simulated 13B x 4xA100 plan (the reference article's case, the README's main command)
a first run should answer without tracing: every candidate's estimate and cost-model profile (a search that runs
one trial asks them all)."""


@dataclass(frozen=True)
class Job:
    """One library call of the pack and the command that does the same."""

    argv: list[str]
    """The command that does the same (`autotune ARGV`): the pack's record of what it ran."""
    run: Callable[[], object]


def _breakdown(model: str, gpus: str, impl: str | None, config: dict, largest: tuple[str, ...]) -> None:
    from autotune.estimate import breakdown, resolve

    breakdown(*resolve(model, gpus, impl=impl, **config), largest=largest)


def estimate_job(
    model: str,
    gpus: str,
    zero: int,
    *,
    precision: str | None = None,
    impl: str | None = None,
    method=None,
    largest=(),
    sp: int = 1,
) -> Job:
    """autotune.estimate.breakdown of one configuration; `largest`: ("seq_len",) or ("micro_batch",) or ();
    `sp`: the Ulysses sequence-parallel size."""
    argv = ["estimate", "--model", model, "--gpus", gpus]
    argv += ["--precision", precision] if precision else []
    argv += ["--impl", impl] if impl else []
    argv += ["--method", method] if method else []
    argv += ["--sequence-parallel-size", str(sp)] if sp > 1 else []
    argv += ["--zero", str(zero), *(f"--max-{n.replace('_', '-')}" for n in largest)]
    config = {
        "zero_stage": zero,
        **({"precision": precision} if precision else {}),
        **({"method": method} if method else {}),
        **({"sequence_parallel_size": sp} if sp > 1 else {}),
    }
    return Job(argv, partial(_breakdown, model, gpus, impl, config, tuple(largest)))


def _search(space: str, study: str) -> None:
    from autotune.search import open_search

    with open_search(model="13b", gpus="4xA100", space=space, executor="simulated", study=study) as s:
        s.run(n_trials=1, progress=False)


def search_job(space: str) -> Job:
    """One simulated trial of 13B x 4xA100 over a shipped space: every candidate estimated and priced."""
    path, study = str(SPACES / space), f"pack-{Path(space).stem}"
    # the record names the space as from the repository's root, wherever this checkout is
    argv = [
        "search",
        "--model",
        "13b",
        "--gpus",
        "4xA100",
        "--space",
        f"search_spaces/{space}",
        "--executor",
        "simulated",
    ]
    argv += ["--n-trials", "1", "--no-progress", "--study", study]
    return Job(argv, partial(_search, path, study))


def _plan() -> None:
    from autotune.plan import plan_gpus

    with tempfile.TemporaryDirectory(prefix="autotune-pack-plan-") as folder:
        plan_gpus("13b", 1e9, picture=Path(folder) / "plan.png")


def plan_job() -> Job:
    """The README's plan of 13B over every priced GPU option (1-64 of each type; measured: a plan at a fixed
    --global-batch then traces nothing more)."""
    return Job(["plan", "--model", "13b", "--tokens", "1e9"], _plan)


def jobs() -> list[Job]:
    """Everything the pack runs, in order (module docstring)."""
    from autotune.models import presets

    out = []
    for name in presets():
        for gpu, precision in GPUS:
            for n in COUNTS:
                for impl in ("hf", "builtin"):
                    for zero in (0, 1, 2, 3):
                        # the families over lengths and micro batches hold for any count: traced at 4
                        for largest in ((), ("seq_len",), ("micro_batch",)) if n == 4 else ((),):
                            out.append(
                                estimate_job(name, f"{n}x{gpu}", zero, precision=precision, impl=impl, largest=largest)
                            )
        for n in COUNTS:
            for method in ("lora", "qlora"):
                for zero in (0, 1, 2, 3):
                    out.append(estimate_job(name, f"{n}x{GPUS[0][0]}", zero, method=method))
    # docs/parallelism.md's Ulysses case: the longest sequence on 8 GPUs, with and without sp 8
    out += [estimate_job("llama-3-8b", "8xH100", 3, largest=("seq_len",), sp=sp) for sp in (1, 8)]
    return out + [search_job(space) for space in PLANNED_SPACES] + [plan_job()]


def commands() -> list[list[str]]:
    """The jobs as the commands a user would type (the pack's "commands")."""
    return [j.argv for j in jobs()]


def entries_of(folder: Path) -> dict[str, dict]:
    """The cache folder's entries by their key's repr."""
    out = {}
    for path in sorted(folder.rglob("*.json")):
        entry = json.loads(path.read_text())
        out[entry["key"]] = entry["value"]
    return out


def main(argv: list[str] | None = None) -> int:
    from autotune import trace_cache
    from autotune.errors import SpecError

    p = argparse.ArgumentParser(prog="python -m autotune.trace_pack")
    # a check that it runs: the first N jobs only, the pack written to a temporary file, never the shipped one
    p.add_argument("--limit", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    todo = jobs()[: args.limit] if args.limit else jobs()
    with (
        tempfile.TemporaryDirectory(prefix="autotune-pack-") as root,
        tempfile.TemporaryDirectory(prefix="autotune-pack-studies-") as studies,
    ):
        os.environ["AUTOTUNE_CACHE_DIR"] = root
        os.environ["AUTOTUNE_TRIALS_DIR"] = studies  # the searches' studies, thrown away
        os.environ["AUTOTUNE_SHIPPED_TRACES"] = "0"  # what a first run traces, not what the old file holds
        t0 = time.perf_counter()
        for i, job in enumerate(todo, 1):
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    job.run()
            except SpecError as e:
                print(f"`autotune {' '.join(job.argv)}`: {e}", file=sys.stderr)
                return 1
            print(f"\r[{i}/{len(todo)}] {time.perf_counter() - t0:.0f} s", end="", file=sys.stderr, flush=True)
        print(file=sys.stderr)
        entries = entries_of(Path(root))
    pack = {
        "fingerprint": trace_cache.fingerprint(),
        "libraries": trace_cache.libraries(),
        "commands": [" ".join(j.argv) for j in todo],
        "entries": entries,
    }
    out = trace_cache.SHIPPED
    if args.limit:
        fd, name = tempfile.mkstemp(prefix="autotune-pack-", suffix=".json.gz")
        os.close(fd)
        out = Path(name)
    tmp = out.with_suffix(".tmp")
    with open(tmp, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9, mtime=0) as f:
        f.write(json.dumps(pack, sort_keys=True, separators=(",", ":")).encode())  # the same bytes each time
    os.replace(tmp, out)
    print(
        f"{out}: {len(entries)} entries from {len(todo)} commands, {out.stat().st_size:,} bytes, "
        f"fingerprint {pack['fingerprint']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
