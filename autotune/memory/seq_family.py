"""One traced program for every sequence length (or micro batch) in a range: `autotune estimate --max-seq-len` /
`--max-micro-batch` on code that must be traced.

Which storages are live at each moment of a step is the same at every length while the code takes the same branches;
each size is an integer polynomial of degree at most two in the length (attention scores are s x s) and one in the micro
batch, fixed by three steps. `fit` takes three steps of one build (code_trace._run with `vary`, recorded by
tracer.LiveBytes.log) and keeps each storage's polynomial; `Family.program(v)` replays the step at v and returns what a
trace at v returns. `fit` refuses (None) where the three records differ (code that branches on the length: a sliding
window, rotary scaling past the trained positions), a size is no integer polynomial (min(s, w)), or the replay does not
give each probe's own peaks back; values outside the probes' range are traced (docs/memory.md, item 6 of "Code other
than the stand-in")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autotune.memory.segments import CATEGORIES


@dataclass
class Record:
    """One measured step as tracer.LiveBytes logged it (code_trace._measured_step)."""

    baseline: list[tuple[int, int]]  # (serial, bytes) live when the log started
    log: list[tuple[int, int]]  # (serial, +bytes / -bytes)
    samples: list[tuple[int, str, int]]  # (log position, segment, kind)
    known: dict[str, set[int]]  # serials by category
    points: list[tuple[str, str]]  # (segment, point name) kept


@dataclass
class Family:
    """A program's replay for any value from values[0] to values[-1] (see the module docstring)."""

    values: tuple[int, int, int]
    coef: np.ndarray  # (storages, 3) int64: bytes = c0 + c1 v + c2 v^2
    category: np.ndarray  # (storages,) index into segments.CATEGORIES
    base: np.ndarray  # storages live at the start
    events: np.ndarray  # storage index per event
    signs: np.ndarray  # +1 counted, -1 freed
    stints: dict[str, np.ndarray]  # point name -> event counts at which its peak is compared, in order

    def program(self, v: int) -> dict[str, dict[str, int]]:
        """What code_trace.trace_program returns at value v (values[0] <= v <= values[-1])."""
        sizes = self.coef[:, 0] + self.coef[:, 1] * v + self.coef[:, 2] * v * v
        ncat = len(CATEGORIES)
        start = np.zeros(ncat, dtype=np.int64)
        np.add.at(start, self.category[self.base], sizes[self.base])
        steps = np.zeros((len(self.events) + 1, ncat), dtype=np.int64)
        steps[0] = start
        steps[np.arange(1, len(self.events) + 1), self.category[self.events]] = self.signs * sizes[self.events]
        live = np.cumsum(steps, axis=0)
        totals = live.sum(axis=1)
        out = {}
        for name, at in self.stints.items():
            row = live[at[int(np.argmax(totals[at]))]]  # the first moment at the maximum, as LiveBytes keeps it
            out[name] = {c: int(row[i]) for i, c in enumerate(CATEGORIES)}
        return out

    def to_json(self) -> dict:
        return {
            "values": list(self.values),
            "coef": self.coef.tolist(),
            "category": self.category.tolist(),
            "base": self.base.tolist(),
            "events": self.events.tolist(),
            "signs": self.signs.tolist(),
            "stints": {k: v.tolist() for k, v in self.stints.items()},
        }

    @classmethod
    def from_json(cls, d: dict) -> Family:
        return cls(
            values=tuple(d["values"]),
            coef=np.array(d["coef"], dtype=np.int64).reshape(-1, 3),
            category=np.array(d["category"], dtype=np.int64),
            base=np.array(d["base"], dtype=np.int64),
            events=np.array(d["events"], dtype=np.int64),
            signs=np.array(d["signs"], dtype=np.int64),
            stints={k: np.array(v, dtype=np.int64) for k, v in d["stints"].items()},
        )


def _structure(rec: Record):
    """The record with serials renumbered in order of appearance (the baseline first), the size of
    each, and the stints: the samples that decide each kept point's peak, as LiveBytes decides it
    (entering a segment restarts its peak; each op inside it may raise it; a point is one moment)."""
    index: dict[int, int] = {}
    sizes: list[int] = []
    for serial, n in rec.baseline:
        index[serial] = len(sizes)
        sizes.append(n)
    events = []
    for serial, n in rec.log:
        if serial not in index:
            if n < 0:  # freed without having been counted in the log: not a storage of this step
                return None
            index[serial] = len(sizes)
            sizes.append(n)
        events.append((index[serial], 1 if n > 0 else -1))
    temporaries = CATEGORIES.index("temporaries")  # in no known set (traced._classify)
    category = [
        next((CATEGORIES.index(c) for c, serials in rec.known.items() if serial in serials), temporaries)
        for serial in index
    ]  # in index order: the dict keeps insertion order
    runs: dict[str, list[int]] = {}
    current = None
    for pos, segment, kind in rec.samples:
        if kind == 0:
            runs[current].append(pos)
        else:
            runs[segment] = [pos]
            if kind == 1:
                current = segment
    stints = {name: tuple(runs[segment]) for segment, name in rec.points if segment in runs}
    return tuple(events), tuple(category), len(rec.baseline), stints, sizes


def fit(values: tuple[int, int, int], records: list[Record], programs: list[dict]) -> Family | None:
    """The family of three steps at `values` (increasing) of one build, or None where it would not be
    exact (module docstring). `programs`: each step's own traced peaks, which the replay must give back."""
    shapes = [_structure(r) for r in records]
    if any(s is None for s in shapes) or any(s[:4] != shapes[0][:4] for s in shapes[1:]):
        return None
    events, category, nbase, stints, _ = shapes[0]
    coef = [_quadratic(values, ys) for ys in zip(*(s[4] for s in shapes))]
    if None in coef:
        return None
    ev = np.array(events, dtype=np.int64).reshape(-1, 2)
    family = Family(
        values=tuple(values),
        coef=np.array(coef, dtype=np.int64).reshape(-1, 3),
        category=np.array(category, dtype=np.int64),
        base=np.arange(nbase, dtype=np.int64),
        events=ev[:, 0],
        signs=ev[:, 1],
        stints={k: np.array(v, dtype=np.int64) for k, v in stints.items()},
    )
    if any(family.program(v) != p for v, p in zip(values, programs)):
        return None
    return family


def _quadratic(x: tuple[int, int, int], y: tuple[int, int, int]) -> tuple[int, int, int] | None:
    """Integer (c0, c1, c2) of the polynomial through the three points, or None where its
    coefficients are not integers (Python ints: exact at any size)."""
    (x0, x1, x2), (y0, y1, y2) = x, y
    num = (y2 - y1) * (x1 - x0) - (y1 - y0) * (x2 - x1)
    den = (x2 - x1) * (x1 - x0) * (x2 - x0)
    if num % den:
        return None
    c2 = num // den
    rest = (y1 - y0) - c2 * (x1 * x1 - x0 * x0)
    if rest % (x1 - x0):
        return None
    c1 = rest // (x1 - x0)
    return y0 - c1 * x0 - c2 * x0 * x0, c1, c2
