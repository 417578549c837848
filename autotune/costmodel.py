"""Throughput cost model: seconds per optimizer step of a model on a cluster under a TrainConfig.

One pure function per time term; `simulate()` adds them up. Every constant says where it comes
from. The compute of a micro step is priced op by op from the traced program (autotune/costops/).
One constant per GPU generation is fitted to the published points in data/calibration.yaml:
`Constants.sustained` (benchmarks/fit_costmodel.py; docs/costmodel.md). Times are
seconds, sizes bytes, bandwidths bytes per second inside (GB/s = 10^9 at the edge).

Per GPU, data parallel over all `world_size` ranks:

    step = grad_accum x (compute + recompute + ZeRO comm of a micro step, less what overlaps)
           + ZeRO comm of the step (less what overlaps) + optimizer step (or offload)
           + host (end to end only: the training loop outside the engine's timers)
    compute = GEMMs + attention kernels + element-wise/reduction kernels of the traced step, fwd+bwd
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from functools import cache
from importlib import resources

import yaml

from autotune.costops.parallel import sequence_parallel_size, shard_price, tp_comm_s, ulysses_comm_s
from autotune.errors import SpecError
from autotune.hardware import Cluster, GpuSpec
from autotune.memory.layout import Layout
from autotune.models import ModelSpec
from autotune.parallel import data_parallel_size
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


HOST_STEP_S = 1.1e-3
"""Per micro step, the training loop's host work outside DeepSpeed's forward/backward/step timers,
with the GPU idle as those timers synchronise: the next batch from a DataLoader (num_workers 0, the
HF Trainer's default), default_data_collator over run_clm-style token lists, the copy to the device,
the loss bookkeeping. Measured here: median 1.11 ms for micro batch 3 x 1024 tokens
(`PYTHONPATH=. python benchmarks/host_step.py`; host CPU work, so a CPU measures it)."""

SUSTAINED_FIT = {"Ampere": 0.785, "Hopper": 0.66, "other": 0.67}
"""benchmarks/fit_costmodel.py's result per GPU generation (see Constants.sustained)."""

GENERATIONS = {"Ampere": ("A100",), "Hopper": ("H100", "H200", "GH200")}
"""GPU name prefixes per generation with a sustained share of its own (fitted on published runs of that
generation); every other GPU takes "other" (fitted on the V100 points)."""


def generation(gpu_name: str) -> str:
    """The generation whose sustained share a GPU takes: Ampere (A100), Hopper (H100, H200), other."""
    return next((g for g, prefixes in GENERATIONS.items() if gpu_name.startswith(prefixes)), "other")


@dataclass(frozen=True, kw_only=True)
class Constants:
    """The fitted constants (benchmarks/fit_costmodel.py; docs/costmodel.md, "Calibration")."""

    sustained: tuple[tuple[str, float], ...] = tuple(SUSTAINED_FIT.items())
    """Per GPU generation, the share of the GEMM benchmark's efficiency (MAMF, a maximum over a sweep of shapes) that a
    training step's GEMMs keep; attention kernels are priced at FlashAttention-2's own benchmark, taken at a step's
    shapes (costops.attention_s), and memory-bound kernels are not scaled. A property of the GPU (the same GEMMs
    beside HBM traffic and collectives under one power cap), so one share per generation: one global share overrated
    the H100 against the A100 by 13-26% on llm-foundry's paired runs (docs/measurements/costmodel.md)."""

    def for_gpu(self, gpu_name: str) -> float:
        return dict(self.sustained)[generation(gpu_name)]

    def with_share(self, gen: str, value: float) -> "Constants":
        return dataclasses.replace(self, sustained=tuple({**dict(self.sustained), gen: value}.items()))


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
    implementation: str = "builtin"
    """The code whose step is traced and priced op by op (autotune/costops/): "builtin" (autotune's
    trial model: fused GELU, no dropout) or "hf" (transformers' modeling code as it is)."""
    attention_kernel: str = "flash2"
    """The flash-attention kernel the framework runs (costops.ATTENTION_KERNELS): "flash2"
    (FlashAttention-2: flash-attn >= 2, PyTorch's sdpa since torch 2.2, what autotune's trials run) or
    "triton" (FlashAttention in Triton: llm-foundry's `attn_impl: triton`, its published benchmark
    tables' setting), priced at FlashAttention-2's speed / 1.4 forward and / 2 backward."""
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
    """Seconds per step of each term (they sum to step_time_s): compute (GEMMs), attention,
    elementwise, recompute (forward+backward of all micro steps, priced op by op); under LoRA,
    adapters (their GEMMs) and, under QLoRA, dequantize; grad_reduce,
    param_gather, stage3_gather (ZeRO communication); overlap (the communication hidden behind
    compute, negative); optimizer; offload; tp_comm (AutoTP's all-reduces), sp_comm (Ulysses'
    all-to-alls), each only where that parallelism is on; host (end to end only). `terms()` groups them."""
    source: str = "simulated"

    def terms(self) -> dict[str, float]:
        """The per-term view (seconds per step): compute, attention, elementwise, recompute,
        communication exposed (collectives less what hides under compute, tensor and sequence parallelism's
        included), optimizer (with
        offload), host. LoRA's adapter GEMMs count as compute, QLoRA's dequantisation (a memory-bound
        kernel) as elementwise: the terms sum to the step time."""
        b = self.breakdown_s
        comm = sum(
            b.get(k, 0.0) for k in ("grad_reduce", "param_gather", "stage3_gather", "overlap", "tp_comm", "sp_comm")
        )
        return {
            "compute": b["compute"] + b.get("adapters", 0.0),
            "attention": b["attention"],
            "elementwise": b["elementwise"] + b.get("dequantize", 0.0),
            "recompute": b["recompute"],
            "communication exposed": comm,
            "optimizer": b.get("optimizer", 0.0) + b.get("offload", 0.0),
            "host": b.get("host", 0.0),
        }

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
        raise SpecError(
            f"the cost model needs {gpu.name}'s {precision} peak and memory bandwidth "
            f"(CPU ranks are measured, not simulated)"
        )
    return peak


def hbm_bytes_per_s(gpu: GpuSpec) -> float:
    return gpu.hbm_gbps * GB_PER_S * HBM_EFFICIENCY  # achieved, not datasheet


def price_key(gpu: GpuSpec, precision: str) -> tuple:
    """What autotune.costops prices a GPU by (hashable): its peaks, achieved HBM, measured E."""
    from autotune.costops import gpu_key

    peak_flops(gpu, precision)  # CPU ranks have no datasheet: say so before tracing
    return gpu_key(gpu, precision, hbm_bytes_s=hbm_bytes_per_s(gpu), gemm_efficiency=gemm_efficiency(gpu))


def compute_s(model: ModelSpec, cfg: TrainConfig, gpu: GpuSpec, rt: Runtime, c: Constants) -> dict[str, float]:
    """Forward+backward seconds of one micro step, per op class, priced op by op from the traced
    step of `rt.implementation` (autotune/costops/): GEMMs (weights and LM head: `compute`),
    attention kernels, element-wise and reduction kernels (norms, activations, loss, casts, eager
    scores); `recompute` reruns the forward of each checkpointed block in backward.
    Under tensor or sequence parallelism it is one rank's step (costops.parallel.shard_price): the tp shard's
    ops on seq / sp tokens, attention over the whole sequence for heads / sp."""
    p = shard_price(
        model,
        cfg.autotp_size,
        sequence_parallel_size(cfg),
        rt.implementation,
        cfg.precision,
        cfg.attention,
        cfg.micro_batch,
        cfg.seq_len,
        price_key(gpu, cfg.precision),
        c.for_gpu(gpu.name),
        rt.attention_kernel,
    )
    return {
        "compute": p.gemm,
        "attention": p.attention,
        "elementwise": p.elementwise,
        "recompute": cfg.ckpt_layers * p.layer_forward,
    }


ROUTED_FLOPS_FRACTION = 0.75
"""Below this fraction of 6N + attention (`ModelSpec.flops_per_token`), the FLOPs a token runs in the
traced step are taken as the model FLOPs of MFU: a mixture of experts runs only the experts it is
routed to, so 6N over every expert's parameters would count FLOPs no kernel runs (a DeepSeek-V3
read an MFU of 148%). A dense model's traced FLOPs are 6N less the embedding lookup's, within a few
percent of it, and keep the formula."""


def model_flops_per_token(model: ModelSpec, cfg: TrainConfig, implementation: str) -> float:
    """Model FLOPs per token for MFU (PaLM's convention, recompute not counted): 6N + attention, or
    what `implementation`'s traced step runs where that is far less (ROUTED_FLOPS_FRACTION). The
    simulated step's MFU and a measured trial's (trial/launch.py) both use it."""
    from autotune.costops import step_flops

    formula = model.flops_per_token(cfg.seq_len)
    traced = (
        step_flops(model, implementation, cfg.precision, cfg.attention, cfg.micro_batch, cfg.seq_len)
        / cfg.tokens_per_micro_batch
    )
    return traced if traced < ROUTED_FLOPS_FRACTION * formula else formula


# ---- communication ---------------------------------------------------------------------------
def link_bytes_per_s(cluster: Cluster) -> float:
    """Bus bandwidth of a ring collective per GPU. In a node, NVLink (or PCIe). Across nodes the
    slowest hop bounds a ring (Patarasuk & Yuan 2009); NCCL runs a ring per NIC, each carrying its
    share, so the node's NICs together (per-GPU NIC x GPUs per node) bound it, capped by NVLink."""
    gbps = cluster.gpu.intra_node_gbps
    if not cluster.gpu.p2p:
        # no peer-to-peer (GeForce RTX 4090): NCCL's SHM transport copies GPU -> host memory -> GPU, each
        # byte over PCIe twice (NCCL environment-variable docs, NCCL_P2P_DISABLE; sources in data/gpus.yaml)
        gbps /= 2
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


SEQ_PARALLEL_REDUCE_BYTES = 4
"""Bytes per gradient element DeepSpeed reduces in once sequence parallelism is on: the engine sets its
communication_data_type to `seq_parallel_communication_data_type` (runtime/engine.py, where it reads
sequence_parallel_size), whose default is "fp32" (runtime/constants.py SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT,
set to "fp32" whatever the NCCL version in deepspeed 0.19.8), and ZeRO 1-3 reduce in that dtype (stage_1_and_2.py
gradient_reduction_w_predivide, stage3.py). autotune's JSON does not set the key."""


def grad_reduce_s(model: ModelSpec, cfg: TrainConfig, cluster: Cluster, rt: Runtime) -> float:
    """One reduction of all gradients. ZeRO-0 all-reduces (2 Psi moved); ZeRO >= 1 reduce-scatters
    (Psi) (Rajbhandari et al. 2020, "ZeRO", sec. 7.2), unless ZeRO-1/2 falls back to all-reduce.
    Under Ulysses the gradients travel in fp32 (SEQ_PARALLEL_REDUCE_BYTES)."""
    nbytes = model.num_params * (
        SEQ_PARALLEL_REDUCE_BYTES if sequence_parallel_size(cfg) > 1 else dtype_bytes(cfg.precision)
    )
    if cfg.zero_quantized_gradients:
        nbytes /= 4  # qgZ: int4 all-to-all, 1/4 of bf16 (ZeRO++ arXiv:2306.10209, sec. 3.3)
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


def stage3_prefetched(model: ModelSpec, cfg: TrainConfig, layout: Layout) -> float:
    """Fraction of ZeRO-3's gathers issued ahead of use, so able to hide behind compute; the rest the coordinator
    fetches on demand and waits for (partitioned_param_coordinator.py fetch_sub_module: "block on parameters in
    immediately required sub module"). Prefetch stops once the gathered parameters reach stage3_max_live_parameters
    (it issues min(max_live - available, bucket)), and the parameters held gathered grow to what the reuse distance
    keeps (memory/model_states.zero3_held), so the first max_live of those are prefetched. The prefetch bucket has no
    term: the coordinator keeps at least one parameter of the next module in flight whatever its size
    (docs/measurements/costmodel.md)."""
    if cfg.zero_stage != 3:
        return 1.0
    from autotune.memory.model_states import zero3_held

    held = zero3_held(model, layout)
    return min(1.0, layout.stage3_max_live_parameters / held) if held else 1.0


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
    return Runtime(
        overlap_comm=bool(z.get("overlap_comm", False)),
        contiguous_gradients=bool(z.get("contiguous_gradients", True)),
        implementation=model.implementation,
    )


def simulate(
    model: ModelSpec,
    cluster: Cluster,
    cfg: TrainConfig,
    *,
    runtime: Runtime | None = None,
    constants: Constants | None = None,
    scope: str = "end_to_end",
) -> SimulatedStep:
    """Simulated step time and throughput of `cfg` (the sum in the module docstring).

    scope "end_to_end": what a user's training loop gets, the host's per-step work included;
    "engine_timers": DeepSpeed's forward + backward + step timers only, the quantity its autotuner
    reports (deepspeed/runtime/engine.py `_autotuning_exit`), without the host term."""
    if scope not in ("end_to_end", "engine_timers"):
        raise ValueError(f"scope {scope!r}: end_to_end or engine_timers")
    rt = runtime or runtime_for(cfg, model)
    ga, L = cfg.grad_accum, model.num_layers
    tp, sp = cfg.autotp_size, sequence_parallel_size(cfg)
    # What one rank holds and the ranks ZeRO shards it over: under AutoTP the tp shard over world / tp ranks
    # (autotune/memory/tensor_parallel.py local_model, dp_cluster). Ulysses ranks hold the same parameters, and
    # ZeRO partitions and reduces over the data and sequence parallel ranks together (deepspeed utils/groups.py
    # _get_sequence_data_parallel_group: "the process group for zero sharding and gradient allreduce must be
    # across both dimensions of data and sequence parallelism"; engine.py passes seq_data_parallel_group as
    # the ZeRO optimizer's dp_process_group), so still world / tp ranks.
    shard, zc = model, cluster
    if tp > 1:
        from autotune.memory.tensor_parallel import dp_cluster, local_model

        shard, zc = local_model(model, tp), dp_cluster(cluster, tp)
    micro = compute_s(model, cfg, cluster.gpu, rt, constants or Constants())
    gathered = trained = shard  # what ZeRO-3 gathers (the rank's whole module) and what is reduced and stepped
    if cfg.method != "full":  # frozen base: its compute here, and only the adapters reduced and stepped
        mine = dataclasses.replace(cfg, seq_len=cfg.seq_len // sp) if sp > 1 else cfg  # the rank's tokens
        micro = lora_compute_s(model, mine, cluster.gpu, micro, (constants or Constants()).for_gpu(cluster.gpu.name))
        trained, rt = lora_trained(model, cfg, rt)
    fwd_bwd = sum(micro.values())
    # DeepSpeed reduces gradients on every micro step at ZeRO-2/3 and only on the accumulation
    # boundary at ZeRO-0/1 (engine.py allreduce_gradients; stage_1_and_2.py
    # reduce_ready_partitions_and_remove_grads).
    reduce = grad_reduce_s(trained, cfg, zc, rt)
    # the part of the stage-3 gathers fetched on demand stays on the critical path (stage3_prefetched)
    prefetched = stage3_prefetched(gathered, cfg, Layout.of(model, cluster, cfg))
    per_micro = stage3_gather_s(gathered, cfg, zc) * prefetched + (reduce if cfg.zero_stage >= 2 else 0.0)
    boundary_reduce = reduce if cfg.zero_stage < 2 else 0.0
    # A micro step's collectives hide under its forward+backward; the boundary reduction only under
    # the last backward (2/3 of it); ZeRO-1/2's gather after the step under nothing.
    overlap = ga * hidden_s(per_micro, fwd_bwd, L, rt.overlap_comm) + hidden_s(
        boundary_reduce, fwd_bwd * 2 / 3, L, rt.overlap_comm
    )
    parts = {k: ga * v for k, v in micro.items()} | {
        "grad_reduce": reduce * (ga if cfg.zero_stage >= 2 else 1),
        "param_gather": param_gather_s(trained, cfg, zc),
        "stage3_gather": ga * stage3_gather_s(gathered, cfg, zc),
        "overlap": -overlap,
        "optimizer": optimizer_s(trained, cfg, zc, rt),
        "offload": offload_s(trained, cfg, zc),
    }
    if tp > 1:  # AutoTP's per-layer all-reduces and the gathered head, on the tp group's link
        parts["tp_comm"] = ga * tp_comm_s(model, cfg, cluster, link_bytes_per_s, dtype_bytes(cfg.precision))
    if sp > 1:  # Ulysses' per-layer all-to-alls, on the sp group's link
        parts["sp_comm"] = ga * ulysses_comm_s(model, cfg, cluster, link_bytes_per_s, dtype_bytes(cfg.precision))
    if scope == "end_to_end":
        parts["host"] = ga * HOST_STEP_S  # a batch is fetched per micro step
    step_s = sum(parts.values())
    # A tp group's ranks train one micro batch, and an sp group's ranks one micro batch's sequences, each rank
    # seq / sp of their tokens (UlyssesSPDataLoaderAdapter): tokens per GPU are the group's over tp x sp GPUs,
    # and the sequences of a step come from world / (tp x sp) groups.
    tok_s = cfg.tokens_per_micro_batch * ga / step_s / (tp * sp)
    flops = (
        model_flops_per_token(model, cfg, rt.implementation)
        if cfg.method == "full"
        else model.flops_per_token(cfg.seq_len)
    ) * tok_s
    if cfg.method != "full":  # frozen weights: 4N, not 6N (no weight gradients), plus the adapters' 6
        flops += (6.0 * trained.num_params - 2.0 * model.num_params) * tok_s
    dp = data_parallel_size(cfg, cluster.world_size)
    return SimulatedStep(
        step_time_s=step_s,
        samples_per_s=cfg.micro_batch * ga * dp / step_s,
        tokens_per_s_per_gpu=tok_s,
        tflops_per_gpu=flops / TFLOPS,
        mfu=flops / peak_flops(cluster.gpu, cfg.precision),
        breakdown_s=parts,
    )


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
    scope: str  # what the figure times: end_to_end, or engine_timers (DeepSpeed's autotuner metric)
    measured: float
    source: str


def calibration_points() -> list[CalibrationPoint]:
    from autotune.hardware import parse_gpus
    from autotune.models import resolve_model

    out = []
    for name, p in _calibration()["points"].items():
        metric, value = next(iter(p["measured"].items()))
        out.append(
            CalibrationPoint(
                name=name,
                model=resolve_model(p["model"]),
                cluster=parse_gpus(p["gpus"]),
                config=TrainConfig(**p["config"]),
                runtime=Runtime(**p["runtime"]),
                metric=metric,
                scope=p.get("scope", "end_to_end"),
                measured=float(value),
                source=p["source"],
            )
        )
    return out


def calibration_errors(constants: Constants | None = None) -> dict[str, float]:
    """Point name -> simulated / measured - 1."""
    return {
        p.name: getattr(
            simulate(p.model, p.cluster, p.config, runtime=p.runtime, constants=constants, scope=p.scope), p.metric
        )
        / p.measured
        - 1
        for p in calibration_points()
    }


# ---- LoRA / QLoRA (issue #12): additive terms, called from simulate ------------------------------
@cache  # a LoRA space asks the same few shapes for every candidate: 160k calls for lora.yaml's 13B plan
def _gemm_fwd_bwd_s(m: int, k: int, n: int, key: tuple, precision: str, sustained: float) -> float:
    """An (m x k) @ (k x n) product's forward GEMM and its two backward ones (input gradient
    (m x n) @ (n x k), weight gradient (k x m) @ (m x n)), each priced as costops prices a traced
    GEMM: 2 x its three sizes FLOPs, its three matrices read or written once."""
    from autotune.costops import Op, gemm_s

    size = dtype_bytes(precision)
    shapes = (("fwd", m, k, n), ("bwd", m, n, k), ("bwd", k, m, n))
    return sum(
        gemm_s(Op("gemm", "mm", phase, 2.0 * a * b * c, (a * b + b * c + a * c) * size, (1, a, b, c)), key, sustained)
        for phase, a, b, c in shapes
    )


def lora_compute_s(
    model: ModelSpec, cfg: TrainConfig, gpu: GpuSpec, micro: dict[str, float], sustained: float
) -> dict[str, float]:
    """A micro step's compute with a frozen base. The base's weight GEMMs (layers and LM head) run
    forward and the input-gradient GEMM, not the weight-gradient one: 2/3 of their three
    (Hu et al. 2021, LoRA, sec. 4.2: no gradients for the frozen weights). Each adapter adds x·A
    (in -> r) and (xA)·B (r -> out), forward and both backward GEMMs. QLoRA dequantises each
    linear weight of the decoder layers per use, forward and input-gradient backward (and the
    recomputed forward of checkpointed layers): read NF4 + constants, write the 16-bit weight, at
    HBM bandwidth (bitsandbytes MatMul4Bit: F.dequantize_4bit before each matmul)."""
    from autotune.memory.lora import adapter_shapes, qlora_bytes_per_weight, quantized_weights

    tokens = cfg.tokens_per_micro_batch
    out = dict(micro)
    out["compute"] = micro["compute"] * 2.0 / 3.0  # costops' weight GEMMs (layers and LM head)
    key, r = price_key(gpu, cfg.precision), cfg.lora_rank
    out["adapters"] = sum(
        _gemm_fwd_bwd_s(tokens, k, r, key, cfg.precision, sustained)
        + _gemm_fwd_bwd_s(tokens, r, n, key, cfg.precision, sustained)
        for k, n in adapter_shapes(model, cfg)
    )
    if cfg.method == "qlora":
        q, _ = quantized_weights(model, cfg)
        uses = 2.0 + cfg.ckpt_layers / model.num_layers
        out["dequantize"] = uses * q * (qlora_bytes_per_weight() + dtype_bytes(cfg.precision)) / hbm_bytes_per_s(gpu)
    return out


def lora_trained(model: ModelSpec, cfg: TrainConfig, rt: Runtime) -> tuple[ModelSpec, Runtime]:
    """What is reduced, gathered after the step and stepped under LoRA: the adapters alone (a model
    of adapter_params parameters, as many tensors as adapters)."""
    from dataclasses import replace

    from autotune.memory.lora import adapter_numels, adapter_view

    tensors = rt.optimizer_tensors or (len(adapter_numels(model, cfg)) if cfg.zero_stage == 0 else 2)
    return adapter_view(model, cfg), replace(rt, optimizer_tensors=tensors)
