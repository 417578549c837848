"""DeepSpeed's communication buffers, in bytes. Sizes come from the config autotune writes
(autotune/deepspeed_config.py) and DeepSpeed 0.19.8's code paths named in each docstring."""

from __future__ import annotations

from autotune.deepspeed_config import bucket_sizes
from autotune.hardware import Cluster
from autotune.models import ModelSpec
from autotune.space import TrainConfig

STAGE0_ALLREDUCE_ELEMENTS = 500_000_000
"""engine.allreduce_gradients -> buffered_allreduce_fallback(elements_per_buffer=500000000):
gradients are flattened into one buffer per 5e8 elements before the all-reduce."""


def backward_buffers(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """Buffers live at the end of backward, when gradients are reduced.

    - Stage 0 (world > 1): the flattened copy of the gradients being all-reduced.
    - Stages 1-2: the contiguous-gradients bucket `ipg_buffer` (reduce_bucket_size elements in
      the model dtype; stage_1_and_2.py, reduce_gradients / backward_prologue; one bucket because
      autotune sets overlap_comm false).
    - Stage 3: the parameter prefetch bucket (stage3_prefetch_bucket_size); its reduce bucket is
      held for the whole run (model_states.states).
    """
    pb = 4 if cfg.precision == "fp32" else 2
    b = bucket_sizes(spec)
    if cfg.zero_stage == 0:
        return pb * min(spec.num_params, STAGE0_ALLREDUCE_ELEMENTS) if cluster.world_size > 1 else 0
    if cfg.zero_stage in (1, 2):
        return pb * b["reduce_bucket_size"]
    return pb * b["stage3_prefetch_bucket_size"]


def accumulated_gradients(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """Gradients carried from one micro batch to the next when grad_accum > 1: the full gradients
    at stage 0, the reduced partition at stages 1-2 (stage 3's buffer is always held)."""
    if cfg.grad_accum == 1 or cfg.zero_stage == 3:
        return 0
    pb = 4 if cfg.precision == "fp32" else 2
    return pb * spec.num_params // (1 if cfg.zero_stage == 0 else cluster.world_size)


def backward_gradients(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """Gradients alive at the end of backward (before the step converts them)."""
    pb = 4 if cfg.precision == "fp32" else 2
    if cfg.zero_stage == 0:
        return pb * spec.num_params
    if cfg.zero_stage in (1, 2):
        return pb * spec.num_params // cluster.world_size
    return 0
