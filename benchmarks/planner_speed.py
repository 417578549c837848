"""How long the simulated search (the planner) of the shipped spaces takes for 13B on 4 x A100, as a user runs it.

    python benchmarks/planner_speed.py                  # lora.yaml and full.yaml
    python benchmarks/planner_speed.py --space lora     # one of them
    python benchmarks/planner_speed.py --warm-runs 3    # the warm run three times, and their median

Each space is searched twice with `autotune search --model 13b --gpus 4xA100 --space search_spaces/S.yaml
--executor simulated`, each time into a new study under a temporary folder:
- first run: an empty trace cache (AUTOTUNE_CACHE_DIR a new folder), so the estimates read the traces shipped
  in autotune/data/shipped_traces.json.gz, as on a fresh install (where those hold: the same library versions
  and trace format; else they are traced, and the figure says so);
- warm: the same cache again, as a later search of the same model finds it.
Printed per run: wall seconds, the child's user + system CPU seconds, trials run and whether the shipped traces
were used. Issue 29's targets: at most 60 s from the shipped traces, at most 30 s with a warm cache. Wall time
depends on what else the machine runs, and the CPU seconds too on a shared machine: the same code's warm run of
full.yaml read 28 to 47 s within one hour of 2026-12-06, so give it several warm runs (--warm-runs).
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SPACES = ("lora", "full")


def run(space: str, cache: Path, workdir: Path, study: str) -> dict:
    env = {**os.environ, "AUTOTUNE_CACHE_DIR": str(cache), "AUTOTUNE_TRIALS_DIR": str(workdir / "trials")}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune",
            "search",
            "--model",
            "13b",
            "--gpus",
            "4xA100",
            "--space",
            str(ROOT / "search_spaces" / f"{space}.yaml"),
            "--executor",
            "simulated",
            "--study",
            study,
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode:
        sys.exit(f"{space}: autotune search failed ({out.returncode}):\n{out.stderr[-3000:]}")
    m = re.search(r"stopped: .*?(\d+) ok, (\d+) failed, (\d+) pruned", out.stdout)
    return {
        "wall": wall,
        "cpu": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "ok": int(m.group(1)) if m else None,
        "pruned": int(m.group(3)) if m else None,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--space", choices=SPACES, action="append", help="a shipped space (default: both)")
    p.add_argument("--warm-runs", type=int, default=1, metavar="N", help="warm runs per space (default 1)")
    args = p.parse_args()
    from autotune import trace_cache

    shipped = bool(trace_cache.shipped())
    print(
        f"shipped traces {'valid for these sources' if shipped else 'NOT valid here (sources or versions differ): first runs trace'}; "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    print(f"{'space':<6} {'run':<6} {'wall s':>7} {'CPU s':>7} {'trials run':>10} {'pruned':>7}")
    for space in args.space or SPACES:
        with tempfile.TemporaryDirectory(prefix="planner-speed-") as tmp:
            tmp = Path(tmp)
            cache = tmp / "cache"
            warm = []
            for i, label in enumerate(["first"] + ["warm"] * max(args.warm_runs, 1)):
                r = run(space, cache, tmp, f"planner-{space}-{i}")
                print(f"{space:<6} {label:<6} {r['wall']:>7.1f} {r['cpu']:>7.1f} {r['ok']!s:>10} {r['pruned']!s:>7}")
                sys.stdout.flush()
                if label == "warm":
                    warm.append(r)
            if len(warm) > 1:
                wall, cpu = (statistics.median(r[k] for r in warm) for k in ("wall", "cpu"))
                print(f"{space:<6} {'median':<6} {wall:>7.1f} {cpu:>7.1f}   ({len(warm)} warm runs)")


if __name__ == "__main__":
    main()
