"""The op records of a traced step: Op (one kernel as the step runs it) and OpProfile (a block's ops
and the rest's). Apart from autotune.costops, which prices them, so that its tracer
(autotune/costops/trace.py) makes them without importing back the package that imports it."""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True)
class Op:
    """One op as the step runs it: class, aten name, fwd or bwd, FLOPs, bytes read+written, shape."""

    cls: str  # "gemm" | "attention" | "elementwise" (element-wise and reductions)
    name: str
    phase: str  # "fwd" | "bwd"
    flops: float
    nbytes: int
    shape: tuple = ()
    """gemm: (batch, m, k, n); attention: (b, heads, s_q, s_kv, head_dim, causal)."""
    term: str = ""
    """The breakdown term it is reported under when not its class: "attention" for the GEMMs and
    element-wise kernels of eager attention (they touch an s x s score tensor)."""


@dataclass(frozen=True)
class OpProfile:
    """The ops of one forward+backward: `layer` once per block, `rest` once (embedding, head, loss)."""

    layer: tuple[tuple[Op, int], ...]
    rest: tuple[tuple[Op, int], ...]

    def to_json(self) -> dict:
        return {part: [[*dataclasses.astuple(op), n] for op, n in getattr(self, part)] for part in ("layer", "rest")}

    @classmethod
    def from_json(cls, d: dict) -> OpProfile:
        def op(cls_, name, phase, flops, nbytes, shape, term):
            return Op(cls_, name, phase, float(flops), int(nbytes), tuple(shape), term)

        return cls(**{part: tuple((op(*row[:-1]), row[-1]) for row in d[part]) for part in ("layer", "rest")})

    def ops(self, num_layers: int) -> Counter[Op]:
        """Every op of an L-block model with its count."""
        out = Counter(dict(self.rest))
        for op, n in self.layer:
            out[op] += n * num_layers
        return out
