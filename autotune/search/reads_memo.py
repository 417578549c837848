"""Memoise a function of a training configuration by the settings it reads: the memory model reads only some
of each candidate's (full.yaml's 48,996 candidates for 13B on 4 x A100 hold 7,020 distinct estimates).

`fn` runs on a copy of `cfg` that notes each field read (`_Noting`); the result is kept under those fields'
values, and a config with the same values gets it back. Exact where `fn` depends only on `model`, `cluster` (one
per memo) and what it reads, its own caches keyed likewise. A read of every field at once (`__dict__`, pickling,
`key()`) counts as reading all of them; a call that raises is not kept; a call inside another memo's call runs
directly, so the outer one notes what the inner reads. Results are shared: they must be immutable.
"""

from __future__ import annotations

from typing import Any, Callable

from autotune.train_config import TrainConfig

_FIELDS = frozenset(f for f in TrainConfig.__dataclass_fields__)
_METADATA = frozenset({"__class__", "__dataclass_fields__", "__dataclass_params__"})  # the class's, not values
_noted: set[str] | None = None  # the fields read during the memo's call now running; None outside one


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
    """`fn(model, cluster, cfg)` memoised by the fields of `cfg` it reads; one memo per model and cluster."""

    def __init__(self, fn: Callable[[Any, Any, TrainConfig], Any]):
        self.fn = fn
        self.read_sets: list[tuple[str, ...]] = []  # each distinct set of fields a call read, first seen first
        self.results: dict[tuple[int, tuple], Any] = {}  # (index into read_sets, those fields' values) -> result
        self.calls = 0  # calls of `fn` (misses)

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
