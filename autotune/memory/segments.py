"""The segments of a traced training step, and the categories its live bytes are split into: the
vocabulary tracer.py records in and traced.py, code_trace.py and seq_family.py read. Plain data and
two pure functions at the bottom of memory/'s layers (pyproject.toml's import contract), so the tracer
(torch) and the accounting above it (no torch where every program is cached) share them without
importing each other.
"""

from __future__ import annotations

CATEGORIES = (
    "parameters",
    "module_buffers",
    "gradients",
    "optimizer_states",
    "batch_and_loss",
    "rotary_tables",
    "activations",
    "temporaries",
)
"""How `raw_phases` splits the single-process program's live bytes."""
PHASE_POINTS = {
    "forward": ("fwd.start", "fwd.ckpt.first", "fwd.ckpt.last", "fwd.full.first", "fwd.full.last", "fwd.head"),
    "backward (loss)": ("bwd.head",),
    "backward (layers)": ("bwd.full.first", "bwd.full.last"),
    "backward (recompute first)": ("bwd.ckpt.first",),
    "backward (recompute last)": ("bwd.ckpt.last",),
    "backward (end)": ("bwd.end",),
    "optimizer": ("opt",),
}
"""Traced phases, estimate()'s names plus 'backward (layers)' (the backward of the blocks that are
not checkpointed, which the analytic model does not price), and the segment peaks each is the max of."""


def classify(snapshot: dict[int, int], known: dict[str, set[int]]) -> dict[str, int]:
    """Bytes of a segment peak's storages (serial -> bytes) by the first category whose serials hold
    each; the rest are temporaries."""
    out = dict.fromkeys(CATEGORIES, 0)
    for serial, n in snapshot.items():
        out[next((c for c, serials in known.items() if serial in serials), "temporaries")] += n
    return out


def segment_points(ckpt: int, full: int) -> list[tuple[str, str]]:
    """(segment, PHASE_POINTS name) of a program of `ckpt` checkpointed then `full` blocks: the
    first and last block of each kind, forward and backward, and the fixed points around them."""
    pairs = [(s, s) for s in ("fwd.start", "fwd.head", "fwd.end", "bwd.head", "bwd.end", "opt")]
    last = ckpt + full - 1  # with one block of a kind, its first and last are the same block
    if ckpt:
        pairs += [
            ("fwd.block0", "fwd.ckpt.first"),
            (f"fwd.block{ckpt - 1}", "fwd.ckpt.last"),
            (f"bwd.block{ckpt - 1}", "bwd.ckpt.first"),
            ("bwd.block0", "bwd.ckpt.last"),
        ]
    if full:
        pairs += [
            (f"fwd.block{ckpt}", "fwd.full.first"),
            (f"fwd.block{last}", "fwd.full.last"),
            (f"bwd.block{last}", "bwd.full.first"),
            (f"bwd.block{ckpt}", "bwd.full.last"),
        ]
    return pairs
