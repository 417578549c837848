"""Model states per GPU: parameters, gradients, fp32 master weights, optimizer states and the optimizer step's
temporaries, as DeepSpeed 0.19.8 allocates them. Bytes in, bytes out; docs/memory.md has the table per stage.

Sources: stage 0 engine._configure_fp16_optimizer (FP16_Optimizer / FP16_UnfusedOptimizer: a fp32 master copy, fp32
gradients made at the step); stages 1-2 runtime/zero/stage_1_and_2.py (the 16-bit parameters flattened whole,
`single_partition_of_fp32_groups` a fp32 copy of the rank's partition even in fp32, Adam states on it); stage 3
runtime/zero/stage3.py (parameters partitioned, those under stage3_param_persistence_threshold kept whole,
grad_partitions_flat_buffer kept, gathered parameters held within stage3_max_reuse_distance:
partitioned_param_coordinator.py __params_to_release). These are ZeRO's (2 + 2 + K) Psi / N_d, K = 12 (Rajbhandari et
al. 2020, arXiv:1910.02054, sec. 5.1), except where DeepSpeed keeps more: the fp32 partition in fp32 training and stage
3's persistent gradient buffer. Measured on 2 CPU ranks (tests/test_memory_measured.py, benchmarks/memory_accuracy.py).
"""

from __future__ import annotations

from autotune.hardware import Cluster
from autotune.memory.buffers import (
    offload_accumulates_on_host,
    offload_fp32_partition,
    partition_elements,
)
from autotune.memory.layout import Layout
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig, dtype_bytes

ADAM_STATE_BYTES = 8
"""exp_avg + exp_avg_sq in fp32 (torch.optim.AdamW, DeepSpeed FusedAdam and CPUAdam)."""
ADAM8BIT_STATE_BYTES = 2 + 2 * 4 / 2048
"""bitsandbytes AdamW8bit: two uint8 states plus one fp32 absmax per 2048-element block for each
(Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", arXiv:2110.02861, sec. 2)."""
MASTER_BYTES = 4
STAGE3_SUB_GROUP_SIZE = int(1e9)
"""DeepSpeed default sub_group_size: stage 3 converts gradients to fp32 and steps the optimizer one
sub-group of the partition at a time (stage3.py, step -> _prepare_sub_group)."""


def master_bytes(cfg: TrainConfig) -> int:
    """Bytes per element of the master partition and of the gradients converted for the update:
    2 with bf16_master_weights_and_grads (base_optimizer.py _configure_master_weights returns
    torch.bfloat16), else 4. Measured on CPU (tiny-llama, tiny-gpt2, stages 1-3): forward -3P/N x 2 B
    (master 4 -> 2, moments 8 -> 4), optimizer step 6 instead of 12 B per partition element."""
    return 2 if cfg.bf16_master_weights_and_grads else MASTER_BYTES


def adam_state_bytes(cfg: TrainConfig) -> float:
    """Adam's moments per parameter: 8-bit AdamW, bf16 moments (bf16_optimizer_states: torch AdamW
    makes its states like the bf16 master partition), or fp32."""
    if cfg.optimizer == "adamw8bit":
        return ADAM8BIT_STATE_BYTES
    return ADAM_STATE_BYTES // 2 if cfg.bf16_optimizer_states else ADAM_STATE_BYTES


def persistent_params(spec: ModelSpec, threshold: int) -> int:
    """Stage 3 keeps parameters with fewer than `threshold` elements whole on every rank: norm
    weights/biases and linear biases here (stage3.py, persistence_threshold)."""
    n = 0
    small = [spec.hidden_size] * (2 if spec.norm_bias else 1)
    for size in small:
        if size < threshold:
            n += size * (2 * spec.num_layers + 1)
    if spec.linear_bias:
        per_layer = [spec.q_dim + 2 * spec.kv_dim, spec.hidden_size, spec.ffn_hidden_size, spec.hidden_size]
        if spec.mlp == "swiglu":
            per_layer.append(spec.ffn_hidden_size)
        n += spec.num_layers * sum(s for s in per_layer if s < threshold)
    return n


def param_numels(spec: ModelSpec) -> list[int]:
    """Element counts of the trial model's parameters in registration order (the order an
    optimizer's for-loop visits them): embeddings, then per block norm1, qkv, out, norm2, MLP,
    then the final norm and an untied head (autotune/impl/builtin.py)."""
    h, b = spec.hidden_size, spec.linear_bias
    norm = [h, h] if spec.norm_bias else [h]
    qkv_out = spec.q_dim + 2 * spec.kv_dim
    attn = [h * qkv_out] + ([qkv_out] if b else []) + [spec.q_dim * h] + ([h] if b else [])
    f = spec.ffn_hidden_size
    lin_in = [h * f] + ([f] if b else [])
    mlp = (lin_in * 2 if spec.mlp == "swiglu" else lin_in) + [f * h] + ([h] if b else [])
    out = [spec.vocab_size * h] + ([spec.max_seq_len * h] if spec.position == "learned" else [])
    out += (norm + attn + norm + mlp) * spec.num_layers + norm
    if not spec.tied_embeddings:
        out.append(spec.vocab_size * h)
    return out


def single_tensor_adam_peak(numels: list[int]) -> int:
    """torch.optim.AdamW(foreach=False) temporaries: for parameter i, `exp_avg_sq.sqrt()` and its
    division (2 x 4 B/element) while the previous parameter's `denom` (4 B/element) is not yet
    freed: max_i 8*n_i + 4*n_(i-1) (measured by the traced tier; torch/optim/adamw.py)."""
    return max(8 * n + 4 * prev for prev, n in zip([0] + numels[:-1], numels))


def largest_param(spec: ModelSpec) -> int:
    """Elements of the largest single parameter tensor (embedding, LM head, fused qkv, MLP)."""
    return max(
        spec.vocab_size * spec.hidden_size,
        spec.hidden_size * (spec.q_dim + 2 * spec.kv_dim),
        spec.hidden_size * spec.ffn_hidden_size,
    )


def zero3_step_parameters(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> dict[str, int]:
    """Stage 3's parameters while the optimizer steps: the partitions alone. The step releases every parameter, the
    persistent ones too (stage3.py `step` -> _partition_all_parameters), and gathers the persistent ones again after
    it (`_post_step`) (measured: docs/measurements/memory.md)."""
    if cfg.zero_stage != 3:
        return {}
    if cfg.offload_param != "none" and not cluster.gpu.is_cpu:
        return {"parameters": 0}  # the partition lives in host memory (memory/host.py)
    return {"parameters": int(dtype_bytes(cfg.precision) * spec.num_params / cluster.world_size)}


def states(
    spec: ModelSpec,
    cluster: Cluster,
    cfg: TrainConfig,
    persistence_threshold: int,
    reduce_bucket_elements: int = 0,
    persistent: int | None = None,
) -> dict[str, int]:
    """Bytes held for the whole run (present at the start of every forward), by term. `persistent`:
    ZeRO-3's whole-kept parameter elements counted on the module (code_trace.persistent_params),
    else from the shape."""
    p, n, z = spec.num_params, cluster.world_size, cfg.zero_stage
    pb = dtype_bytes(cfg.precision)
    state_b = adam_state_bytes(cfg)
    shard = p / n if z >= 1 else p
    out = {}
    if z == 3:
        # every parameter is partitioned; the small ones are also kept whole (measured: the
        # persistent ones add their full size on top of p/N)
        keep = persistent_params(spec, persistence_threshold) if persistent is None else persistent
        out["parameters"] = int(pb * (p / n + keep))
        if cfg.offload_param != "none" and not cluster.gpu.is_cpu:
            out["parameters"] = int(pb * keep)  # the partition lives in host memory (memory/host.py)
        out["gradient_partition"] = int(
            (4 if cfg.grad_accum_dtype == "fp32" else pb) * p / n
        )  # stage3.py grad_partitions_flat_buffer
        # the reduce bucket is allocated at the first backward and kept (measured on CPU:
        # reduce_bucket_size elements in the model dtype live at the start of every later step)
        out["reduce_bucket"] = pb * reduce_bucket_elements
        if cfg.zero_hpz_partition_size > 1:  # ZeRO++ hpZ's secondary partition (arXiv:2306.10209, sec. 3.2)
            out["hpz_secondary_partition"] = int(pb * p / cfg.zero_hpz_partition_size)
    else:
        out["parameters"] = pb * p
    if z == 1 and cfg.precision == "bf16" and cfg.grad_accum_dtype == "fp32" and not cfg.offload_optimizer:
        out["fp32_gradients"] = 4 * p  # BF16_Optimizer's fp32 gradients (memory/buffers.py bf16_optimizer)
    if cfg.offload_optimizer and cluster.gpu.is_cpu:
        # CPU ranks: the host is the device, so the offloaded fp32 partition, its moments and the fp32 gradient
        # partition the step reads (memory/host.py) are in the rank's own memory (measured: docs/measurements/memory.md)
        out["master_weights"] = int(master_bytes(cfg) * shard)
        out["optimizer_states"] = int(state_b * shard)
        out["offloaded_fp32_gradients"] = int(master_bytes(cfg) * shard)
    elif cfg.offload_optimizer:
        out["master_weights"] = 0  # fp32 partition and Adam states live in pinned CPU memory
        out["optimizer_states"] = 0
    else:
        master = master_bytes(cfg) * shard if (z >= 1 or cfg.precision != "fp32") else 0
        out["master_weights"] = int(master)
        out["optimizer_states"] = int(state_b * shard)
    device, host = offload_buffers(spec, cluster, cfg)
    out.update(device)
    if cluster.gpu.is_cpu:  # the host is the device
        out.update(host)
    return out


def offload_buffers(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> tuple[dict[str, int], dict[str, int]]:
    """Stage 1-2 ZeRO-Offload's staging buffers, allocated once (stage_1_and_2.py with cpu_offload): on the device
    `temp_grad_buffer_for_gpu_offload` (the largest parameter); on the host `temp_grad_buffer_for_cpu_offload` (the
    same) and `param_buffer_of_bit16_for_cpu_offload_groups` (a 16-bit copy of the partition), with grad_accum > 1 at
    stage 2 also `offload_accumulates_on_host`'s. On CPU ranks the host is the device. Returns (device terms, host
    terms); an adapter view (LoRA) prices its largest parameter as at most all its adapters (measured:
    docs/measurements/memory.md)."""
    if not cfg.offload_optimizer or cfg.zero_stage not in (1, 2):
        return {}, {}
    pb, largest = dtype_bytes(cfg.precision), min(largest_param(spec), spec.num_params)
    host = {
        "offload_bit16_partition": int(pb * spec.num_params / cluster.world_size),
        "offload_cpu_grad_buffer": pb * largest,
    }
    if offload_accumulates_on_host(cfg):
        host["offload_accumulated_gradients"] = pb * partition_elements(spec, cluster, cfg)
    return {"offload_grad_buffer": pb * largest}, host


def step_terms(
    spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, fused_optimizer: bool, layout: Layout | None = None
) -> dict[str, int]:
    """Gradients and temporaries alive at the peak of the optimizer step, on top of `states`: at stage 0 the gradients
    and, in 16 bits, their fp32 copy; at stages 1-2 the partition converted to fp32 (the 16-bit one freed first); at
    stage 3 the persistent buffer copied to a fp32 partition, or an AutoTP shard's larger group
    (`layout.zero3_largest_group`). torch's single-tensor AdamW (foreach=False off CUDA) makes two temporaries the
    size of the stepped tensor (`exp_avg_sq.sqrt()` and its division, torch/optim/adamw.py _single_tensor_adam);
    FusedAdam and bitsandbytes update in place. Measured on 2 CPU ranks: stage 0 fp32 4P + 8 x largest, bf16 2P + 4P
    + 8 x largest, stages 1-3 12 B per partition element."""
    p, n, z = spec.num_params, cluster.world_size, cfg.zero_stage
    pb = dtype_bytes(cfg.precision)
    compact = offload_fp32_partition(spec, cluster, cfg)  # offload + fp32 accumulation: on the device
    if cfg.offload_optimizer and not cluster.gpu.is_cpu:
        # gradients are copied partition by partition to pinned CPU memory, the step runs there
        # (on CPU ranks the step is the same torch AdamW as without offload, on the same memory:
        # measured, Optimizer.step#AdamW.step's sqrt and div over the fp32 partition)
        return {"gradients": compact or (int(pb * p / n) if z in (1, 2) else 0), "optimizer_temporaries": 0}
    if z == 1 and cfg.precision == "bf16" and cfg.grad_accum_dtype == "fp32":
        # BF16_Optimizer (memory/buffers.py bf16_optimizer): its fp32 gradients are a state, the step's fp32
        # partition a view of them (bf16_optimizer.py step: `param_partition.grad = grad_partition`, same dtype), and
        # the bf16 gradients live until the engine's zero_grad after the step (engine.py _take_model_step;
        # backward_epilogue -> update_hp_grads(clear_lp_grads=False)): 2P beside the update's two temporaries
        # (measured: docs/measurements/memory.md, "Issue 51")
        return {"gradients": pb * p, "optimizer_temporaries": int(2 * 4 * p / n) if not fused_optimizer else 0}
    stepped = largest_param(spec) if z == 0 else p / n
    if z == 3:
        # an AutoTP shard's larger group (memory/tensor_parallel.py zero3_largest_group), else the partition
        group = layout.zero3_largest_group if layout else None
        stepped = min((p if group is None else group) / n, STAGE3_SUB_GROUP_SIZE)
    if fused_optimizer or cfg.optimizer == "adamw8bit":
        temps = 0
    elif z == 0:
        temps = single_tensor_adam_peak(param_numels(spec))
    else:
        temps = int(2 * master_bytes(cfg) * stepped)  # one flat partition (or sub-group) tensor
    if z == 0:
        grads = pb * p + (4 * p if pb != 4 else 0)
        return {"gradients": grads, "optimizer_temporaries": temps}
    fp32_partition = int(master_bytes(cfg) * stepped)
    if cfg.offload_optimizer:  # CPU ranks: the fp32 gradient partition is a state (`states`), not made here
        fp32_partition = 0
    if z in (1, 2) and pb != 4 and temps < pb * p / n:
        # the 16-bit partition and its fp32 copy coexist before the update; that is the peak
        # only when the update itself makes less than the 16-bit partition (fused optimizers)
        return {"gradients": compact + fp32_partition + int(pb * p / n), "optimizer_temporaries": 0}
    return {"gradients": compact + fp32_partition, "optimizer_temporaries": temps}


def zero3_held(spec: ModelSpec, layout: Layout, persistent: int | None = None) -> int:
    """Elements stage 3 holds gathered at the end of forward: every partitioned one, up to
    stage3_max_reuse_distance. From the second step on (a complete trace) a module's parameters are
    released only if their next use is further than max_reuse_distance elements of the trace away
    (partitioned_param_coordinator.py __params_to_release); stage3_max_live_parameters releases
    nothing (measured: the same peak with 1 and with 1e9, tests/test_knobs.py)."""
    threshold = layout.stage3_param_persistence_threshold
    p = spec.num_params - (persistent_params(spec, threshold) if persistent is None else persistent)
    return min(p, layout.stage3_max_reuse_distance)


def zero3_gathered(
    spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout, persistent: int | None = None
) -> int:
    """Stage 3 parameters gathered for forward/backward and kept live (`zero3_held`; measured: with
    the default reuse distance 1e9 a small model keeps every gathered parameter from forward
    through backward)."""
    if cfg.zero_stage != 3 or cluster.world_size == 1:
        return 0
    return int(dtype_bytes(cfg.precision) * zero3_held(spec, layout, persistent))


def zero3_prefetch(
    spec: ModelSpec,
    cluster: Cluster,
    cfg: TrainConfig,
    layout: Layout,
    persistent: int | None = None,
    on_demand: int = 0,
) -> int:
    """The flat buffer of the prefetch that holds the LM head, live until the head runs, beside every layer's
    activations. From the second step each fetch issues one all-gather of the next parameters, up to min(prefetch
    bucket, max_live - available) elements and one parameter past it (partitioned_param_coordinator.py
    _fetch_sub_module_impl), into one flat buffer (partition_parameters.py _all_gather_dtype) freed once its last
    parameter is waited for (AllGatherCoalescedHandle.wait). So at most min(bucket, max_live) + the largest
    parameter, and no more than the held parameters less `on_demand`, those fetched before the first prefetch (the
    stand-in's embedding; none for transformers' code). With everything held (`zero3_held`) the head is prefetched
    only under max_live + one parameter. Run to run variation with mid-sized buckets is open (docs/memory.md, "Known
    open errors"; measured: docs/measurements/memory.md)."""
    if cfg.zero_stage != 3 or cluster.world_size == 1:
        return 0
    held, last = zero3_held(spec, layout, persistent), largest_param(spec)
    live = layout.stage3_max_live_parameters
    if held > live + last:
        return 0
    rest = max(0, held - on_demand)
    return int(dtype_bytes(cfg.precision) * min(rest, min(layout.stage3_prefetch_bucket_size, live) + last))
