"""Op-level compute pricing: trace the step that runs, price each op on a roofline of its class.

`trace.op_profile(build, loss, ...)` runs ONE forward+backward of a few-layer copy of the model
on fake tensors (FakeTensorMode: shapes, no data) under a TorchDispatchMode that records every
kernel-launching op: its class, FLOPs (torch.utils.flop_counter's formulas), bytes read and
written, and the shape a roofline needs. Two copies (1 and 2 blocks) give the ops of one block and of the rest
(embedding, head, loss); a model of L blocks is the rest + L x one block, as the memory model's
traced tier extrapolates (autotune/memory/traced.py). `price(profile, gpu, precision)` prices each
distinct op once and multiplies by its count (seconds per class). Both are cached per
(model, implementation, precision, attention, micro batch, seq len) and per GPU, so a search
re-traces only when one of those changes. docs/costmodel.md ("Op-level compute") lists the sources.
The tracer is autotune/costops/trace.py, which imports torch; this module does not, so a run
that finds every profile in the trace cache (autotune/trace_cache.py) never loads torch for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache

from autotune.costops.ops import Op, OpProfile
from autotune.hardware import GpuSpec
from autotune.models import ModelSpec


# ---- the code priced: through the model-code seam (autotune/impl/) -------------------------
@cache
def profile_for(
    spec: ModelSpec, implementation: str, precision: str, attention: str, micro_batch: int, seq_len: int, depth: int = 0
) -> OpProfile:
    """The cached op profile of one (model, implementation, precision, attention, micro batch, seq
    len). `implementation`: whose code is priced, as ModelSpec.implementation names it (builtin:
    autotune's stand-in; hf: transformers' own modeling code; factory: the user's module), built
    and run through the same seam trials and the memory model use. The profile of transformers'
    code and of the stand-in is also kept on disk between runs, beside the memory traces
    (autotune/trace_cache.py: under a fingerprint of the libraries and TRACE_FORMAT); a user's
    module is not, as its file can change between runs."""
    from autotune import trace_cache
    from autotune.impl import impl_for
    from autotune.memory.code_trace import spec_key

    kept = implementation in ("hf", "builtin")
    key = ("op_profile", spec_key(spec), implementation, precision, attention, micro_batch, seq_len, depth)
    stored = trace_cache.load(key) if kept else None
    if stored is not None:
        return OpProfile.from_json(stored)
    from autotune.costops.trace import op_profile
    from autotune.train_config import torch_dtype

    impl = impl_for(replace(spec, implementation=implementation))
    dtype = torch_dtype(precision)
    # flash_attention_2 has no CPU kernel to trace: its ops are sdpa's flash path's
    traced_attention = "sdpa" if attention == "flash_attention_2" else attention

    def build(num_layers: int):
        return impl.build(spec, dtype=dtype, attention=traced_attention, num_layers=num_layers)

    profile = op_profile(
        build,
        impl.loss,
        micro_batch=micro_batch,
        seq_len=seq_len,
        vocab=spec.vocab_size,
        heads=spec.num_heads,
        depth=depth,
        uniform=spec.uniform_blocks,
    )
    if kept:
        trace_cache.store(key, profile.to_json())
    return profile


# ---- pricing ---------------------------------------------------------------------------------
SMS = {
    "V100-32GB": 80,
    "V100-16GB": 80,
    "T4": 40,
    "A100-80GB": 108,
    "A100-40GB": 108,
    "H100-80GB": 132,
    "H200": 132,
    "RTX4090": 128,
    "L40S": 142,
}
"""Streaming multiprocessors, the waves a GEMM's tiles run in: NVIDIA Volta (V100 80), Turing (T4 40),
Ampere (A100 108), Hopper (H100/H200 SXM 132), Ada (RTX 4090 128, L40S 142) architecture whitepapers."""

GEMM_TILES = ((256, 128), (128, 256), (128, 128))
"""Output tiles cuBLAS picks among for large 16-bit GEMMs; a GEMM pays for whole tiles (tile
quantization) and whole waves of SMs (wave quantization): NVIDIA, "Matrix Multiplication
Background User's Guide", sec. "Dimension Quantization Effects" (its A100 example: 256x128 tiles,
108 SMs). The best of these is taken, as cuBLAS' heuristics pick per shape."""

GEMM_K_FILL = 128
"""K-elements of a GEMM's main loop a tile spends filling its pipeline before the first MMA: a
multistage kernel loads (stages - 1) K-blocks ahead (CUTLASS sm80 16-bit defaults: 3 stages of
BK = 64, include/cutlass/gemm/device/default_gemm_configuration.h). Each output tile pays it once,
so the efficiency of a GEMM of depth K is K / (K + 128) of a deep one's: why small-K GEMMs (a
1280-wide model's projections) run below the best shape a benchmark sweep finds."""

LAUNCH_S = 4e-6
"""GPU time a kernel costs beyond its roofline, back to back on a stream: launch latency and the
ramp up/down of an under-filled GPU. NVIDIA developer blog, "Getting Started with CUDA Graphs"
(2019): 3.8 us per 2.9 us kernel launched back to back without graphs, ~1 us of it launch; a
short kernel's own floor makes up the rest. Charged once per traced kernel."""

H100_FA2_FWD_BWD = 335.0 / 989.0
"""FlashAttention-2's forward+backward on H100 SXM: "up to 335 TFLOPs/s" (Dao 2023, FlashAttention-2,
arXiv:2307.08691, sec. 4.1, Fig. 7: the A100 kernel run unchanged on H100) over the H100's 989 TFLOPS
dense bf16 peak (data/gpus.yaml), FLOPs counted as forward + 2.5 x forward."""

FLASH_EFFICIENCY = {"A100": (0.73, 0.63), "H100": (0.35, 2.5 / (3.5 / H100_FA2_FWD_BWD - 1 / 0.35))}
"""(forward, backward) fraction of the 16-bit dense peak a FlashAttention-2 kernel reaches at long
sequences, head dim 128. A100: "up to 73% of the theoretical max throughput in the forward pass,
and up to 63% in the backward pass" (Dao 2023, "FlashAttention-2", arXiv:2307.08691, sec. 4.1:
a published kernel benchmark, attention alone, not a training-throughput table). H100 forward: "only
35% utilization" for FlashAttention-2 on H100 (Shah et al. 2024, "FlashAttention-3", arXiv:2407.08608,
abstract); backward 0.334, what makes forward + 2.5 x forward at (0.35, b) the 33.9% forward+backward
that FlashAttention-2 measured on H100 (H100_FA2_FWD_BWD). PyTorch's sdpa runs FlashAttention-2 for
16-bit inputs on sm80+. Other GPUs take the row of their generation (Hopper: H100; the rest: A100)."""

ATTENTION_KERNELS = {"flash2": (1.0, 1.0), "triton": (1.4, 2.0)}
"""(forward, backward) time of a flash-attention kernel relative to FlashAttention-2's (FLASH_EFFICIENCY).
flash2: FlashAttention-2 itself (flash-attn >= 2; PyTorch's sdpa flash path since torch 2.2). triton:
FlashAttention in Triton (flash-attn's flash_attn_triton.py, which llm-foundry copied as its
`attn_impl: triton`): "FlashAttention-2 is around 1.3-1.5x faster than FlashAttention in Triton in the
forward pass and around 2x faster in the backward pass" (Dao 2023, FlashAttention-2, arXiv:2307.08691,
sec. 4.1, A100); 1.4 is the middle of the stated forward range. Applied to every GPU (measured on A100
only). The kernel is a fact of the framework that ran, not of the GPU: Runtime.attention_kernel."""

EFFICIENT_KERNEL_SCALE = 0.5
"""sdpa's memory-efficient kernel (xformers cutlass; what sdpa runs below sm80 or in fp32):
FlashAttention-2 is "around 2x faster" than FlashAttention-1 and xformers (Dao 2023, sec. 4.1, Fig. 4)."""

ATTENTION_BLOCK = 128
"""Query/key block of the flash kernels (FlashAttention-2 sec. 3: 128 x 128 for head dim 128).
Under a causal mask the diagonal blocks are computed whole but half used: useful / computed =
s / (s + block)."""

SOFTMAX_OPS_PER_SCORE = 8.0
"""Non-matmul work per score element in a flash kernel, in FP32-op equivalents: scale, max,
subtract, sum, rescale (5) and exp on the SFU at a quarter of the FP32 rate (counted 4; NVIDIA CUDA C
Programming Guide, "Arithmetic Instructions" throughput table, sm80: 64 FP32 / 16 SFU results per
clock per SM), less the max/sub fused into one (-1). FlashAttention-2 sec. 3.1: non-matmul FLOPs cost
~16x matmul FLOPs on A100. Sets how efficiency falls with smaller head dimension."""


def gpu_key(gpu: GpuSpec, precision: str, *, hbm_bytes_s: float, gemm_efficiency: float) -> tuple:
    """Hashable view of a GpuSpec for the price cache (GpuSpec holds a dict): name, peak for the
    precision, FP32 peak, achieved HBM bytes/s, sm80+ (bf16), measured large-GEMM efficiency. The
    cost model supplies the last two (autotune.costmodel.hbm_bytes_per_s, .gemm_efficiency)."""
    return (gpu.name, gpu.peak_flops(precision), gpu.peak_flops("fp32"), hbm_bytes_s, gpu.bf16, gemm_efficiency)


def _hbm(key: tuple) -> float:
    return key[3]


def gemm_efficiency(key: tuple, batch: int, m: int, n: int, k: int) -> float:
    """Fraction of the peak one GEMM reaches: the measured large-GEMM efficiency (key[5]: MAMF,
    autotune.costmodel.gemm_efficiency) x the best tile's tile and wave quantization (GEMM_TILES) x
    the pipeline fill of its depth (GEMM_K_FILL)."""
    e = key[5] * k / (k + GEMM_K_FILL)
    sms = SMS.get(key[0])
    if not sms:
        return e
    best = 0.0
    for tm, tn in GEMM_TILES:
        tiles = batch * math.ceil(m / tm) * math.ceil(n / tn)
        waves = math.ceil(tiles / sms)
        best = max(best, batch * m * n / (tiles * tm * tn) * tiles / (waves * sms))
    return e * best


def gemm_s(op: Op, key: tuple, sustained: float) -> float:
    """One GEMM kernel (seconds): max(FLOPs / (peak x efficiency x sustained), bytes / achieved HBM)
    + launch (roofline: Williams, Waterman & Patterson 2009, CACM 52(4)). `sustained`: the fitted
    share of a benchmark's efficiency a training step keeps (autotune.costmodel.Constants)."""
    batch, m, k, n = op.shape
    compute = op.flops / (key[1] * gemm_efficiency(key, batch, m, n, k) * sustained)
    return max(compute, op.nbytes / _hbm(key)) + LAUNCH_S


def attention_efficiency(key: tuple, phase: str, head_dim: int, s_kv: int, causal: bool) -> float:
    """Fraction of the 16-bit peak an sdpa kernel reaches (FLASH_EFFICIENCY at head dim 128, the
    softmax share for other head dims, the causal diagonal's waste, the efficient kernel's scale)."""
    name = key[0]
    gen = "H100" if name.startswith(("H100", "H200", "GH200")) else "A100"
    e = FLASH_EFFICIENCY[gen][0 if phase == "fwd" else 1]
    ratio = key[1] / key[2] if key[2] else 16.0  # matmul / FP32 throughput

    def mm_share(d: int) -> float:
        return 4 * d / (4 * d + SOFTMAX_OPS_PER_SCORE * ratio)

    e *= mm_share(head_dim) / mm_share(128)
    if causal:
        e *= s_kv / (s_kv + ATTENTION_BLOCK)
    flash = key[4] and key[1] != key[2]  # sm80+ (bf16-capable) and a 16-bit precision
    return e if flash else e * EFFICIENT_KERNEL_SCALE


def attention_s(op: Op, key: tuple, sustained: float, kernel: str = "flash2") -> float:
    """One sdpa kernel (seconds). FLOPs as the flash kernels count their own speed: 4 b h s_q s_kv d
    forward, halved under a causal mask, backward 2.5x forward (Dao-AILab/flash-attention
    benchmarks/benchmark_flash_attention.py `flops`); bytes at achieved HBM as the floor. `kernel`:
    which flash kernel runs (ATTENTION_KERNELS).

    `sustained` is not applied. FLASH_EFFICIENCY is the kernel benchmarked at a training step's own
    shapes (FlashAttention-2 sec. 4.1: 16k tokens per batch, hidden 2048, head dim 128: MPT-1B's
    attention), so it already is what a step gets; `sustained` is the share of MAMF, a maximum over
    a sweep of GEMM shapes, that a step's GEMMs keep (docs/measurements/costmodel.md)."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention kernel {kernel!r}: one of {', '.join(ATTENTION_KERNELS)}")
    b, h, s_q, s_kv, d, causal = op.shape
    fwd = 4.0 * b * h * s_q * s_kv * d / (2 if causal else 1)
    flops = fwd if op.phase == "fwd" else 2.5 * fwd
    slower = ATTENTION_KERNELS[kernel][0 if op.phase == "fwd" else 1]
    peak = key[1]
    return (
        max(flops * slower / (peak * attention_efficiency(key, op.phase, d, s_kv, causal)), op.nbytes / _hbm(key))
        + LAUNCH_S
    )


def elementwise_s(op: Op, key: tuple, sustained: float) -> float:
    """An element-wise or reduction kernel (seconds): bytes read+written at achieved HBM + launch."""
    return op.nbytes / _hbm(key) + LAUNCH_S


OP_PRICE = {"gemm": gemm_s, "attention": attention_s, "elementwise": elementwise_s}


@dataclass(frozen=True)
class ComputePrice:
    """Seconds of one micro step's forward+backward by term (an op's class; eager attention's GEMMs
    and score kernels under attention), and a block's forward alone."""

    gemm: float
    attention: float
    elementwise: float
    layer_forward: float
    """One block's forward: what a checkpointed block reruns in backward."""
    kernels: int


def op_s(op: Op, key: tuple, sustained: float = 1.0, attention_kernel: str = "flash2") -> float:
    """Seconds of one op on the GPU `key`, by its class (OP_PRICE; attention with the flash kernel run)."""
    if op.cls == "attention":
        return attention_s(op, key, sustained, attention_kernel)
    return OP_PRICE[op.cls](op, key, sustained)


@cache
def price(
    profile: OpProfile, num_layers: int, key: tuple, sustained: float = 1.0, attention_kernel: str = "flash2"
) -> ComputePrice:
    """Price every distinct op once, times its count (cached per profile, depth, GPU, sustained,
    attention kernel)."""

    def cost(op: Op) -> float:
        return op_s(op, key, sustained, attention_kernel)

    per = {"gemm": 0.0, "attention": 0.0, "elementwise": 0.0}
    ops = profile.ops(num_layers)
    for op, n in ops.items():  # priced by class, reported by term (eager attention under attention)
        per[op.term or op.cls] += n * cost(op)
    fwd = sum(n * cost(op) for op, n in profile.layer if op.phase == "fwd")
    kernels = sum(ops.values())
    return ComputePrice(
        gemm=per["gemm"], attention=per["attention"], elementwise=per["elementwise"], layer_forward=fwd, kernels=kernels
    )


def _profile(
    spec: ModelSpec, implementation: str, precision: str, attention: str, micro_batch: int, seq_len: int
) -> OpProfile:
    # the profile is per block: its cache key leaves the depth out, but for the whole-depth trace of a
    # model whose blocks differ (trace.op_profile), which needs it
    return profile_for(
        replace(spec, num_layers=1), implementation, precision, attention, micro_batch, seq_len, spec.num_layers
    )


def micro_step_price(
    spec: ModelSpec,
    implementation: str,
    precision: str,
    attention: str,
    micro_batch: int,
    seq_len: int,
    key: tuple,
    sustained: float = 1.0,
    attention_kernel: str = "flash2",
) -> ComputePrice:
    """Forward+backward of one micro step of `spec` on the GPU `key` (gpu_key), op by op (cached);
    `attention_kernel`: the flash kernel the framework runs (ATTENTION_KERNELS)."""
    profile = _profile(spec, implementation, precision, attention, micro_batch, seq_len)
    return price(profile, spec.num_layers, key, sustained, attention_kernel)


@cache
def step_flops(
    spec: ModelSpec, implementation: str, precision: str, attention: str, micro_batch: int, seq_len: int
) -> float:
    """FLOPs one micro step's GEMMs and attention kernels run, forward and backward, as traced (no
    recompute; element-wise ops count none): what the code runs, whatever the GPU. Cached: a report
    asks it for each of a study's tens of thousands of candidates, of a few shapes."""
    profile = _profile(spec, implementation, precision, attention, micro_batch, seq_len)
    return sum(n * op.flops for op, n in profile.ops(spec.num_layers).items())
