"""Framework overhead on a GPU: memory the process holds that no tensor accounts for. Reported
apart from the tensor peak; torch.cuda.max_memory_allocated never sees it.

These are allowances with their sources, not measurements of ours: the CPU trials here cannot
see them (no CUDA context, no caching allocator). They are the first numbers to re-measure on a
GPU (`autotune trial` reports max_memory_reserved beside the allocated peak for that purpose).
"""

from __future__ import annotations

from autotune.hardware import Cluster
from autotune.units import MiB

CUDA_CONTEXT_BYTES = 500 * MiB
"""CUDA context + PyTorch's kernels loaded at first use: 300-600 MiB on A100/H100 with CUDA 12
lazy loading (CUDA_MODULE_LOADING=LAZY, default since CUDA 11.7; NVIDIA CUDA C Programming Guide,
"Lazy Loading"); 500 MiB taken as the allowance."""
CUBLAS_WORKSPACE_BYTES = 32 * MiB
"""cuBLAS workspace per handle: PyTorch allocates 32 MiB on Hopper, 4 MiB + 8 x 16 KiB elsewhere
(aten/src/ATen/cuda/CublasHandlePool.cpp, getChosenWorkspaceSize); 32 MiB covers both."""
NCCL_BYTES = 256 * MiB
"""NCCL communicator buffers: NCCL_BUFFSIZE 4 MiB per channel and peer direction (NCCL docs,
Environment Variables); ~256 MiB for a ring/tree communicator of 8 GPUs with the default channels."""
FRAGMENTATION_FRACTION = 0.05
"""Caching-allocator fragmentation, reserved minus allocated at the peak, as a fraction of the
tensor peak: 2-10% reported for LLM training with expandable segments off (PyTorch CUDA
memory docs, "Optimizing memory usage with PYTORCH_CUDA_ALLOC_CONF"); 5% taken."""


def overhead_terms(cluster: Cluster, tensor_peak_bytes: int) -> dict[str, int]:
    """The allowance by term; empty on CPU ranks, whose cap applies to tensor bytes only."""
    if cluster.gpu.is_cpu:
        return {}
    out = {
        "cuda_context": CUDA_CONTEXT_BYTES,
        "cublas_workspace": CUBLAS_WORKSPACE_BYTES,
        "allocator_fragmentation": int(FRAGMENTATION_FRACTION * tensor_peak_bytes),
    }
    if cluster.world_size > 1:
        out["nccl_buffers"] = NCCL_BYTES
    return out
