"""How DeepSpeed lays one configuration out on the ranks: ZeRO's bucket sizes, the parallel degrees and, for an
AutoTP shard at ZeRO-3, its largest flat group. Worked out once per estimate (memory/__init__.layout, before
local_view) and passed to the terms that read it, so that none of them re-derives it."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.deepspeed_config import bucket_sizes
from autotune.hardware import Cluster
from autotune.models import ModelSpec
from autotune.parallel import data_parallel_size
from autotune.train_config import TrainConfig


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One configuration's layout. The bucket sizes are in elements, as the DeepSpeed JSON writes them
    (deepspeed_config.bucket_sizes, the one definition)."""

    reduce_bucket_size: int
    allgather_bucket_size: int
    stage3_prefetch_bucket_size: int
    stage3_max_live_parameters: int
    stage3_max_reuse_distance: int
    stage3_param_persistence_threshold: int
    tp: int = 1
    sp: int = 1
    dp: int = 1
    """Ranks that see different batches: world / (tp x sp) (parallel.data_parallel_size)."""
    zero_ranks: int = 1
    """Ranks ZeRO shards over: world / tp (with Ulysses the sequence-data-parallel group, memory/sequence_parallel.py)."""
    zero3_largest_group: int | None = None
    """Elements of an AutoTP shard's larger ZeRO-3 flat group (memory/tensor_parallel.py zero3_largest_group);
    None: one group, the whole partition."""

    @classmethod
    def of(cls, model: ModelSpec, cluster: Cluster, cfg: TrainConfig, zero3_largest_group: int | None = None) -> Layout:
        """The layout of `cfg` on `cluster`: the buckets of (model, cfg) and the degrees of cfg."""
        tp, sp = cfg.autotp_size, cfg.sequence_parallel_size
        return cls(
            **bucket_sizes(model, cfg),
            tp=tp,
            sp=sp,
            dp=data_parallel_size(cfg, cluster.world_size),
            zero_ranks=cluster.world_size // tp,
            zero3_largest_group=zero3_largest_group,
        )
