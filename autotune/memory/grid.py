"""Price a whole (micro batch x checkpointed layers) grid at once, exactly.

For a fixed model, cluster, stage, precision and sequence length every phase total of `estimate` is bilinear in the
micro batch b and the checkpointed-layer count k: total(b, k) = a + c_b b + c_k k + c_bk b k (activations are b times a
per-token constant; checkpointing swaps L - k full layers for k inputs; the states do not depend on b). Four estimates
give each phase's coefficients (tests/test_memory.py checks them point by point). Traced code is affine in k from k = 1
only (a checkpointed run adds one mask once; measured: docs/measurements/memory.md), so k = 0 is priced apart and k >= 1
fitted on 1 and 2; a stack of mixed layers is not affine in k and each k is priced, bilinear in b
(tests/test_memory_hf.py)."""

from __future__ import annotations

import dataclasses

import numpy as np

from autotune.hardware import Cluster
from autotune.memory import builtin, estimate
from autotune.memory.overhead import overhead_terms
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig


def grid_total_bytes(
    model: ModelSpec, cluster: Cluster, base: TrainConfig, micro_batches: np.ndarray, ckpt_layers: np.ndarray
) -> np.ndarray:
    """total_bytes (tensor peak + overhead) for every (micro_batch, ckpt_layers) pair:
    an array of shape (len(micro_batches), len(ckpt_layers))."""
    layers = model.num_layers
    if not model.uniform_blocks:  # a mixed stack is not affine in k: each k is priced, bilinear in b only
        b = np.asarray(micro_batches, dtype=np.float64)
        peak = np.zeros((b.shape[0], len(ckpt_layers)))
        for j, kv in enumerate(np.asarray(ckpt_layers).tolist()):
            f = [
                estimate(model, cluster, dataclasses.replace(base, micro_batch=m, ckpt_layers=int(kv))).phases
                for m in (1, 2)
            ]
            for name in set(f[0]) | set(f[1]):
                one, two = f[0].get(name, 0), f[1].get(name, 0)
                peak[:, j] = np.maximum(peak[:, j], one + (two - one) * (b - 1))
        return _with_overhead(peak, cluster)
    ks = sorted({0, min(1, layers), min(2, layers)})
    pts = {
        (b, k): estimate(model, cluster, dataclasses.replace(base, micro_batch=b, ckpt_layers=k)).phases
        for b in (1, 2)
        for k in ks
    }
    b = np.asarray(micro_batches, dtype=np.float64)[:, None]
    k = np.asarray(ckpt_layers, dtype=np.float64)[None, :]
    peak = np.zeros((b.shape[0], k.shape[1]))
    traced = not builtin(model)

    def bilinear(f, k0, k1):
        c_bk = ((f[(2, k1)] - f[(2, k0)]) - (f[(1, k1)] - f[(1, k0)])) / max(k1 - k0, 1)
        c_k = (f[(1, k1)] - f[(1, k0)]) / max(k1 - k0, 1) - c_bk
        c_b = f[(2, k0)] - f[(1, k0)] - c_bk * k0
        a = f[(1, k0)] - c_b - (c_k + c_bk) * k0
        return a + c_b * b + c_k * k + c_bk * b * k

    for name in set().union(*(p.keys() for p in pts.values())):
        # the recompute point exists only for k >= 1: fit it on k = 1, 2
        k0, k1 = (1, 2) if name.startswith("backward (recompute") or traced else (0, 1)
        if k1 not in ks:
            k1 = k0
        f = {key: p.get(name, 0) for key, p in pts.items()}
        total = bilinear(f, k0, k1)
        if name.startswith("backward (recompute"):
            total = np.where(k > 0, total, 0)
        elif traced:
            total = np.where(k > 0, total, bilinear(f, 0, 0))
        if name == "backward (layers)":
            total = np.where(k < layers, total, 0)
        peak = np.maximum(peak, total)
    return _with_overhead(peak, cluster)


def _with_overhead(peak: np.ndarray, cluster: Cluster) -> np.ndarray:
    fixed = sum(v for n, v in overhead_terms(cluster, 0).items() if n != "allocator_fragmentation")
    frac = overhead_terms(cluster, 10**12).get("allocator_fragmentation", 0) / 10**12
    return np.floor(peak) + np.floor(frac * peak) + fixed
