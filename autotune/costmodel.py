"""Throughput cost model: seconds per optimizer step of a model on a cluster under a TrainConfig.

One pure function per time term; `simulate()` adds them up. Every constant says where it comes
from. One constant is fitted, globally, to the published points in data/calibration.yaml:
`Constants.elementwise_passes` (benchmarks/fit_costmodel.py; docs/costmodel.md). Times are
seconds, sizes bytes, bandwidths bytes per second inside (GB/s = 10^9 at the edge).

Per GPU, data parallel over all `world_size` ranks:

    step = grad_accum x (compute + recompute + ZeRO comm of a micro step, less what overlaps)
           + ZeRO comm of the step (less what overlaps) + optimizer step (or offload)
    compute = weight GEMMs and LM head + attention + element-wise ops + logits, fwd and bwd
"""

from __future__ import annotations

import dataclasses

from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources

import yaml

from autotune.errors import SpecError
from autotune.hardware import Cluster, GpuSpec
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig, dtype_bytes
from autotune.units import GB_PER_S, TFLOPS

HBM_EFFICIENCY = 0.83
"""Achieved / datasheet memory bandwidth: V100 measured 750 of 900 GB/s (Jia et al. 2018,
"Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", arXiv:1804.06826).
Applied to every GPU: an assumption, not a per-GPU measurement."""

COLLECTIVE_EFFICIENCY = 0.8
"""NCCL bus bandwidth / link bandwidth: nccl-tests all_reduce_perf (doc/PERFORMANCE.md defines
bus bandwidth) reaches ~230-240 GB/s on a DGX A100, of NVLink's 300 GB/s per direction."""

PCIE_GBPS = 25.0
"""Host<->GPU copies for ZeRO-Offload: PCIe 4.0 x16 is 31.5 GB/s per direction (PCI-SIG);
pinned copies reach ~80% of it (CUDA samples bandwidthTest)."""

CPU_ADAM_PARAMS_PER_S = 1e9 / 0.22
"""DeepSpeedCPUAdam: 1B parameters in 0.22 s on a DGX-2 host (Ren et al. 2021, "ZeRO-Offload",
USENIX ATC, Table 3). Per node, shared by the node's ranks."""

EAGER_SCORE_PASSES = 25.0
"""Reads+writes per s x s score element, forward and backward, of the eager
softmax(QK^T/sqrt(d))V (transformers' GPT2Attention._attn): forward QK^T write 1, scale 2,
causal mask 2.5, softmax 2, dropout 2.5, AV read 1; backward the mirror and saved outputs, 14.
sdpa (flash / memory-efficient) keeps no s x s matrix (Dao et al. 2022, FlashAttention, sec. 3)."""

GELU_PASSES = {"fused": 5.0, "composite": 46.0}
"""Reads+writes per MLP-activation element, forward and backward. fused (one kernel: torch's
F.gelu, as autotune's trial model): forward 2, backward 3. composite (HF GPT-2's gelu_new,
0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))) in eager ops): 8 ops forward (18), their backward
with the three-way gradient sum (28)."""

DROPOUT_PASSES = 10.0
"""Per hidden element, a block's two residual dropouts (p > 0): forward read, write, 1-byte mask;
backward read, mask, write: 2 x (2.5 + 2.5)."""

LOGIT_PASSES = 8.0
"""Per vocabulary logit per token: LM-head write, shift copy (2), log-softmax (2), its backward
(read 2, write 1), counted from transformers' causal-LM loss."""

ADAM_BYTES_PER_PARAM = {"fused": 28.0, "unfused": 88.0, "8bit": 16.0}
"""The Adam update itself. fused (DeepSpeed FusedAdam, multi-tensor): read p, g, m, v, write p, m,
v = 7 x 4. unfused (per-tensor torch ops: transformers.AdamW, Composer's DecoupledAdamW): mul_,
add_, mul_, addcmul_, sqrt, add_, addcdiv_, add_ read 14 and write 8 x 4. 8bit (bitsandbytes
AdamW8bit, one kernel): read p, g (4 + 4), m, v (1 + 1), write p (4), m, v (1 + 1)."""

MIXED_PRECISION_STEP_BYTES = 24.0
"""Around a 16-bit step, per parameter: gradient to fp32 (read 2, write 4), norm (read 4),
unscale/clip (read 4, write 4), master to 16-bit copy (read 4, write 2) (DeepSpeed
stage_1_and_2.py step(), fp16/fused_optimizer.py). fp32 training: norm and clip only, 12."""

UNFUSED_OPS_PER_TENSOR = 17
"""Kernels per tensor of an unfused 16-bit step (DeepSpeed fp16/unfused_optimizer.py): overflow
check (cast, sum, host read) 3, norm (cast, norm, host read) 3, cast 1, unscale 1, Adam 8, copy 1."""

OP_OVERHEAD_S = 10e-6
"""CPU cost of one eager PyTorch op (dispatch + launch), order 10 us (Horace He 2022, "Making Deep
Learning Go Brrrr From First Principles", "Overhead"). The per-tensor host reads serialise CPU
and GPU, so the unfused step pays it on top of its memory time."""


@dataclass(frozen=True, kw_only=True)
class Constants:
    """The fitted constant (benchmarks/fit_costmodel.py; docs/costmodel.md, "Calibration")."""

    elementwise_passes: float = 324.0
    """Hidden-sized element reads+writes per token per block, forward and backward, of the
    non-GEMM ops not counted elsewhere (norms, residuals, casts, copies, rotary). A hand count
    gives ~60; the fit, ~5x that, absorbs what a count misses: small-kernel bandwidth, autocast
    casts, allocator traffic. Ivanov et al. 2021 ("Data Movement Is All You Need", MLSys, Table 1)
    measure such ops at 39% of BERT-large's PyTorch training time on V100, at 0.2% of its FLOPs."""


@dataclass(frozen=True, kw_only=True)
class Runtime:
    """How the framework runs the step, where that changes the time and not what is searched."""

    overlap_comm: bool = False
    """Collectives on a side stream (DeepSpeed overlap_comm; FSDP always): hidden behind compute."""
    contiguous_gradients: bool = True
    """False: ZeRO-1/2 all-reduce each gradient bucket (stage_1_and_2.py reduce_ipg_grads ->
    buffered_reduce_fallback) instead of reducing each partition to its owner."""
    fused_optimizer: bool = True
    """DeepSpeed FusedAdam (multi-tensor) vs a per-tensor client optimizer."""
    optimizer_tensors: int | None = None
    """Tensors an unfused optimizer loops over; None: DeepSpeed's (every parameter tensor at ZeRO-0,
    the two flat partitions, with and without weight decay, at ZeRO >= 1)."""
    activation: str = "fused"
    """MLP activation: "fused" (one kernel; SwiGLU counted so) or "composite" (HF GPT-2's gelu_new)."""
    dropout: bool = False
    """Residual dropout with p > 0 (HF GPT-2's 0.1; autotune's trial model has none)."""
    source: str = "autotune.deepspeed_config.zero_section"


@dataclass(frozen=True, kw_only=True)
class SimulatedStep:
    """The cost model's answer for one optimizer step."""

    step_time_s: float
    samples_per_s: float
    """Global: sequences per second over all ranks."""
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    """Model TFLOPS per GPU (ModelSpec.flops_per_token: 6N + attention; recompute not counted)."""
    mfu: float
    """tflops_per_gpu over the GPU's dense peak for the precision (PaLM, Chowdhery et al. 2022, App. B)."""
    breakdown_s: dict[str, float] = field(default_factory=dict)
    """Seconds per step of each term (they sum to step_time_s): matmul, attention, elementwise,
    logits, recompute (forward+backward of all micro steps); grad_reduce, param_gather,
    stage3_gather (ZeRO communication); overlap (the communication hidden behind compute,
    negative); optimizer; offload."""
    source: str = "simulated"

    def to_json(self) -> dict:
        d = asdict(self)
        d["breakdown_s"] = {k: round(v, 6) for k, v in self.breakdown_s.items()}
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in d.items()}


# ---- compute ---------------------------------------------------------------------------------
@cache
def _calibration() -> dict:
    return yaml.safe_load(resources.files("autotune").joinpath("data/calibration.yaml").read_text())

def gemm_efficiency(gpu: GpuSpec) -> float:
    """Fraction of the datasheet peak a large GEMM reaches: measured per GPU where a measurement
    exists (data/calibration.yaml, `gemm_efficiency`), else that table's `default`."""
    table = _calibration()["gemm_efficiency"]
    return float(table.get(gpu.name, table["default"])["efficiency"])


def peak_flops(gpu: GpuSpec, precision: str) -> float:
    """Dense datasheet peak; fp32 is the plain FP32 peak (no TF32, see data/gpus.yaml)."""
    peak = gpu.peak_flops(precision)
    if not peak or not gpu.hbm_gbps:
        raise SpecError(f"the cost model needs {gpu.name}'s {precision} peak and memory bandwidth "
                        f"(CPU ranks are measured, not simulated)")
    return peak


def hbm_bytes_per_s(gpu: GpuSpec) -> float:
    return gpu.hbm_gbps * GB_PER_S * HBM_EFFICIENCY  # achieved, not datasheet


def gemm_time_s(m: int, k: int, n: int, gpu: GpuSpec, precision: str) -> float:
    """Forward and both backward GEMMs (dgrad, wgrad) of an (m x k) @ (k x n) product.

    Each does 2mkn FLOPs and moves mk + kn + mn elements (NVIDIA, "Matrix Multiplication
    Background User's Guide", arithmetic intensity). Compute and memory time add: the efficiency,
    E / (1 + E * peak / (intensity * bandwidth)), then rises smoothly with the matrix sizes and
    saturates at the measured E (roofline: Williams, Waterman & Patterson 2009, CACM 52(4))."""
    flops = 2.0 * m * k * n
    moved = (m * k + k * n + m * n) * dtype_bytes(precision)
    one = flops / (gemm_efficiency(gpu) * peak_flops(gpu, precision)) + moved / hbm_bytes_per_s(gpu)
    return 3.0 * one


def layer_gemm_shapes(model: ModelSpec) -> list[tuple[int, int]]:
    """(k, n) of each weight matrix of one block: QKV, attention output, MLP."""
    h, f = model.hidden_size, model.ffn_hidden_size
    mlp = [(h, f), (h, f), (f, h)] if model.mlp == "swiglu" else [(h, f), (f, h)]
    return [(h, model.q_dim + 2 * model.kv_dim), (model.q_dim, h), *mlp]


def layer_matmul_s(model: ModelSpec, tokens: int, gpu: GpuSpec, precision: str) -> float:
    """One block's weight GEMMs, forward and backward."""
    return sum(gemm_time_s(tokens, k, n, gpu, precision) for k, n in layer_gemm_shapes(model))


def layer_attention_s(model: ModelSpec, cfg: TrainConfig, gpu: GpuSpec) -> float:
    """QK^T and AV of one block, forward and backward: 12 s q_dim FLOPs per token (Kaplan et al.
    2020, Table 1, x3 for backward), plus the eager path's s x s score traffic."""
    tokens = cfg.tokens_per_micro_batch
    t = 12.0 * cfg.seq_len * model.q_dim * tokens / (gemm_efficiency(gpu) * peak_flops(gpu, cfg.precision))
    if cfg.attention == "eager":
        scores = tokens * model.num_heads * cfg.seq_len
        t += scores * EAGER_SCORE_PASSES * dtype_bytes(cfg.precision) / hbm_bytes_per_s(gpu)
    return t


def layer_elementwise_s(model: ModelSpec, cfg: TrainConfig, gpu: GpuSpec, rt: Runtime, c: Constants) -> float:
    """Memory-bound non-GEMM ops of one block, forward and backward: the fitted hidden-sized
    passes, the MLP activation over the FFN width, residual dropout if any."""
    per_token = model.hidden_size * (c.elementwise_passes + (DROPOUT_PASSES if rt.dropout else 0.0))
    per_token += model.ffn_hidden_size * GELU_PASSES[rt.activation]
    return cfg.tokens_per_micro_batch * per_token * dtype_bytes(cfg.precision) / hbm_bytes_per_s(gpu)


def logits_s(model: ModelSpec, cfg: TrainConfig, gpu: GpuSpec) -> float:
    """Softmax cross-entropy over the vocabulary, forward and backward (memory bound)."""
    moved = cfg.tokens_per_micro_batch * model.vocab_size * LOGIT_PASSES * dtype_bytes(cfg.precision)
    return moved / hbm_bytes_per_s(gpu)


def recompute_s(cfg: TrainConfig, layer_fwd_bwd_s: float) -> float:
    """Checkpointing reruns the forward of the k checkpointed blocks during backward. A forward is
    a third of forward+backward (backward = 2 x forward FLOPs; Narayanan et al. 2021, SC'21,
    sec. 5.1: a step with recomputation costs four forward passes)."""
    return cfg.ckpt_layers * layer_fwd_bwd_s / 3.0


# ---- communication ---------------------------------------------------------------------------
def link_bytes_per_s(cluster: Cluster) -> float:
    """Bus bandwidth of a ring collective per GPU. In a node, NVLink (or PCIe). Across nodes the
    slowest hop bounds a ring (Patarasuk & Yuan 2009); NCCL runs a ring per NIC, each carrying its
    share, so the node's NICs together (per-GPU NIC x GPUs per node) bound it, capped by NVLink."""
    gbps = cluster.gpu.intra_node_gbps
    if cluster.num_nodes > 1:
        gbps = min(gbps, cluster.gpu.inter_node_gbps * cluster.gpus_per_node)
    return gbps * GB_PER_S * COLLECTIVE_EFFICIENCY


def all_reduce_s(nbytes: float, cluster: Cluster) -> float:
    """Ring all-reduce: each rank sends 2(n-1)/n x bytes (Patarasuk & Yuan 2009, JPDC 69(2))."""
    n = cluster.world_size
    return 2.0 * (n - 1) / n * nbytes / link_bytes_per_s(cluster) if n > 1 else 0.0


def all_gather_s(nbytes: float, cluster: Cluster) -> float:
    """Ring all-gather, or reduce-scatter, of a tensor of `nbytes`: (n-1)/n x bytes."""
    n = cluster.world_size
    return (n - 1) / n * nbytes / link_bytes_per_s(cluster) if n > 1 else 0.0


def grad_reduce_s(model: ModelSpec, cfg: TrainConfig, cluster: Cluster, rt: Runtime) -> float:
    """One reduction of all gradients. ZeRO-0 all-reduces (2 Psi moved); ZeRO >= 1 reduce-scatters
    (Psi) (Rajbhandari et al. 2020, "ZeRO", sec. 7.2), unless ZeRO-1/2 falls back to all-reduce."""
    nbytes = model.num_params * dtype_bytes(cfg.precision)
    if cfg.zero_quantized_gradients:
        nbytes /= 4   # qgZ: int4 all-to-all, 1/4 of bf16 (ZeRO++ arXiv:2306.10209, sec. 3.3)
    if cfg.zero_stage == 0 or (cfg.zero_stage in (1, 2) and not rt.contiguous_gradients):
        return all_reduce_s(nbytes, cluster)
    return all_gather_s(nbytes, cluster)


def param_gather_s(model: ModelSpec, cfg: TrainConfig, cluster: Cluster) -> float:
    """ZeRO-1/2 all-gather the updated 16-bit parameters after the step (ZeRO sec. 7.2.1: with
    the reduce-scatter, 2 Psi, as an all-reduce)."""
    return all_gather_s(model.num_params * dtype_bytes(cfg.precision), cluster) if cfg.zero_stage in (1, 2) else 0.0


def stage3_gather_s(model: ModelSpec, cfg: TrainConfig, cluster: Cluster) -> float:
    """ZeRO-3 gathers each layer's parameters before its forward and again before its backward,
    every micro step (ZeRO sec. 7.2.2: with the reduce-scatter, 3 Psi)."""
    if cfg.zero_stage != 3:
        return 0.0
    nbytes = model.num_params * dtype_bytes(cfg.precision)
    # ZeRO++ (arXiv:2306.10209): qwZ gathers int8 weights (1/2 of bf16, sec. 3.1); hpZ gathers the
    # backward's weights from a secondary partition inside the node, at NVLink speed (sec. 3.2).
    fwd = all_gather_s(nbytes / 2 if cfg.zero_quantized_weights else nbytes, cluster)
    node = dataclasses.replace(cluster, num_nodes=1, gpus_per_node=cfg.zero_hpz_partition_size)
    bwd = all_gather_s(nbytes, node) if cfg.zero_hpz_partition_size > 1 else all_gather_s(nbytes, cluster)
    return fwd + bwd


def hidden_s(comm_s: float, window_s: float, num_layers: int, overlap: bool) -> float:
    """Communication hidden behind `window_s` of compute. None without a side stream (DeepSpeed's
    overlap_comm off runs collectives on the compute stream). With one, collectives run layer by
    layer under other layers' compute; the first gather and last reduction, one layer's share,
    have nothing to hide behind (PyTorch FSDP, Zhao et al. 2023, VLDB, sec. 3.3)."""
    if not overlap:
        return 0.0
    return comm_s - max(comm_s / num_layers, comm_s - window_s)


# ---- optimizer -------------------------------------------------------------------------------
def optimizer_params_per_gpu(model: ModelSpec, cfg: TrainConfig, cluster: Cluster) -> float:
    """Parameters each rank updates: all at ZeRO-0, its 1/n partition at ZeRO >= 1."""
    return model.num_params / (cluster.world_size if cfg.zero_stage >= 1 else 1)


def num_param_tensors(model: ModelSpec) -> int:
    """Parameter tensors of the Hugging Face module: fused QKV except Llama's q, k, v; a bias per
    matrix where the family has them; norm weight (+ bias); embeddings; untied head."""
    mats = (3 if model.family == "llama" else 1) + 1 + (3 if model.mlp == "swiglu" else 2)
    norm = 2 if model.norm_bias else 1
    per_layer = mats * (2 if model.linear_bias else 1) + 2 * norm
    return model.num_layers * per_layer + 1 + (model.position == "learned") + norm + (not model.tied_embeddings)


def optimizer_s(model: ModelSpec, cfg: TrainConfig, cluster: Cluster, rt: Runtime) -> float:
    """The GPU optimizer step, memory bound (bytes per parameter over HBM), plus an unfused
    optimizer's per-tensor op overhead."""
    if cfg.offload_optimizer:
        return 0.0
    kind = "8bit" if cfg.optimizer == "adamw8bit" else "fused" if rt.fused_optimizer else "unfused"
    adam = ADAM_BYTES_PER_PARAM[kind]
    extra = 12.0 if cfg.precision == "fp32" else MIXED_PRECISION_STEP_BYTES
    t = optimizer_params_per_gpu(model, cfg, cluster) * (adam + extra) / hbm_bytes_per_s(cluster.gpu)
    if not rt.fused_optimizer:
        tensors = rt.optimizer_tensors or (num_param_tensors(model) if cfg.zero_stage == 0 else 2)
        t += tensors * UNFUSED_OPS_PER_TENSOR * OP_OVERHEAD_S
    return t


def offload_s(model: ModelSpec, cfg: TrainConfig, cluster: Cluster) -> float:
    """ZeRO-Offload: 16-bit gradients down and parameters up over PCIe (Ren et al. 2021, sec. 4:
    2M + 2M bytes for M parameters), then CPU Adam over the node's share of the parameters.
    offload_param (ZeRO-Infinity, Rajbhandari et al. 2021, arXiv:2104.07857, sec. 5): each rank's
    16-bit partition crosses PCIe before the forward's and the backward's gathers of every micro
    step, and once more after a GPU update; not overlapped here (an upper bound on its cost)."""
    mine = optimizer_params_per_gpu(model, cfg, cluster)
    pcie = PCIE_GBPS * GB_PER_S
    t = 0.0
    if cfg.offload_param != "none":
        t += (2 * cfg.grad_accum + (0 if cfg.offload_optimizer else 1)) * mine * dtype_bytes(cfg.precision) / pcie
    if cfg.offload_optimizer:
        t += mine * 2 * dtype_bytes(cfg.precision) / pcie + mine * cluster.gpus_per_node / CPU_ADAM_PARAMS_PER_S
    return t


# ---- the step --------------------------------------------------------------------------------
def runtime_for(cfg: TrainConfig, model: ModelSpec) -> Runtime:
    """The Runtime of autotune's own trials, read from the DeepSpeed config they are given."""
    from autotune.deepspeed_config import zero_section

    z = zero_section(cfg, model)
    return Runtime(overlap_comm=bool(z.get("overlap_comm", False)),
                   contiguous_gradients=bool(z.get("contiguous_gradients", True)))


def compute_s(model: ModelSpec, cfg: TrainConfig, gpu: GpuSpec, rt: Runtime, c: Constants) -> dict[str, float]:
    """Forward+backward seconds of one micro step, per term."""
    tokens, L = cfg.tokens_per_micro_batch, model.num_layers
    mm = layer_matmul_s(model, tokens, gpu, cfg.precision)
    attn = layer_attention_s(model, cfg, gpu)
    elt = layer_elementwise_s(model, cfg, gpu, rt, c)
    head = gemm_time_s(tokens, model.hidden_size, model.vocab_size, gpu, cfg.precision)
    return {"matmul": L * mm + head, "attention": L * attn,
            "elementwise": L * elt, "logits": logits_s(model, cfg, gpu), "recompute": recompute_s(cfg, mm + attn + elt)}


def simulate(model: ModelSpec, cluster: Cluster, cfg: TrainConfig, *, runtime: Runtime | None = None,
             constants: Constants | None = None) -> SimulatedStep:
    """Simulated step time and throughput of `cfg` (the sum in the module docstring)."""
    rt = runtime or runtime_for(cfg, model)
    ga, L = cfg.grad_accum, model.num_layers
    micro = compute_s(model, cfg, cluster.gpu, rt, constants or Constants())
    fwd_bwd = sum(micro.values())
    # DeepSpeed reduces gradients on every micro step at ZeRO-2/3 and only on the accumulation
    # boundary at ZeRO-0/1 (engine.py allreduce_gradients; stage_1_and_2.py
    # reduce_ready_partitions_and_remove_grads).
    reduce = grad_reduce_s(model, cfg, cluster, rt)
    per_micro = stage3_gather_s(model, cfg, cluster) + (reduce if cfg.zero_stage >= 2 else 0.0)
    boundary_reduce = reduce if cfg.zero_stage < 2 else 0.0
    # A micro step's collectives hide under its forward+backward; the boundary reduction only under
    # the last backward (2/3 of it); ZeRO-1/2's gather after the step under nothing.
    overlap = ga * hidden_s(per_micro, fwd_bwd, L, rt.overlap_comm) + \
        hidden_s(boundary_reduce, fwd_bwd * 2 / 3, L, rt.overlap_comm)
    parts = {k: ga * v for k, v in micro.items()} | {
        "grad_reduce": reduce * (ga if cfg.zero_stage >= 2 else 1),
        "param_gather": param_gather_s(model, cfg, cluster),
        "stage3_gather": ga * stage3_gather_s(model, cfg, cluster),
        "overlap": -overlap,
        "optimizer": optimizer_s(model, cfg, cluster, rt),
        "offload": offload_s(model, cfg, cluster)}
    step_s = sum(parts.values())
    tok_s = cfg.tokens_per_micro_batch * ga / step_s
    flops = model.flops_per_token(cfg.seq_len) * tok_s
    return SimulatedStep(step_time_s=step_s, samples_per_s=cfg.micro_batch * ga * cluster.world_size / step_s,
                         tokens_per_s_per_gpu=tok_s, tflops_per_gpu=flops / TFLOPS,
                         mfu=flops / peak_flops(cluster.gpu, cfg.precision), breakdown_s=parts)


# ---- calibration -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class CalibrationPoint:
    """A published measurement (data/calibration.yaml) and the specs that reproduce its setup."""

    name: str
    model: ModelSpec
    cluster: Cluster
    config: TrainConfig
    runtime: Runtime
    metric: str  # the SimulatedStep field the measurement is compared on
    measured: float
    source: str


def calibration_points() -> list[CalibrationPoint]:
    from autotune.hardware import parse_gpus
    from autotune.models import resolve_model

    out = []
    for name, p in _calibration()["points"].items():
        metric, value = next(iter(p["measured"].items()))
        out.append(CalibrationPoint(name=name, model=resolve_model(p["model"]), cluster=parse_gpus(p["gpus"]),
                                    config=TrainConfig(**p["config"]), runtime=Runtime(**p["runtime"]),
                                    metric=metric, measured=float(value), source=p["source"]))
    return out


def calibration_errors(constants: Constants | None = None) -> dict[str, float]:
    """Point name -> simulated / measured - 1."""
    return {p.name: getattr(simulate(p.model, p.cluster, p.config, runtime=p.runtime, constants=constants),
                            p.metric) / p.measured - 1 for p in calibration_points()}
