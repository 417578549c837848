"""Host (CPU) memory per node: what ZeRO-Offload and ZeRO-Infinity put there, against the node's RAM.

A GPU candidate whose offloaded states need more host RAM than its node has is pruned like one that
does not fit its GPU. On CPU ranks the device is the host: offloaded tensors stay in the same memory
the profiler measures (measured: offload_param cpu at stage 3 gives the same peak to ~1 KB as without
it, tests/test_knobs.py), so they are priced there and not here.
"""

from __future__ import annotations

from autotune.hardware import Cluster
from autotune.memory.model_states import adam_state_bytes, master_bytes, offload_buffers
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig, dtype_bytes
from autotune.units import GiB

RUNTIME_BYTES_PER_RANK = GiB // 4
"""Python, torch, DeepSpeed and NCCL resident per rank process (measured on CPU: psutil rss after
`import torch, deepspeed` ~0.25 GiB; autotune/trial/launch.py RSS_ALLOWANCE_BYTES)."""


def host_terms_per_rank(model: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> dict[str, int]:
    """Host bytes one rank holds, by term (GPU clusters; empty on CPU ranks)."""
    if cluster.gpu.is_cpu:
        return {}
    share = model.num_params / (cluster.world_size if cfg.zero_stage >= 1 else 1)
    out = {"runtime": RUNTIME_BYTES_PER_RANK}
    if cfg.offload_param != "none":
        # stage3.py _create_param_groups_fp16_flat_cpu_memory: the 16-bit partition, pinned
        out["offloaded_parameters"] = int(dtype_bytes(cfg.precision) * share)
    if cfg.offload_optimizer:
        # DeepSpeedCPUAdam on the fp32 partition (master), its moments, and the fp32 gradient
        # partition it steps from (stage_1_and_2.py initialize_optimizer_states keeps
        # single_partition_of_fp32_groups[i].grad pinned when cpu_offload; stage3.py likewise)
        out["offloaded_master_weights"] = int(master_bytes(cfg) * share)
        out["offloaded_optimizer_states"] = int(adam_state_bytes(cfg) * share)
        out["offloaded_fp32_gradients"] = int(master_bytes(cfg) * share)
        out.update(offload_buffers(model, cluster, cfg)[1])
    return out


def host_bytes_per_node(model: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """Host bytes of one node: every rank on it holds its own terms."""
    return cluster.gpus_per_node * sum(host_terms_per_rank(model, cluster, cfg).values())
