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
"""Settings that trade device memory (or numerics) for time: candidates that differ only in them form
one group, and a group runs only its first member in `speed_order` that fits (Plan), so they do not
multiply the trials."""


def speed_order(model: ModelSpec) -> Callable[[Any], tuple]:
    """The order a group is tried in, the first that fits runs:
    - the model-dtype gradient accumulation before fp32 (fp32 only costs memory and conversions; a
      numerical choice to make by leaving `auto` out of the space);
    - no offload (PCIe and CPU Adam every step: ZeRO-Offload, ZeRO-Infinity), then fewer checkpointed
      layers (each recomputes a layer's forward);
    - then fp32 optimizer states and master weights before bf16 ones: a space that lists
      `bf16_optimizer_states: [false, true]` accepts bf16 states, so they run where they save an
      offload or recomputation (13B on 4 x A100 at ZeRO-3, micro batch 2: no checkpointed layer with
      them, 20 without; 15% faster by the cost model), and not where fp32 states fit as fast; the
      report flags them as a stability risk;
    - then overlap_comm (collectives hidden behind backward), larger reduce/allgather buckets (fewer,
      longer collectives), a larger hpZ partition (more of the gather on NVLink) and ZeRO++'s
      quantized collectives (fewer bytes at the same memory; the ZeRO++ paper, arXiv:2306.10209
      sec. 5, reports no loss in convergence; leave `false` out of the space to insist on it), and a
      larger stage-3 persistence threshold (small parameters kept whole: fewer, smaller gathers), a
      larger stage-3 max_live (more of the gathers prefetched: costmodel.stage3_prefetched) and prefetch
      bucket (a deeper queue of gathers in flight: not priced, the judgement of DeepSpeed's own default
      of 5e7 over Hugging Face's 0.9 h^2).
    The order is a judgement from the cost model's terms, not measured."""
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
