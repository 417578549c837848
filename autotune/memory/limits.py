"""The largest sequence length or micro batch that fits, for the rest of a configuration: `autotune estimate
--max-seq-len` / `--max-micro-batch`.

The estimate is non-decreasing in both (memory/activations.py), so a doubling search and a bisection find the answer in
O(log n) estimates. For traced code the search is guided: each phase is a polynomial of degree at most two in the length
and one in the micro batch, so three estimates predict the answer, which is checked at v and v + 1; where a phase's peak
moves between segments (only piecewise polynomial) the nearest three are fitted again, twice at most, then an exact
bisection finishes. The answer is always the exact estimate's. The search runs inside `traced_once`: each program built
once and stepped at three values spanning the range, the rest replayed (memory/seq_family.py); where that is refused,
values are traced one by one (measured: docs/measurements/memory.md)."""

from __future__ import annotations

import contextlib
import dataclasses

from autotune.errors import SpecError
from autotune.hardware import Cluster
from autotune.memory import builtin, code_trace, estimate
from autotune.memory.overhead import overhead_terms
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig

UNBOUNDED = 1 << 24
"""Largest value searched where the model sets no bound (16M tokens or sequences)."""

PROBES = {"seq_len": (256, 512, 768), "micro_batch": (1, 2, 3)}
"""Where the traced phases are fitted: three points fix a quadratic; multiples of 256 tokens keep
clear of any kernel's alignment padding."""


RANGE = {"seq_len": (256, 65536), "micro_batch": (2, 1024)}
"""Where one traced build answers every value (`traced_once`). Not from micro batch 1: torch takes
other paths for size-1 dimensions (a view where a copy is made otherwise), which seq_family.fit
refuses (measured: transformers' Llama, eager attention, 2 checkpointed layers)."""


def _top(model: ModelSpec, name: str) -> int:
    if name == "seq_len" and model.position == "learned":
        return model.max_seq_len  # learned positions stop there (check_config)
    return UNBOUNDED


@contextlib.contextmanager
def traced_once(model: ModelSpec, cfg: TrainConfig, name: str | None):
    """Within: estimates of `model` at any value of `name` in its RANGE come from one build of each
    traced program, stepped at the range's ends and at `cfg`'s own value (or the geometric middle),
    where that record is exact (memory/seq_family.py). Builtin code needs no trace: nothing changes."""
    if name is None or builtin(model):
        yield
        return
    lo, hi = RANGE[name][0], min(RANGE[name][1], _top(model, name))
    own = getattr(cfg, name)
    mid = own if lo < own < hi else max(lo + 1, min(hi - 1, round((lo * hi) ** 0.5)))
    if not lo < mid < hi:
        yield
        return
    with code_trace.families(name, (lo, mid, hi)):
        yield


def largest_fitting(model: ModelSpec, cluster: Cluster, cfg: TrainConfig, name: str) -> int:
    """The largest value of `name` ("seq_len" or "micro_batch") for which `cfg` fits; 0 if not even 1."""
    with traced_once(model, cfg, name):
        return _largest(model, cluster, cfg, name)


def _largest(model: ModelSpec, cluster: Cluster, cfg: TrainConfig, name: str) -> int:
    top = _top(model, name)
    seen: dict[int, object] = {}

    def est(v: int):
        if v not in seen:
            seen[v] = estimate(model, cluster, dataclasses.replace(cfg, **{name: v}))
        return seen[v]

    refused: set[int] = set()

    def fits(v: int) -> bool:
        if v in refused:
            return False
        try:
            return est(v).fits
        except SpecError:
            # the model's own code refuses a sequence past its config's max_seq_len (measured: MPT's
            # ALiBi table, built for max_seq_len); every longer one too, so the answer is below
            if name == "seq_len" and v > model.max_seq_len:
                refused.add(v)
                return False
            raise

    if builtin(model) or PROBES[name][-1] > top:
        return _search(fits, 1, None, top) if fits(1) else 0
    if not fits(PROBES[name][0]) and not fits(1):  # a probe that fits implies 1 fits: no trace for it
        return 0
    guess = None
    for _ in range(3):
        near = sorted(seen, key=lambda v: abs(v - guess))[:3] if guess else PROBES[name]
        for v in near:
            fits(v)
        if refused.intersection(near):
            break  # no fit through a value the code refuses
        guess = _predicted(cluster, est, tuple(sorted(near)), top)
        if guess is None:
            break
        lo = max((v for v in seen if seen[v].fits), default=1)
        hi = min([v for v in seen if not seen[v].fits] + list(refused), default=top + 1)
        guess = min(max(guess, lo), hi - 1)
        if fits(guess) and (guess == top or not fits(guess + 1)):
            return guess
    lo = max(v for v in seen if seen[v].fits)
    hi = min([v for v in seen if not seen[v].fits] + list(refused), default=None)
    return _search(fits, lo, hi, top)


def _search(fits, lo: int, hi: int | None, top: int) -> int:
    """Largest fitting value given fits(lo) and, if hi is known, not fits(hi): galloping up from
    lo until a value does not fit (or the bound), then bisection."""
    if hi is None:
        step = 1
        while lo < top and fits(min(lo + step, top)):
            lo, step = min(lo + step, top), 2 * step
        hi = min(lo + step, top + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _predicted(cluster: Cluster, est, probes: tuple[int, int, int], top: int) -> int | None:
    """The largest value whose predicted total fits: each phase's tensor bytes fitted through the
    three probes (Lagrange, exact for a quadratic), the allowance (memory/overhead.py) on top."""
    xs = probes
    ys = [est(x).phases for x in xs]
    if any(set(y) != set(ys[0]) for y in ys):
        return None  # a phase appears at some values only: no common fit

    def total(v: int) -> float:
        peak = 0.0
        for phase in ys[0]:
            p = sum(ys[i][phase] * _basis(xs, i, v) for i in range(3))
            peak = max(peak, p)
        return peak + sum(overhead_terms(cluster, int(peak)).values())

    capacity = est(xs[0]).capacity_bytes
    if total(1) > capacity:
        return 1
    lo, hi = 1, 2
    while hi <= top and total(hi) <= capacity:
        lo, hi = hi, 2 * hi
    hi = min(hi, top + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if total(mid) <= capacity else (lo, mid)
    return lo


def _basis(xs: tuple[int, int, int], i: int, v: int) -> float:
    out = 1.0
    for j, x in enumerate(xs):
        if j != i:
            out *= (v - x) / (xs[i] - x)
    return out
