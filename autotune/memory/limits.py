"""The largest sequence length or micro batch that fits, for the rest of a configuration:
`autotune estimate --max-seq-len` / `--max-micro-batch`.

The estimate is non-decreasing in both (every activation term grows with the tokens, nothing
shrinks; memory/activations.py), so a doubling search for an upper bound and a bisection find the
largest fitting value in O(log n) calls of `estimate` (microseconds each).
"""

from __future__ import annotations

import dataclasses

from autotune.hardware import Cluster
from autotune.memory import estimate
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig

UNBOUNDED = 1 << 24
"""Largest value searched where the model sets no bound (16M tokens or sequences)."""


def largest_fitting(model: ModelSpec, cluster: Cluster, cfg: TrainConfig, name: str) -> int:
    """The largest value of `name` ("seq_len" or "micro_batch") for which `cfg` fits; 0 if not even 1."""
    top = UNBOUNDED
    if name == "seq_len" and model.position == "learned":
        top = model.max_seq_len      # learned positions stop there (check_config)

    def fits(v: int) -> bool:
        return estimate(model, cluster, dataclasses.replace(cfg, **{name: v})).fits

    if not fits(1):
        return 0
    lo = 1
    while lo < top and fits(min(2 * lo, top)):
        lo = min(2 * lo, top)
    hi = min(2 * lo, top + 1)        # fits(lo), not fits(hi) (or hi past the bound)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo
