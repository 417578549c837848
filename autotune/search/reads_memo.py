"""Memoise a function of a training configuration by the settings it reads.

A search estimates every candidate of its space before it runs anything: `search_spaces/full.yaml` for 13B
on 4 x A100 expands to 48,996 candidates, and the memory model reads only some of their settings (ZeRO++
quantization nowhere; the hpZ partition, overlap_comm and grad_accum_dtype only for some candidates). Its
48,996 estimates hold 7,020 distinct results.

`ReadsMemo(fn)` runs `fn(model, cluster, cfg)` on a copy of `cfg` that notes every field read from it
(`_Noting`). The result is kept under the values of exactly those fields. A later configuration with the
same values for every one of them gets the result back without a run: `fn`, deterministic in what it reads,
would have read the same fields in the same order, seen the same values and returned the same. The same
technique guards `search_space.expand`'s split of `check_combination`.

What it assumes of `fn`: its result depends on `model`, `cluster` (the same for every call of one memo)
and what it reads of `cfg`, not on a clock or a counter; the caches it keeps are themselves keyed by what
they were computed from. A read that could see every field at once (the instance's `__dict__`, pickling or
copying it, the cached `key()`) counts as reading all of them, so such a path is memoised under the whole
configuration: still exact, with no saving. A call that raises is not kept. A call made while another
memo's call is running on a noting copy is run directly, so the outer one notes everything the inner reads.
The results are shared between the configurations that hit, so they must not be changed by the caller
(`MemoryEstimate` is frozen).
"""

from __future__ import annotations

from typing import Any, Callable

from autotune.train_config import TrainConfig

_FIELDS = frozenset(f for f in TrainConfig.__dataclass_fields__)
_METADATA = frozenset({"__class__", "__dataclass_fields__", "__dataclass_params__"})
"""Names read from the class, not from the instance's values."""

_noted: set[str] | None = None
"""The fields read during the memo's call now running, or None outside one."""


class _Noting(TrainConfig):
    """A TrainConfig that adds the name of each field read from it to `_noted`."""

    def __getattribute__(self, name: str) -> Any:
        if _noted is not None:
            if name in _FIELDS:
                _noted.add(name)
            elif name == "_key" or (name.startswith("__") and name not in _METADATA):
                _noted.update(_FIELDS)  # the whole instance at once: every field
        return object.__getattribute__(self, name)


class ReadsMemo:
    """`fn(model, cluster, cfg)` memoised by the fields of `cfg` it reads (module docstring). One memo serves
    one model and cluster: it is keyed on the configuration alone."""

    def __init__(self, fn: Callable[[Any, Any, TrainConfig], Any]):
        self.fn = fn
        self.read_sets: list[tuple[str, ...]] = []
        """Each distinct set of fields a call read, in the order first seen."""
        self.results: dict[tuple[int, tuple], Any] = {}
        """(index into read_sets, the values of those fields) -> the result."""
        self.calls = 0
        """Calls of `fn` (misses); the rest were answered from `results`."""

    def __call__(self, model: Any, cluster: Any, cfg: TrainConfig) -> Any:
        global _noted
        if _noted is not None:
            return self.fn(model, cluster, cfg)
        for i, names in enumerate(self.read_sets):
            hit = self.results.get((i, tuple(getattr(cfg, n) for n in names)))
            if hit is not None:
                return hit
        noted: set[str] = set()
        _noted = noted
        try:
            out = self.fn(model, cluster, _Noting.prechecked(cfg.to_dict()))  # cfg's checks ran when it was built
        finally:
            _noted = None
        self.calls += 1
        names = tuple(sorted(noted))
        if names not in self.read_sets:
            self.read_sets.append(names)
        if out is not None:
            self.results[(self.read_sets.index(names), tuple(getattr(cfg, n) for n in names))] = out
        return out
