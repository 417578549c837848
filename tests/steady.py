"""The peak a memory estimate is judged against: each rank's steady step peak, not one step's race.

On 2 CPU ranks a buffer handed to gloo is freed by whichever thread drops the last reference to it;
when gloo's worker thread is descheduled for a moment, a gradient (or a 4-byte scalar) outlives the
main thread's reference into the next phase, and that step's peak is higher by its size. Seen once in
CI (2026-12-02): tiny-llama ZeRO-2 fp32, rank 1 at 21,252,268 B against 20,203,688 B on every other
step of both ranks; the 1,048,580 B more is the lm_head's fp32 gradient (2048 x 128 x 4 B) and one
scalar. Seen in a later CI run: tiny-gpt2 ZeRO-0 bf16 with 4 checkpointed layers, both ranks' second
step 2,242,048 B higher than their first. The schedule's peak, the one the memory model prices, is each rank's lowest step peak of the
measured steps (every step runs the same schedule); the highest of the ranks is the trial's.
"""

from __future__ import annotations

import json
from pathlib import Path


def per_rank_steps(res) -> dict[str, list[int]]:
    """Rank -> its measured steps' peaks, from the trial's memory_per_step.json."""
    ranks = json.loads(Path(res.out_dir, "memory_per_step.json").read_text())["ranks"]
    return {r: d["step_peak_bytes"] for r, d in ranks.items()}


def steady_peak(res) -> int:
    """The highest rank's lowest step peak: the peak without one step's late free by a gloo thread."""
    return max(min(steps) for steps in per_rank_steps(res).values())


def worst_peak(res) -> int:
    """The largest step peak of any rank: the worst timing, which the memory model prices (docs/memory.md, "Peaks that
    depend on timing")."""
    return max(max(steps) for steps in per_rank_steps(res).values())


def timing_allowance(est, measured: int) -> float:
    """How far over `measured` an estimate may read because the run's steps never met the worst timing it prices: its
    peak phase's timing-dependent terms (memory/buffers.py TIMING_TERMS), as a fraction of `measured`."""
    return sum(est.terms.get(t, 0) for t in _timing_terms()) / measured


def unmet_timing(est, measured: int) -> int:
    """The bytes of `est`'s timing terms (memory/buffers.py TIMING_TERMS) where the run never met them: it reads more
    than 1% over `measured` with them (the bar's median) and within the bar's 3% without them; else 0. Such a run is
    measured again over more steps (`benchmarks/knobs_on_hf.py --timing`, `parallel_memory.py --timing`) and judged
    apart."""
    timing = sum(est.terms.get(t, 0) for t in _timing_terms())
    if not timing or est.tensor_peak_bytes / measured - 1 <= 0.01:
        return 0
    return timing if (est.tensor_peak_bytes - timing) / measured - 1 <= 0.03 else 0


def _timing_terms() -> tuple[str, ...]:
    from autotune.memory.buffers import TIMING_TERMS

    return TIMING_TERMS


def larger(recorded: dict, again: dict | None) -> dict:
    """Of a recorded run and the same case measured again (`--timing`), the one whose largest step is larger: each row
    stays one run's, and the worst timing either run met is kept."""
    if again is None or int(again["largest_step_bytes"]) <= int(recorded["largest_step_bytes"]):
        return recorded
    return again
