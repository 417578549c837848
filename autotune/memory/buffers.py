"""DeepSpeed's communication buffers, in bytes. Sizes come from the config autotune writes
(autotune/deepspeed_config.py) and DeepSpeed 0.19.8's code paths named in each docstring."""

from __future__ import annotations

from functools import cache

from autotune.hardware import Cluster
from autotune.memory.activations import dtype_bytes
from autotune.memory.code_trace import layer_numels, param_numels
from autotune.memory.layout import Layout
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig

STAGE0_ALLREDUCE_ELEMENTS = 500_000_000
"""engine.allreduce_gradients -> buffered_allreduce_fallback(elements_per_buffer=500000000):
gradients are flattened into one buffer per 5e8 elements before the all-reduce."""


def bf16_optimizer(cfg: TrainConfig) -> bool:
    """ZeRO-1 with bf16 weights and fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer, not the ZeRO optimizer
    (engine._do_optimizer_sanity_check returns BFLOAT16): fp32 gradients of every parameter held from the first step
    on (bf16_optimizer.py fp32_groups_gradients) and no reduce bucket (measured: docs/measurements/memory.md)."""
    return (
        cfg.zero_stage == 1 and cfg.precision == "bf16" and cfg.grad_accum_dtype == "fp32" and not cfg.offload_optimizer
    )


def stage1_reduces_in_backward(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> bool:
    """ZeRO-1 with overlap_comm reduces during backward as stage 2 does (stage_1_and_2.py process_gradients:
    `partition_gradients or overlap_comm`): each gradient is copied into the bucket and becomes a view of it
    (reduce_independent_p_g_buckets_and_remove_grads), the partition is allocated at the first reduction, and only a
    gradient larger than the bucket stays whole (`whole_gradient_bytes`). Full fine-tuning only, and not where one
    bucket holds every gradient (it never fills, so nothing is reduced before the epilogue) (measured:
    docs/measurements/memory.md)."""
    return (
        cfg.zero_stage == 1
        and cfg.overlap_comm
        and not bf16_optimizer(cfg)
        and cfg.method == "full"
        and layout.reduce_bucket_size < spec.num_params
    )


def stage2_reduces_at_end(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> bool:
    """Stage 2 where one reduce bucket holds every gradient (reduce_bucket_size >= P): the bucket never fills, so
    nothing is reduced before the epilogue (stage_1_and_2.py independent_gradient_partition_epilogue ->
    reduce_ipg_grads), each gradient is a view of the bucket through backward, and the partition
    (copy_grads_in_partition) exists only from the end of backward on. Not with offload (`offload_fp32_partition`)
    (measured: docs/measurements/memory.md)."""
    return cfg.zero_stage == 2 and not cfg.offload_optimizer and layout.reduce_bucket_size >= spec.num_params


def buckets_in_backward(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> int:
    """The reduce bucket(s) through the layers' backward where nothing is reduced there: process_gradients calls
    setup_buckets at the first gradient hook, one bucket, two with overlap_comm (stage_1_and_2.py setup_buckets),
    whether or not anything is reduced before the boundary. Stage 1 without `stage1_reduces_in_backward`, stage 2
    where `stage2_reduces_at_end`; at stage 1 with grad_accum > 1 they are `carried_reduce_bucket` (measured:
    docs/measurements/memory.md)."""
    if stage2_reduces_at_end(spec, cfg, layout):
        return reduce_bucket_bytes(spec, cfg, layout)
    if (
        cfg.zero_stage != 1
        or cfg.grad_accum > 1
        or bf16_optimizer(cfg)
        or stage1_reduces_in_backward(spec, cfg, layout)
    ):
        return 0
    return reduce_bucket_bytes(spec, cfg, layout)


def stage1_gradients_in_bucket(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> bool:
    """Stage 1 with overlap_comm and one bucket that holds every gradient, at the boundary (grad_accum 1): each gradient
    is copied into the bucket as it arrives and its .grad becomes a view of it
    (reduce_ready_partitions_and_remove_grads -> reduce_independent_p_g_buckets_and_remove_grads), so no whole
    gradient is held beside the buckets (measured: docs/measurements/memory.md, `buffers.buckets_in_backward`)."""
    return (
        cfg.zero_stage == 1
        and cfg.overlap_comm
        and cfg.grad_accum == 1
        and not bf16_optimizer(cfg)
        and not stage1_reduces_in_backward(spec, cfg, layout)
    )


def stage1_late_partition(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> bool:
    """Stage 1 without overlap_comm where one bucket holds every gradient (grad_accum 1): the boundary's reduction
    (reduce_gradients) copies every gradient into the bucket and reduces it into the partition, and at its worst timing
    one more partition is live at the end of backward, beside the whole gradients and the bucket, one the collective's
    worker thread releases late (`late_freed_partition`, a timing-dependent term: docs/memory.md; measured: issue 51's
    Llama bf16 with a 5e7 bucket, one step of four 194,891,292 B against the estimate without it at the end of backward
    185,999,124, one 8,894,208 B partition; the stand-in bf16 with 4e6, one step of four, one 1,262,720 B partition)."""
    return (
        cfg.zero_stage == 1
        and not cfg.overlap_comm
        and cfg.grad_accum == 1
        and cfg.method == "full"
        and not cfg.offload_optimizer
        and not bf16_optimizer(cfg)
        and layout.reduce_bucket_size >= spec.num_params
    )


def stage1_grad_bytes(cfg: TrainConfig) -> int:
    """Bytes per element of the whole gradients stages 0-1 hold: the model's, but fp32 at stage 1 in 16 bits with fp32
    accumulation through the ZeRO optimizer (not the `bf16_optimizer`): each gradient becomes a fp32 `grad_accum` on
    arrival, kept across micro steps (stage_1_and_2.py use_grad_accum_attribute, _fill_param_grad_accum_attribute;
    measured: docs/measurements/memory.md)."""
    if (
        cfg.zero_stage == 1
        and cfg.grad_accum_dtype == "fp32"
        and dtype_bytes(cfg.precision) != 4
        and not bf16_optimizer(cfg)
    ):
        return 4
    return dtype_bytes(cfg.precision)


def offload_accumulates_on_host(cfg: TrainConfig) -> bool:
    """Whether ZeRO-Offload carries the gradients between micro steps in host buffers: stage 2 in 16 bits with
    grad_accum > 1 keeps `accumulated_grads_in_cpu`, one whole buffer per parameter of the rank's partition, made at
    the first micro step and kept for the run (stage_1_and_2.py async_accumulate_grad_in_cpu_via_gpu). They replace
    the device's carried partition (`accumulated_gradients`). Not with bf16 master weights or fp32 accumulation, and
    not priced at ZeRO-1 or in fp32, where they were not measured to hold (measured: docs/measurements/memory.md)."""
    return (
        cfg.offload_optimizer
        and cfg.zero_stage == 2
        and cfg.grad_accum > 1
        and cfg.precision != "fp32"
        and cfg.grad_accum_dtype != "fp32"
        and not cfg.bf16_master_weights_and_grads
    )


def whole_gradient_bytes(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> int:
    """Under `stage1_reduces_in_backward`: the gradients larger than the reduce bucket, which
    bypass it and stay whole in .grad until the step (stage_1_and_2.py extra_large_param_to_reduce),
    in the dtype stage 1 holds whole gradients in (`stage1_grad_bytes`)."""
    bucket = layout.reduce_bucket_size
    return stage1_grad_bytes(cfg) * sum(n for n in param_numels(spec) if n > bucket)


def partition_grad_bytes(cfg: TrainConfig) -> int:
    """Bytes per element of the reduced gradient partition: the accumulation dtype (fp32 when
    grad_accum_dtype says so; stage_1_and_2.py get_flat_partition(dtype=gradient_accumulation_dtype),
    stage3.py grad_partitions_flat_buffer), else the model's."""
    return 4 if cfg.grad_accum_dtype == "fp32" else dtype_bytes(cfg.precision)


def partition_elements(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """Elements of stages 1-2's reduced-gradient buffer on the rank that holds the most. DeepSpeed sizes it by whole
    parameters: every parameter that starts in the rank's share or straddles its start counts in full
    (stage_1_and_2.py copy_grads_in_partition, get_partition_info), the flat buffer padded to 2 x ranks
    (nccl_start_alignment_factor). LoRA's adapters, and lora.py's adapter view: P / ranks (measured:
    docs/measurements/memory.md)."""
    if cfg.method != "full":
        return spec.num_params // cluster.world_size
    return _whole_parameter_partition(spec, cluster.world_size)


def offload_fp32_partition(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """ZeRO-Offload at stage 2 in 16 bits with fp32 accumulation: the reduction writes into a compact fp32 partition on
    the device (stage_1_and_2.py _build_compact_grad_partition_buffer; the offloaded step copies from it,
    async_inplace_copy_grad_to_fp32_buffer_from_gpu), the padded flat share rather than the whole-parameter one, kept
    through the step and across micro steps. Bytes; 0 for any other configuration (measured:
    docs/measurements/memory.md)."""
    if not (
        cfg.offload_optimizer
        and cfg.zero_stage == 2
        and cfg.grad_accum_dtype == "fp32"
        and dtype_bytes(cfg.precision) != 4
    ):
        return 0
    if cfg.method != "full":
        return 4 * (spec.num_params // cluster.world_size)
    return 4 * _padded_partition(spec.num_params, cluster.world_size)


def compact_fp32_partition(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """Stage 2 in 16 bits with fp32 accumulation, without offload: the reduction adds into a compact fp32 partition
    (stage_1_and_2.py `_use_compact_grad_partition_buffer` -> _build_compact_grad_partition_buffer, the padded flat
    share), and copy_grads_in_partition returns before it would make the 16-bit whole-parameter partition. Bytes; 0
    for any other configuration (offload's is `offload_fp32_partition`; measured: docs/measurements/memory.md,
    "Issue 51")."""
    if (
        cfg.offload_optimizer
        or cfg.zero_stage != 2
        or cfg.grad_accum_dtype != "fp32"
        or dtype_bytes(cfg.precision) == 4
    ):
        return 0
    return 4 * _padded_partition(spec.num_params, cluster.world_size)


def reduces_first_at_head(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> bool:
    """Whether the first reduction of stage 2 (or of stage 1 with overlap_comm, `stage1_reduces_in_backward`), which
    allocates the gradient partition (copy_grads_in_partition, or the compact fp32 one), comes at the LM head's
    gradient: the head's V x h gradient is larger than the bucket, so it
    bypasses it (extra_large_param_to_reduce) and is reduced when the next gradient arrives (the final norm's).
    With a bucket that holds it, nothing is reduced until the gradients that arrived exceed the bucket
    (reduce_independent_p_g_buckets_and_remove_grads), some way into the layers' backward; LoRA's frozen head has no
    gradient, and a tied head's reaches the embedding's weight only at the end of backward, where autograd sums its two
    parts (measured: docs/measurements/memory.md, "Issue 51")."""
    return (
        cfg.method == "full"
        and not spec.tied_embeddings
        and spec.vocab_size * spec.hidden_size > layout.reduce_bucket_size
    )


def _padded_partition(elements: int, ranks: int) -> int:
    """Each rank's share of the flat buffer, padded to a multiple of 2 x ranks
    (nccl_start_alignment_factor)."""
    align = 2 * ranks
    return -(-elements // align) * align // ranks


def reduced_partition_bytes(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """Stage 2's reduced-gradient partition during and at the end of backward: the compact fp32 one
    under offload with fp32 accumulation (`offload_fp32_partition`), else the whole-parameter
    partition in the accumulation dtype."""
    compact = offload_fp32_partition(spec, cluster, cfg) or compact_fp32_partition(spec, cluster, cfg)
    return compact or partition_grad_bytes(cfg) * partition_elements(spec, cluster, cfg)


@cache
def _whole_parameter_partition(spec: ModelSpec, ranks: int) -> int:
    numels = param_numels(spec)  # the optimizer's order: the module's parameters, a tied one once
    if sum(numels) != spec.num_params:  # not the module's own parameters (LoRA's adapter view)
        return spec.num_params // ranks
    part = _padded_partition(sum(numels), ranks)
    most = 0
    for r in range(ranks):
        start, end, at, total = r * part, (r + 1) * part, 0, 0
        for n in numels:
            if start <= at < end or at < start < at + n:
                total += n
            at += n
        most = max(most, total)
    return most


def held_extra_large_gradient(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> int:
    """A layer gradient larger than the reduce bucket, held while backward goes on: at stage 2 it bypasses the bucket
    and is reduced in place only when the next gradient arrives (stage_1_and_2.py extra_large_param_to_reduce), so
    the largest such is priced, in the model's dtype. None below stage 2 or for LoRA (adapters fit the bucket)
    (measured: docs/measurements/memory.md)."""
    if cfg.zero_stage != 2 or cfg.method != "full":
        return 0
    bucket = layout.reduce_bucket_size
    return dtype_bytes(cfg.precision) * max((n for n in layer_numels(spec) if n > bucket), default=0)


def late_freed_gradient(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> int:
    """Beside `held_extra_large_gradient`, at its worst timing: the extra-large gradient reduced before it, which the
    collective's worker thread still holds when the next one is made (a timing-dependent term, TIMING_TERMS; measured
    on OPT, the LM head's gradient beside a layer's, and on Phi-3, two MLP weights': docs/measurements/memory.md).
    The larger of an untied head's gradient larger than the bucket and the largest layer gradient."""
    largest = held_extra_large_gradient(spec, cfg, layout)
    if not largest:
        return 0
    head = spec.vocab_size * spec.hidden_size if not spec.tied_embeddings else 0
    return max(largest, dtype_bytes(cfg.precision) * head if head > layout.reduce_bucket_size else 0)


TIMING_TERMS = ("late_freed_partition", "late_freed_gradient", "tp_logits_gather")
"""Terms priced at their worst timing: tensors a collective's worker thread releases late, after the main thread
dropped them, so that some steps hold them at the peak and others do not (docs/memory.md, "Peaks that depend on
timing"). A run whose steps never met that timing reads over by them."""


def reduce_bucket_bytes(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> int:
    """Stages 1-2's contiguous-gradients bucket(s): reduce_bucket_size elements, a second with overlap_comm
    (stage_1_and_2.py setup_buckets, "double buffers"), in the model's dtype (_gradient_reduction_buffer_dtype) or at
    stage 1 the accumulation dtype (use_grad_accum_attribute). Measured: tests/test_knobs.py."""
    if cfg.zero_stage not in (1, 2) or bf16_optimizer(cfg):
        return 0
    eb = partition_grad_bytes(cfg) if cfg.zero_stage == 1 else dtype_bytes(cfg.precision)
    return eb * layout.reduce_bucket_size * (2 if cfg.overlap_comm else 1)


def backward_buffers(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout) -> int:
    """Buffers live at the end of backward, when gradients are reduced: stage 0 (world > 1) the flattened all-reduce
    copy (STAGE0_ALLREDUCE_ELEMENTS); stage 1 the reduced partition beside the whole gradients, and the bucket
    (stage_1_and_2.py reduce_gradients), less the whole gradients the first bucket took
    (`stage1_first_bucket_elements`); stage 2 the bucket; stage 3 nothing (its bucket is a state,
    model_states.states, and its prefetch peaks before the head, model_states.zero3_prefetch). One bucket that holds
    every gradient at stage 1: the partition replaces the whole gradients, which become views of the bucket
    (reduce_independent_p_g_buckets_and_remove_grads) (measured: docs/measurements/memory.md)."""
    pb = dtype_bytes(cfg.precision)
    if cfg.zero_stage == 0:
        return pb * min(spec.num_params, STAGE0_ALLREDUCE_ELEMENTS) if cluster.world_size > 1 else 0
    if cfg.zero_stage == 1:
        if bf16_optimizer(cfg):
            return 0
        if stage1_reduces_in_backward(spec, cfg, layout):  # the partition is a gradient there (backward_gradients)
            return reduce_bucket_bytes(spec, cfg, layout)
        part = partition_grad_bytes(cfg) * partition_elements(spec, cluster, cfg)
        if layout.reduce_bucket_size >= spec.num_params:
            # one bucket holds every gradient: the partition replaces the whole gradients (docstring)
            return reduce_bucket_bytes(spec, cfg, layout)
        moved = stage1_grad_bytes(cfg) * stage1_first_bucket_elements(spec, cfg, layout)
        return max(0, part - moved) + reduce_bucket_bytes(spec, cfg, layout)
    if cfg.zero_stage == 2:
        return reduce_bucket_bytes(spec, cfg, layout)
    return 0


def stage1_first_bucket_elements(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> int:
    """Stage 1 without overlap_comm reduces at the boundary (stage_1_and_2.py reduce_gradients): in the optimizer's
    parameter order each gradient is copied into the bucket and its .grad becomes a view of it, which frees the whole
    one (reduce_independent_p_g_buckets_and_remove_grads), and the partition is allocated at the first reduction
    (reduce_ipg_grads -> copy_grads_in_partition), when a gradient no longer fits. So at that peak the gradients of the
    first bucket are no longer whole: their elements, the leading parameters that fit the bucket (0 where the first one
    is larger: it bypasses the bucket and stays whole). Full fine-tuning, grad_accum 1, without offload, where the
    bucket is smaller than the model (issue 51: a 2e6 bucket on its Llama at ZeRO-1 fp32 read +5.6%, the first
    bucket's 1,938,816 elements; measured: benchmarks/knobs_on_hf.py)."""
    if (
        cfg.zero_stage != 1
        or cfg.overlap_comm
        or cfg.method != "full"
        or cfg.grad_accum > 1
        or cfg.offload_optimizer
        or bf16_optimizer(cfg)
        or layout.reduce_bucket_size >= spec.num_params
    ):
        return 0
    total = 0
    for n in param_numels(spec):
        if total + n > layout.reduce_bucket_size:
            break
        total += n
    return total


def backward_end_extra(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout) -> dict[str, int]:
    """What the end of backward holds besides states and gradients. At stages 0-1 the embedding gradient's transient is
    over before the reduction starts, so the larger of the two counts; at stages 2-3 the reduction runs during
    backward and the two add up (measured: a tied GPT-2 peaks at the former, an untied Llama at the latter)."""
    comm = backward_buffers(spec, cluster, cfg, layout)
    emb = embedding_gradient_transient(spec, cluster, cfg)
    if stage1_gradients_in_bucket(spec, cfg, layout):  # the partition is not among `gradients` there
        part = partition_grad_bytes(cfg) * partition_elements(spec, cluster, cfg)
        return {"gradient_partition": part, **stage2_end_of_one_bucket(spec, cluster, cfg, layout)}
    if cfg.zero_stage <= 1 and not stage1_reduces_in_backward(spec, cfg, layout):
        out = {"comm_buffers": comm} if comm >= emb else {"embedding_gradient": emb}
        if stage1_late_partition(spec, cfg, layout):
            out["late_freed_partition"] = partition_grad_bytes(cfg) * partition_elements(spec, cluster, cfg)
        return out
    if cfg.zero_stage == 1:
        return {"comm_buffers": comm, "embedding_gradient": emb}
    if stage2_reduces_at_end(spec, cfg, layout) and cfg.grad_accum == 1:
        return stage2_end_of_one_bucket(spec, cluster, cfg, layout)
    out = {"comm_buffers": comm, "embedding_gradient": emb}
    if cfg.zero_stage == 2 and cfg.grad_accum > 1 and not cfg.offload_optimizer:
        # the gradients accumulated so far beside the partition the last micro step reduces into
        # (stage_1_and_2.py independent_gradient_partition_epilogue: all_grad_tensors; not with cpu_offload)
        out["accumulated_partition"] = partition_grad_bytes(cfg) * partition_elements(spec, cluster, cfg)
    if offload_fp32_partition(spec, cluster, cfg):
        # the input embedding's gradient, the last one backward makes, reduced into a fp32 copy still live at the end
        out["reduced_fp32_embedding"] = 4 * spec.vocab_size * spec.hidden_size
    return out


def stage2_end_of_one_bucket(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout) -> dict[str, int]:
    """The end of backward where one bucket holds every gradient (`stage2_reduces_at_end`, and stage 1's
    `stage1_gradients_in_bucket`, the same reduction): the epilogue reduces the bucket into the partition
    copy_grads_in_partition allocates and copies it once more (independent_gradient_partition_epilogue:
    get_flat_partition) while the buckets are held. At its worst timing a third partition is still live, one the
    collective's worker thread releases late (`late_freed_partition`, a timing-dependent term: docs/memory.md), except
    where the reduction adds into the compact fp32 partition in place (`compact_fp32_partition`: issue 51's Llama bf16
    with fp32 accumulation held none with a 5e7 bucket in two runs of 16 steps on 2 ranks, with 5e8 in one)
    (measured: docs/measurements/memory.md)."""
    part = partition_grad_bytes(cfg) * partition_elements(spec, cluster, cfg)
    out = {
        "comm_buffers": reduce_bucket_bytes(spec, cfg, layout),
        "epilogue_partition": part,
        "late_freed_partition": 0 if compact_fp32_partition(spec, cluster, cfg) else part,
    }
    if cfg.grad_accum_dtype == "fp32" and dtype_bytes(cfg.precision) != 4:
        out["reduced_fp32_head"] = 4 * spec.vocab_size * spec.hidden_size
    return out


def accumulated_gradients(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """Gradients carried from one micro batch to the next when grad_accum > 1: the full gradients
    at stages 0 and 1, the reduced partition at stage 2 (stage 3's buffer is always held). Stage 1
    reduces only at the accumulation boundary, so until then every parameter's .grad is whole
    (measured: docs/measurements/memory.md)."""
    if cfg.grad_accum == 1 or cfg.zero_stage == 3 or offload_accumulates_on_host(cfg):
        return 0  # ZeRO-Offload's host buffers carry them (model_states.offload_buffers)
    compact = offload_fp32_partition(spec, cluster, cfg)
    if compact:
        return compact
    pb = dtype_bytes(cfg.precision)
    if cfg.zero_stage <= 1:
        return stage1_grad_bytes(cfg) * spec.num_params
    return pb * partition_elements(spec, cluster, cfg)


def carried_reduce_bucket(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> int:
    """Stage 1's reduce bucket(s) between micro steps when grad_accum > 1: setup_buckets allocates them at every
    backward and only the boundary's epilogue releases them (stage_1_and_2.py independent_gradient_partition_epilogue
    -> _release_ipg_buffers), so the next forward and the loss's backward hold them. Stage 2 reduces, and releases
    them, on every micro step (measured: docs/measurements/memory.md)."""
    if cfg.zero_stage != 1 or cfg.grad_accum == 1:
        return 0
    return reduce_bucket_bytes(spec, cfg, layout)


def backward_gradients(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout) -> int:
    """Gradients alive at the end of backward, before the step converts them: the whole gradients at stages 0-1 (stage 1
    reduces only at the end, partition_gradients=False in stage_1_and_2.py; measured), the reduced partition at stage
    2, none beyond the state at stage 3."""
    if stage1_reduces_in_backward(spec, cfg, layout):
        return whole_gradient_bytes(spec, cfg, layout) + partition_grad_bytes(cfg) * partition_elements(
            spec, cluster, cfg
        )
    if stage1_gradients_in_bucket(spec, cfg, layout):
        return 0  # views of the bucket (comm_buffers)
    if cfg.zero_stage <= 1:
        return stage1_grad_bytes(cfg) * spec.num_params
    if cfg.zero_stage == 2:
        return reduced_partition_bytes(spec, cluster, cfg)
    return 0


def embedding_gradient_transient(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """Extra bytes while the embedding's gradient is made at the end of backward: a tied head's and the lookup's V x h
    gradients beside their sum (aten::mm < MmBackward0, embedding_dense_backward, aten::add); stages 2-3 also hold
    the embedding gradient until it is reduced, stage 3 from a copy (aten::clone < c10d::_reduce_scatter_base_).
    Measured: benchmarks/memory_accuracy.py."""
    pb = dtype_bytes(cfg.precision)
    vh = pb * spec.vocab_size * spec.hidden_size
    if cfg.zero_stage == 3:
        return 2 * vh  # measured the same with tied and untied embeddings (benchmarks/memory_accuracy.py)
    n = 2 * vh if spec.tied_embeddings else 0
    if cfg.zero_stage == 2:
        n += vh
    return n


def gradients_during_backward(
    spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout, layers_done: int
) -> int:
    """Gradients held once the LM head and `layers_done` blocks have run backward: those blocks'
    and the head's at stages 0-1 (full gradients are kept), the partition and the reduce bucket
    at stage 2, nothing beyond the persistent buffers at stage 3. Stage 1 with overlap_comm reduces
    as it goes (`stage1_reduces_in_backward`): the whole-kept ones, the partition and the buckets."""
    if cfg.zero_stage <= 1:
        head = spec.vocab_size * spec.hidden_size + spec.norm_params
        done = stage1_grad_bytes(cfg) * (head + layers_done * spec.layer_params)
        if stage1_reduces_in_backward(spec, cfg, layout):
            buckets = reduce_bucket_bytes(spec, cfg, layout) if cfg.grad_accum == 1 else 0  # else carried
            return (
                min(done, whole_gradient_bytes(spec, cfg, layout))
                + buckets
                + partition_grad_bytes(cfg) * partition_elements(spec, cluster, cfg)
            )
        return 0 if stage1_gradients_in_bucket(spec, cfg, layout) else done  # the buckets: buckets_in_backward
    if cfg.zero_stage == 2 and stage2_reduces_at_end(spec, cfg, layout):
        return 0  # views of the bucket (buckets_in_backward); the partition comes at the end
    if cfg.zero_stage == 2:
        return reduced_partition_bytes(spec, cluster, cfg) + reduce_bucket_bytes(spec, cfg, layout)
    return 0


def head_gradient_bytes(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout) -> dict[str, int]:
    """The LM head's weight gradient right after the loss's backward, while every layer's activations are saved: twice
    at stage 3 (reduce-scattered from a copy, aten::clone < c10d::_reduce_scatter_base_); stage 2's first reduction
    allocates the whole partition and the bucket there (stage_1_and_2.py copy_grads_in_partition; found by the traced
    tier on a 55.6M Llama, 5.9% under without it)."""
    pb = dtype_bytes(cfg.precision)
    vh = pb * spec.vocab_size * spec.hidden_size
    out = {"head_gradient": 2 * vh if cfg.zero_stage == 3 else vh}
    if stage1_reduces_in_backward(spec, cfg, layout):
        # the partition from the first reduction on: at the head's gradient where it is larger than the bucket, else
        # where the gradients that arrived overflow the bucket, as at stage 2 (copy_grads_in_partition runs at stage 1
        # too; the traced tier's 'backward (first reduction)'); the buckets, unless carried from the micro steps before
        # (carried_reduce_bucket)
        if reduces_first_at_head(spec, cfg, layout) or cfg.grad_accum > 1:
            out["gradient_partition"] = partition_grad_bytes(cfg) * partition_elements(spec, cluster, cfg)
        out["comm_buffers"] = reduce_bucket_bytes(spec, cfg, layout) if cfg.grad_accum == 1 else 0
    if cfg.zero_stage == 2 and offload_fp32_partition(spec, cluster, cfg):
        # the compact fp32 partition, made here at the first micro step (later ones carry it:
        # `accumulated_gradients`), and the 16-bit staging beside it on the rank that owns the head
        compact = offload_fp32_partition(spec, cluster, cfg) if cfg.grad_accum == 1 else 0
        out["gradient_partition"] = compact + dtype_bytes(cfg.precision) * partition_elements(spec, cluster, cfg)
        out["comm_buffers"] = reduce_bucket_bytes(spec, cfg, layout)
        out["reduced_fp32_head"] = 4 * spec.vocab_size * spec.hidden_size
    elif stage2_reduces_at_end(spec, cfg, layout):
        out["comm_buffers"] = reduce_bucket_bytes(spec, cfg, layout)  # the partition only at the end of backward
    elif cfg.zero_stage == 2 and not reduces_first_at_head(spec, cfg, layout):
        out["comm_buffers"] = reduce_bucket_bytes(spec, cfg, layout)  # the head's gradient is copied into it
    elif cfg.zero_stage == 2:
        part = partition_elements(spec, cluster, cfg)
        out["gradient_partition"] = reduced_partition_bytes(spec, cluster, cfg)
        out["comm_buffers"] = reduce_bucket_bytes(spec, cfg, layout)
        if layout.reduce_bucket_size >= spec.num_params:
            # one bucket holds every gradient: a second partition is live here in some runs (measured), priced as held
            out["gradient_partition"] += dtype_bytes(cfg.precision) * part
        if cfg.grad_accum_dtype == "fp32" and pb != 4:
            # fp32 accumulation: the head's reduced gradient is added into the compact fp32 partition through a
            # fp32 copy of it (stage_1_and_2.py allreduce_and_copy_with_multiple_ranks -> _add_to_grad_partition_
            # buffer; measured: 4 V h bytes at the peak, beside the compact partition, no 16-bit one)
            out["reduced_fp32_head"] = 4 * spec.vocab_size * spec.hidden_size
    return out


def gloo_allgather_bytes(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, trainable: int) -> int:
    """The temporary of the all-gather that ends stages 1-2's step on CPU ranks: gloo gathers into a new tensor of the
    whole flat 16-bit group, world x partition elements, and copies out of it (stage_1_and_2.py `step` ->
    runtime/utils.py all_gather_dp_groups -> dist.all_gather_into_tensor; torch ProcessGroupGloo.cpp
    AsyncAllgatherWork::allgather, `flatOutputTensor = newLikeFlat(outputs[0])`), after the step's gradients and
    temporaries are freed (`allgather_phase`). NCCL gathers in place (ProcessGroupNCCL::_allgather_base), so 0 off
    CPU; 0 at stages 0 and 3 and on one rank (measured: docs/measurements/memory.md). The `bf16_optimizer` gathers
    its bf16 flat group through the same call (bf16_optimizer.py update_lp_params -> all_gather_dp_groups)."""
    if cfg.zero_stage not in (1, 2) or not cluster.gpu.is_cpu or cluster.world_size == 1:
        return 0
    return dtype_bytes(cfg.precision) * _padded_partition(trainable, cluster.world_size) * cluster.world_size


STEP_ONLY_TERMS = ("gradients", "optimizer_temporaries")
"""The optimizer phase's terms the all-gather after the update no longer holds (`gloo_allgather_bytes`)."""


def allgather_phase(
    spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, trainable: int, phases: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """`phases` with "optimizer (all-gather)": the optimizer phase without the step's gradients and
    temporaries, with gloo's all-gather output (`gloo_allgather_bytes`); unchanged where that is 0. The
    `bf16_optimizer`'s bf16 gradients are still live there (freed by the engine's zero_grad after the step:
    engine.py _take_model_step): at 4 ranks and more this phase is its step's peak (2P against 8P/N)."""
    held = gloo_allgather_bytes(spec, cluster, cfg, trainable)
    if not held or "optimizer" not in phases:
        return phases
    freed = ("optimizer_temporaries",) if bf16_optimizer(cfg) else STEP_ONLY_TERMS
    after = {k: v for k, v in phases["optimizer"].items() if k not in freed}
    return {**phases, "optimizer (all-gather)": {**after, "gloo_allgather_output": held}}
