"""The order a search tries the members of a group in (`speed_order`) and which settings make a group
(`MEMORY_FOR_SPEED`): candidates that differ only in settings that trade device memory (or numerics)
for time run once per group, the first member that fits (search.Plan)."""

from __future__ import annotations

from typing import Any, Callable

from autotune.models import ModelSpec
from autotune.train_config import TrainConfig

MEMORY_FOR_SPEED = {
    "ckpt_layers": 0,
    "offload_param": "none",
    "offload_optimizer": False,
    "overlap_comm": False,
    "reduce_bucket_size": 0,
    "allgather_bucket_size": 0,
    "zero_hpz_partition_size": 1,
    "grad_accum_dtype": "auto",
    "bf16_master_weights_and_grads": False,
    "bf16_optimizer_states": False,
    "zero_quantized_weights": False,
    "zero_quantized_gradients": False,
    "stage3_param_persistence_threshold": 0,
    "stage3_prefetch_bucket_size": 0,
    "stage3_max_live_parameters": 0,
}
"""Their defaults: a group's key is a config with these reset (loop.Candidate.group)."""


def speed_order(model: ModelSpec) -> Callable[[Any], tuple]:
    """The order a group is tried in; the first that fits runs. A judgement from the cost model's terms, not
    measured: the model-dtype gradient accumulation before fp32 (fp32 only costs memory); no offload (PCIe and
    CPU Adam every step), then fewer checkpointed layers (each recomputes a layer's forward); fp32 optimizer
    states and master weights before bf16 ones, so bf16 states run only where they save an offload or a
    recomputation (13B on 4 x A100, ZeRO-3, micro batch 2: no checkpointed layer with them, 20 without, 15%
    faster by the cost model; the report flags them); then overlap_comm, larger buckets, a larger hpZ
    partition, ZeRO++'s quantized collectives (no loss in convergence: arXiv:2306.10209 sec. 5), a larger
    stage-3 persistence threshold, max_live (costmodel.stage3_prefetched) and prefetch bucket (not priced:
    DeepSpeed's default 5e7 over Hugging Face's 0.9 h^2)."""
    from autotune.deepspeed_config import bucket_sizes

    def key(c: Any) -> tuple:  # a search.Candidate
        cfg, b = c.cfg, bucket_sizes(model, c.cfg)
        return (
            cfg.grad_accum_dtype != "auto",
            cfg.offload_param != "none",
            cfg.offload_optimizer,
            cfg.ckpt_layers,
            cfg.bf16_optimizer_states,
            cfg.bf16_master_weights_and_grads,
            not cfg.overlap_comm,
            -b["reduce_bucket_size"],
            -b["allgather_bucket_size"],
            -cfg.zero_hpz_partition_size,
            not cfg.zero_quantized_weights,
            not cfg.zero_quantized_gradients,
            -b["stage3_param_persistence_threshold"],
            -b["stage3_max_live_parameters"],
            -b["stage3_prefetch_bucket_size"],
        )

    return key


def same_but_k(a: TrainConfig, b: TrainConfig) -> bool:
    return {**a.to_dict(), "ckpt_layers": 0} == {**b.to_dict(), "ckpt_layers": 0}


def memory_diff(ran: TrainConfig, other: TrainConfig) -> str:
    """`overlap_comm True vs False, ...`: the MEMORY_FOR_SPEED settings in which two configs differ."""
    return ", ".join(
        f"{n} {getattr(ran, n)} vs {getattr(other, n)}"
        for n in MEMORY_FOR_SPEED
        if getattr(ran, n) != getattr(other, n)
    )
