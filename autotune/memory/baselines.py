"""Other people's memory rules, priced on the same cases as ours (for tests and benchmarks).

- The reference article behind the project (a Chinese-language guide to LLM training memory, sec. 1.1-1.2): static memory
  18 bytes/param (fp32 master 4 + bf16 copy 2 + fp32 grads 4 + Adam 4 + 4), activations
  b*s*h*L*c with c "usually 10 to 20" (its example uses 15), checkpointing cutting activations
  to about 1/sqrt(L); for ZeRO it divides the static memory by the GPU count (sec. 4.1:
  13B x 18 / 4 GPUs = 58.5 GB per GPU under ZeRO-2).
- DeepSpeed's own estimators (model states only, no activations):
  deepspeed/runtime/zero/stage_1_and_2.py estimate_zero2_model_states_mem_needs (no offload:
  2P + 18P/N) and stage3.py estimate_zero3_model_states_mem_needs (no offload: 4*largest_layer +
  18P/N). We call DeepSpeed's functions themselves, not copies.
"""

from __future__ import annotations

import math

from autotune.hardware import Cluster
from autotune.memory.model_states import largest_param
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig

ARTICLE_BYTES_PER_PARAM = 18
ARTICLE_ACTIVATION_COEFF = 15


def article_static_bytes(num_params: float, num_gpus: int = 1, zero_stage: int = 0) -> float:
    """18 bytes/param, divided by the GPU count under any ZeRO stage (the article's rule)."""
    return ARTICLE_BYTES_PER_PARAM * num_params / (num_gpus if zero_stage >= 1 else 1)


def article_bytes(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> float:
    """The article's whole rule: static + b*s*h*L*15, checkpointed layers cut by 1/sqrt(L)."""
    per_layer = cfg.micro_batch * cfg.seq_len * spec.hidden_size * ARTICLE_ACTIVATION_COEFF
    L = spec.num_layers
    acts = per_layer * ((L - cfg.ckpt_layers) + cfg.ckpt_layers / math.sqrt(L))
    return article_static_bytes(spec.num_params, cluster.world_size, cfg.zero_stage) + acts


def deepspeed_estimator_bytes(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """DeepSpeed's model-state estimate per GPU (no offload). Stage 0 has none of its own; the
    stage-2 formula with one GPU (2P + 18P) is what it would give."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    if cfg.zero_stage == 3:
        _, gpu, _ = estimate_zero3_model_states_mem_needs(
            spec.num_params,
            largest_param(spec),
            num_gpus_per_node=cluster.gpus_per_node,
            num_nodes=cluster.num_nodes,
            cpu_offload=cfg.offload_optimizer,
            cpu_offload_params=False,
        )
        return gpu
    gpus = 1 if cfg.zero_stage == 0 else cluster.gpus_per_node
    nodes = 1 if cfg.zero_stage == 0 else cluster.num_nodes
    _, gpu = estimate_zero2_model_states_mem_needs(
        spec.num_params, num_gpus_per_node=gpus, num_nodes=nodes, cpu_offload=cfg.offload_optimizer
    )
    return gpu
