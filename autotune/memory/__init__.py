"""The per-GPU memory model: `estimate(model, cluster, cfg)` -> MemoryEstimate.

The peak is the largest of a few points of a training step (phases: forward, backward at the loss, the head, the
recomputed blocks and the end, the optimizer step, and the phases ZeRO-1/2 on CPU ranks and Ulysses add), each priced as
a sum of terms; the estimate reports the terms of the peak phase and a GPU's framework overhead apart
(memory/overhead.py). docs/memory.md has the table of phases and terms, docs/measurements/memory.md what was measured.
"""

from __future__ import annotations

from autotune.hardware import Cluster
from autotune.memory.analytic import MemoryEstimate, builtin
from autotune.memory.analytic import phases as _phases
from autotune.memory.buffers import allgather_phase
from autotune.memory.host import host_bytes_per_node
from autotune.memory.layout import Layout
from autotune.memory.overhead import overhead_terms
from autotune.memory.sequence_parallel import (
    all_to_all_terms,
    trainable_params,
    zero1_fp32_reduce_phase,
    zero3_fp32_head_phase,
)
from autotune.memory.sequence_parallel import (
    local_view as sp_local_view,
)
from autotune.memory.tensor_parallel import local_view, sharded_head, zero3_largest_group, zero3_world_gathered
from autotune.memory.traced import trace
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig


def layout(model: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> Layout:
    """`cfg`'s layout on `cluster` (memory/layout.py), worked out once per estimate before the local view."""
    return Layout.of(model, cluster, cfg, zero3_largest_group=zero3_largest_group(model, cfg))


def estimate(model: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> MemoryEstimate:
    """Peak bytes per GPU of one training step of `model` under `cfg` on `cluster`.

    The builtin model's activations are the analytic terms of activations.py; any other code's
    (`model.implementation` hf or factory) are traced from the module itself on fake tensors
    (traced.trace via code_trace.py; the small programs are cached, so a second config of the same
    model, precision, attention, sequence length and micro batch costs milliseconds)."""
    # autotp_size > 1: one tp rank's shard, ZeRO over dp (memory/tensor_parallel.py); sequence_parallel_size > 1:
    # the whole model at seq / sp tokens, ZeRO over the world (memory/sequence_parallel.py; tp and sp are not
    # combined, autotune/parallel.py). The host side counts every rank of a node (no offload with either), the
    # report the whole model's parameters
    lay = layout(model, cluster, cfg)
    shard, dp, local = local_view(*sp_local_view(model, cluster, cfg))
    if builtin(shard):
        phases = _phases(shard, dp, local, lay)
    else:
        phases = trace(shard, dp, local, lay).phases
    phases = sharded_head(model, cfg, phases)
    if held := zero3_world_gathered(model, cluster, cfg):
        phases = {
            name: terms if name == "optimizer" else {**terms, "tp_replicated_gathered": held}
            for name, terms in phases.items()
        }
    for name, extra in all_to_all_terms(model, cfg).items():  # Ulysses' all-to-alls (memory/sequence_parallel.py)
        if name in phases:
            phases = {**phases, name: {**phases[name], **extra}}
    phases = zero3_fp32_head_phase(model, cfg, phases)
    phases = zero1_fp32_reduce_phase(shard, dp, cfg, lay, phases)  # ZeRO-1's fp32 reduction under Ulysses
    # gloo's all-gather after stages 1-2's update (CPU ranks; memory/buffers.py gloo_allgather_bytes)
    phases = allgather_phase(shard, dp, local, trainable_params(shard, local), phases)
    totals = {name: sum(t.values()) for name, t in phases.items()}
    peak_phase = max(totals, key=totals.get)
    peak = totals[peak_phase]
    over = overhead_terms(cluster, peak)
    host = host_bytes_per_node(shard, cluster, local)
    return MemoryEstimate(
        num_params=model.num_params,
        tensor_peak_bytes=peak,
        overhead_bytes=sum(over.values()),
        capacity_bytes=cluster.capacity_bytes,
        phase=peak_phase,
        terms=phases[peak_phase],
        overhead=over,
        phases=totals,
        host_bytes=host,
        host_capacity_bytes=cluster.gpu.host_memory_bytes,
    )
