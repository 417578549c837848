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
    """ZeRO-1 with bf16 weights and fp32 gradient accumulation runs DeepSpeed's BF16_Optimizer, not
    the ZeRO optimizer (engine._do_optimizer_sanity_check returns BFLOAT16): it keeps fp32 gradients
    of every parameter (bf16_optimizer.py, fp32_groups_gradients; measured 4 B/param live from the
    first step on) and has no reduce bucket (measured: the same peak with reduce_bucket_size 4e6 and
    overlap_comm)."""
    return (
        cfg.zero_stage == 1 and cfg.precision == "bf16" and cfg.grad_accum_dtype == "fp32" and not cfg.offload_optimizer
    )


def stage1_reduces_in_backward(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> bool:
    """ZeRO-1 with overlap_comm reduces during backward, as stage 2 does (stage_1_and_2.py
    process_gradients: `partition_gradients or overlap_comm`), on the accumulation boundary's micro
    step: each gradient is copied into the reduce bucket and its .grad becomes a view of the bucket
    (reduce_independent_p_g_buckets_and_remove_grads), the reduced partition is allocated at the
    first reduction, and a gradient larger than the bucket bypasses it and stays whole (stage 1
    never clears .grad). So whole gradients are held only for those (`whole_gradient_bytes`), and
    the partition and the two buckets exist while backward runs. Measured on transformers' GPT-2
    and Llama (2 CPU ranks, fp32, buckets 16,384 to 3e5 elements, grad_accum 1-2); full fine-tuning
    only (LoRA's adapters were measured within 1% without this). Not where one bucket holds every
    gradient (reduce_bucket_size >= P): it never fills, so nothing is reduced before the boundary's
    epilogue, and the whole gradients are priced as without overlap_comm (measured on the stand-in,
    tests/test_knobs.py: 3.9% and 5.0% under priced this way)."""
    return (
        cfg.zero_stage == 1
        and cfg.overlap_comm
        and not bf16_optimizer(cfg)
        and cfg.method == "full"
        and layout.reduce_bucket_size < spec.num_params
    )


def stage2_reduces_at_end(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> bool:
    """Stage 2 with one reduce bucket that holds every gradient (reduce_bucket_size >= P): the bucket
    never fills, so nothing is reduced before the boundary's epilogue (stage_1_and_2.py
    reduce_independent_p_g_buckets_and_remove_grads reduces only when the next gradient does not fit;
    independent_gradient_partition_epilogue -> reduce_ipg_grads), and the gradient partition, which
    copy_grads_in_partition allocates at the first reduction, exists only from the end of backward on
    (_release_ipg_buffers frees it after the step). Through backward each gradient is a view of the
    bucket. Measured: transformers' Llama (hf_memory.py's shape), ZeRO-2 bf16, overlap_comm, bucket
    2e7, 2 CPU ranks: the peak is in the layers' backward, the two buckets (80,000,000 B) and the
    saved activations, no partition; priced with the partition from the head's gradient on it was
    +2.31%, without it -0.39%. Not with offload (its own buffers, `offload_fp32_partition`)."""
    return cfg.zero_stage == 2 and not cfg.offload_optimizer and layout.reduce_bucket_size >= spec.num_params


def buckets_in_backward(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> int:
    """The reduce bucket(s) through the layers' backward where nothing is reduced there (the
    reductions price their own): process_gradients calls setup_buckets at the first gradient hook
    (the LM head's), which allocates the bucket, two with overlap_comm, whether or not anything is
    reduced before the boundary (stage_1_and_2.py process_gradients, setup_buckets): stage 1
    without `stage1_reduces_in_backward`, stage 2 where `stage2_reduces_at_end`. Measured:
    transformers' Llama (hf_memory.py's shape), ZeRO-1 fp32, overlap_comm, reduce bucket 2e7
    elements, 2 CPU ranks: the peak is in the layers' backward, 160,000,000 B of buckets
    (AccumulateGrad rows) beside the saved activations; -2.27% under without them, -0.34% with.
    At stage 1 with grad_accum > 1 they are carried from the micro steps before
    (`carried_reduce_bucket`)."""
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
    """Stage 1 with overlap_comm and one bucket that holds every gradient, at the boundary
    (grad_accum 1): each gradient is copied into the bucket as it arrives and its .grad becomes a
    view of it (reduce_ready_partitions_and_remove_grads -> reduce_independent_p_g_buckets_and_remove_grads,
    called at the accumulation boundary), so no whole gradient is held beside the buckets: the
    measured peak of the case in `buckets_in_backward` holds none (the AccumulateGrad rows
    are the two buckets only)."""
    return (
        cfg.zero_stage == 1
        and cfg.overlap_comm
        and cfg.grad_accum == 1
        and not bf16_optimizer(cfg)
        and not stage1_reduces_in_backward(spec, cfg, layout)
    )


def stage1_grad_bytes(cfg: TrainConfig) -> int:
    """Bytes per element of the whole gradients stages 0-1 hold: the model's, but at stage 1 in 16
    bits with fp32 accumulation through the ZeRO optimizer (with offload; without it the
    BF16_Optimizer, `bf16_optimizer`) fp32: each gradient is converted to a fp32 `grad_accum` as it
    arrives and the 16-bit one dropped (stage_1_and_2.py use_grad_accum_attribute,
    _fill_param_grad_accum_attribute), kept across micro steps. Measured: transformers' GPT-2, ZeRO-1
    bf16 offload with fp32 accumulation on 2 CPU ranks: the end of backward 4.2 MB above the estimate
    that held them in bf16 (P x 2 B = 2.24 MB of it)."""
    if (
        cfg.zero_stage == 1
        and cfg.grad_accum_dtype == "fp32"
        and dtype_bytes(cfg.precision) != 4
        and not bf16_optimizer(cfg)
    ):
        return 4
    return dtype_bytes(cfg.precision)


def offload_accumulates_on_host(cfg: TrainConfig) -> bool:
    """Whether ZeRO-Offload carries the gradients between micro steps in host buffers: at stage 2 in
    16 bits with grad_accum > 1, `accumulated_grads_in_cpu`, one buffer in the model dtype per
    parameter of the rank's partition, each whole (stage_1_and_2.py
    async_accumulate_grad_in_cpu_via_gpu: torch.zeros(param.numel()), made at the first micro step
    and kept for the run); not with bf16 master weights (they accumulate into the fp32 partition)
    nor with fp32 accumulation (a compact partition buffer). They replace the device's carried
    partition (buffers.accumulated_gradients) and, kept, are also there at the optimizer step.
    Measured: transformers' GPT-2 and Llama, ZeRO-2 bf16 offload, grad_accum 2 and 3, micro batch 1
    and 3, 2 CPU ranks: the estimate without them was 6.24% under at the step (1,189,564 B; 594,816
    elements x 2 B = 1,189,632), with them +0.00%. Not priced where it was not measured to hold:
    ZeRO-1 (its estimate holds whole gradients between micro steps, +5.3% over with offload; +11.9%
    with these buffers added) and fp32 ZeRO-2 (-1.1% without, +8.1% with them); both open
    (docs/memory.md)."""
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
    """Elements of the reduced-gradient buffer of stages 1-2 on the rank that holds the most. DeepSpeed
    sizes it by whole parameters: every parameter that starts in the rank's partition or straddles its
    start counts in full (stage_1_and_2.py copy_grads_in_partition: total_size over
    params_in_partition; get_partition_info), the partition being the flat buffer, padded to a
    multiple of 2 x ranks (nccl_start_alignment_factor), split evenly. Measured on transformers'
    GPT-2 (1.12M parameters, 2 CPU ranks, ZeRO-2 fp32): rank 1's buffer is 594,816 elements where
    P/2 is 560,512, the layer-1 attention weight straddling the boundary. LoRA's adapters: P / ranks,
    also for memory/lora.py's adapter view (a spec whose parameter count is the adapters', not its
    module's: the module's own parameters would price the base's partition, 20-28% over on the
    recorded LoRA runs at ZeRO-2 with grad_accum 2, benchmarks/lora_memory.py)."""
    if cfg.method != "full":
        return spec.num_params // cluster.world_size
    return _whole_parameter_partition(spec, cluster.world_size)


def offload_fp32_partition(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """ZeRO-Offload at stage 2 with 16-bit weights and fp32 gradient accumulation: the reduction writes
    into a compact fp32 partition on the device (stage_1_and_2.py _use_compact_grad_partition_buffer,
    _build_compact_grad_partition_buffer: torch.zeros(partition_size, gradient_accumulation_dtype) on
    the accelerator; the offloaded step copies from it, async_inplace_copy_grad_to_fp32_buffer_from_gpu).
    It is the partition the flat buffer is split into (padded to 2 x ranks), not the whole-parameter
    one, made at the first reduction and kept through the step, and across micro steps where
    grad_accum > 1. Bytes; 0 for every other configuration. Measured: transformers' GPT-2 (1.12M
    parameters), ZeRO-2 bf16 offload with fp32 accumulation on 2 CPU ranks, micro batch 1, k 2,
    grad_accum 1 and 2, with and without overlap_comm: the step holds 2,241,956 B above the
    estimate without it (560,512 fp32 elements: 2,242,048 B); the second micro step's forward holds
    it in place of the 16-bit partition; the end of backward holds it and the embedding gradient's
    fp32 reduction (4 V h; `backward_end_extra`)."""
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


def _padded_partition(elements: int, ranks: int) -> int:
    """Each rank's share of the flat buffer, padded to a multiple of 2 x ranks
    (nccl_start_alignment_factor)."""
    align = 2 * ranks
    return -(-elements // align) * align // ranks


def reduced_partition_bytes(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """Stage 2's reduced-gradient partition during and at the end of backward: the compact fp32 one
    under offload with fp32 accumulation (`offload_fp32_partition`), else the whole-parameter
    partition in the accumulation dtype."""
    return offload_fp32_partition(spec, cluster, cfg) or partition_grad_bytes(cfg) * partition_elements(
        spec, cluster, cfg
    )


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
    """A layer's gradient larger than the reduce bucket, held while backward goes on: at stage 2 with
    contiguous gradients such a gradient bypasses the bucket and is reduced in place only when the
    next parameter's gradient arrives (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads,
    extra_large_param_to_reduce), so one is live through the layers' backward; the largest is priced,
    in the model's dtype. Measured on transformers' GPT-2 (2 CPU ranks, ZeRO-2 fp32, bucket 16,384
    elements): rank 1's backward peak holds one 65,536-element MLP weight's gradient beside the
    partition and the bucket. None below stage 2 (reduced at the end, autotune's default) or for LoRA
    (adapters are smaller than the bucket)."""
    if cfg.zero_stage != 2 or cfg.method != "full":
        return 0
    bucket = layout.reduce_bucket_size
    return dtype_bytes(cfg.precision) * max((n for n in layer_numels(spec) if n > bucket), default=0)


def reduce_bucket_bytes(spec: ModelSpec, cfg: TrainConfig, layout: Layout) -> int:
    """Stages 1-2's contiguous-gradients bucket(s): reduce_bucket_size elements each, allocated at
    the first gradient of every backward (stage_1_and_2.py setup_buckets), a second one with
    overlap_comm ("double buffers", same function). Their dtype is the model's
    (_gradient_reduction_buffer_dtype), the accumulation dtype only at stage 1 with a separate one
    (use_grad_accum_attribute). Measured with reduce_bucket_size 4e6 on tiny-llama (tests/test_knobs.py)."""
    if cfg.zero_stage not in (1, 2) or bf16_optimizer(cfg):
        return 0
    eb = partition_grad_bytes(cfg) if cfg.zero_stage == 1 else dtype_bytes(cfg.precision)
    return eb * layout.reduce_bucket_size * (2 if cfg.overlap_comm else 1)


def backward_buffers(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout) -> int:
    """Buffers live at the end of backward, when gradients are reduced.

    - Stage 0 (world > 1): the flattened copy of the gradients being all-reduced.
    - Stage 1: the reduced partition, filled while the full gradients are still held.
    - Stages 1-2: the contiguous-gradients bucket `ipg_buffer` (reduce_bucket_size elements in
      the model dtype; stage_1_and_2.py, reduce_gradients / backward_prologue; one bucket because
      autotune sets overlap_comm false at these stages).
    - Stage 3: nothing here; its reduce bucket is held for the whole run (model_states.states). The
      last module's fetch frees the last prefetch buffer, so none is live at the end of backward
      (measured: the same backward peak, 14,584,485 B on tiny-llama bf16, with
      stage3_prefetch_bucket_size 1, 0.9 h^2, 5e4, 2e5, 5e5 and 4e6); the prefetch's own peak is
      before the LM head's forward (model_states.zero3_prefetch).
    """
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
            # One bucket holds every gradient: the epilogue copies each whole gradient into it and
            # makes its .grad a view of the bucket, which frees the whole one
            # (reduce_independent_p_g_buckets_and_remove_grads: `grad_reduc.data = new_grad_tensor...`),
            # and only then reduces, into the partition allocated there. So the partition (1/N of
            # the gradients, in a dtype no wider) replaces the whole gradients rather than joining
            # them, and the end of backward is the gradients and the bucket. Measured on the stand-in (tiny-llama,
            # ZeRO-1 bf16, bucket 4e6, 2 CPU ranks): steady steps 20,635,424 B, the states, the whole
            # gradients and the bucket to 8 KB; one step of one rank in one run held the partition
            # as well (+1,262,876 B), gloo's late free, the race stage2_end_of_one_bucket leaves unpriced.
            return reduce_bucket_bytes(spec, cfg, layout)
        return part + reduce_bucket_bytes(spec, cfg, layout)
    if cfg.zero_stage == 2:
        return reduce_bucket_bytes(spec, cfg, layout)
    return 0


def backward_end_extra(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout) -> dict[str, int]:
    """What the end of backward holds besides states and gradients. At stages 0-1 the embedding
    gradient's transient is over before the reduction starts, so the larger of the two counts
    (measured: a tied GPT-2 peaks at the former, an untied Llama at the latter); at stages 2-3
    the reduction runs during backward and the two add up."""
    comm = backward_buffers(spec, cluster, cfg, layout)
    emb = embedding_gradient_transient(spec, cluster, cfg)
    if stage1_gradients_in_bucket(spec, cfg, layout):  # the partition is not among `gradients` there
        part = partition_grad_bytes(cfg) * partition_elements(spec, cluster, cfg)
        return {"gradient_partition": part, **stage2_end_of_one_bucket(spec, cluster, cfg, layout)}
    if cfg.zero_stage <= 1 and not stage1_reduces_in_backward(spec, cfg, layout):
        return {"comm_buffers": comm} if comm >= emb else {"embedding_gradient": emb}
    if cfg.zero_stage == 1:
        return {"comm_buffers": comm, "embedding_gradient": emb}
    if stage2_reduces_at_end(spec, cfg, layout) and cfg.grad_accum == 1:
        return stage2_end_of_one_bucket(spec, cluster, cfg, layout)
    out = {"comm_buffers": comm, "embedding_gradient": emb}
    if cfg.zero_stage == 2 and cfg.grad_accum > 1 and not cfg.offload_optimizer:
        # With grad_accum > 1 stage 2's epilogue keeps the gradients accumulated so far
        # (stage_1_and_2.py independent_gradient_partition_epilogue: all_grad_tensors, added to on
        # every micro step; not with cpu_offload) beside the partition the last micro step reduces
        # into: a second partition at the end of backward. Measured on transformers' GPT-2, ZeRO-2 on 2 CPU ranks,
        # grad_accum 2 and 3 (`python benchmarks/random_trials.py --seed 2` drew it): fp32 was
        # 2.1% to 3.2% under without it, and rank 1's end of backward holds two 594,816-element
        # fp32 partitions; bf16's end of backward measured 13,084,192 B, 10% above the estimate
        # without it (its peak is the step's, so the total was right).
        out["accumulated_partition"] = partition_grad_bytes(cfg) * partition_elements(spec, cluster, cfg)
    if offload_fp32_partition(spec, cluster, cfg):
        # the input embedding's gradient, the last one backward makes, reduced into an fp32 copy
        # that is still live when backward ends (measured: +1,048,576 B = 4 V h on GPT-2, above)
        out["reduced_fp32_embedding"] = 4 * spec.vocab_size * spec.hidden_size
    return out


def stage2_end_of_one_bucket(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout) -> dict[str, int]:
    """The end of backward where one bucket holds every gradient (`stage2_reduces_at_end`, and stage 1
    with overlap_comm, `stage1_gradients_in_bucket`, which runs the same reduction): the
    epilogue reduces the bucket into the partition copy_grads_in_partition allocates (`gradients`),
    and copies it once more (independent_gradient_partition_epilogue: the flat partition of
    get_flat_partition beside it) while the buckets are still held; the embedding's gradient is a view
    of the bucket by then. Measured on the stand-in (tiny-llama, 2 CPU ranks, 4e6 bucket, micro batch
    1, seq 32): bf16 20,627,228 B = states + the bucket + two 1,262,720 B partitions, to the byte;
    fp32 with overlap_comm 49,678,108 B, two fp32 partitions; bf16 with fp32 accumulation
    24,201,244 B, two fp32 partitions and the head's gradient reduced in fp32 (4 V h); stage 1 the
    same (fp32 with overlap_comm 49,678,108 B, bf16 28,627,228 B). A third partition is live in some
    runs on CPU ranks (bf16: one step of four; fp32 overlap_comm: both steps of one rank in one run of
    two, 52,203,804 B): gloo's worker thread freeing a buffer late, a race NCCL does not have. The
    schedule is priced, not the race: with it priced as held, Llama's ZeRO-2 fp32 run with a 2e6
    bucket and every layer checkpointed read +7.9% (benchmarks/knobs_on_hf.py), without it +0.4%."""
    part = partition_grad_bytes(cfg) * partition_elements(spec, cluster, cfg)
    out = {"comm_buffers": reduce_bucket_bytes(spec, cfg, layout), "epilogue_partition": part}
    if cfg.grad_accum_dtype == "fp32" and dtype_bytes(cfg.precision) != 4:
        out["reduced_fp32_head"] = 4 * spec.vocab_size * spec.hidden_size
    return out


def accumulated_gradients(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """Gradients carried from one micro batch to the next when grad_accum > 1: the full gradients
    at stages 0 and 1, the reduced partition at stage 2 (stage 3's buffer is always held). Stage 1
    reduces only at the accumulation boundary, so until then every parameter's .grad is whole
    (measured: transformers' GPT-2 and the stand-in, ZeRO-1 fp32 micro batch 3 grad_accum 2 on 2
    CPU ranks, forward peak 2.1 MB, P/2 x 4 B, above the partition's pricing)."""
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
    """Stage 1's reduce bucket(s) between micro steps when grad_accum > 1: setup_buckets allocates
    them at every backward, and only the accumulation boundary's epilogue releases them
    (stage_1_and_2.py independent_gradient_partition_epilogue -> _release_ipg_buffers; stage 1
    reduces only there), so the next micro step's forward and the loss's backward hold them.
    Measured: transformers' tiny-llama, ZeRO-1 fp32 grad_accum 2, 2 CPU ranks: the forward and
    backward peaks rise by 4 B per bucket element (reduce_bucket_size 5e4 and 3e5 against the
    default), 1,201,376 and 1,198,984 B above the estimate without it with 3e5 (-4.57%).
    Stage 2 reduces, and releases them, on every micro step."""
    if cfg.zero_stage != 1 or cfg.grad_accum == 1:
        return 0
    return reduce_bucket_bytes(spec, cfg, layout)


def backward_gradients(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout) -> int:
    """Gradients alive at the end of backward (before the step converts them).

    Stage 0: the full gradients. Stage 1 (measured on CPU, DeepSpeed 0.19.8): the full gradients
    too, until the step (stage_1_and_2.py, partition_gradients=False); the reduced partition is
    filled beside them at the end (see `backward_end_extra`). Stage 2: the reduced partition.
    """
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
    """Extra bytes while the embedding's gradient is produced at the end of backward.

    Tied embeddings: the LM head's gradient and the lookup's gradient (V x h each) coexist with
    their sum (measured: aten::mm < MmBackward0, embedding_dense_backward, aten::add). Stages 2
    and 3 also hold the embedding gradient itself until it is reduced (stage 3 reduce-scatters a
    copy of it: aten::clone < c10d::_reduce_scatter_base_), since neither keeps full gradients.
    """
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
    """The LM head's weight gradient right after the loss's backward, while every layer's
    activations are still saved. Stage 3 reduce-scatters it from a copy (measured:
    aten::clone < c10d::_reduce_scatter_base_), so it counts twice there. Stage 2's first
    reduction allocates the whole gradient partition and the reduce bucket (stage_1_and_2.py,
    copy_grads_in_partition; found by the traced tier on a 55.6M Llama, stage 2: 5.9% under
    without it)."""
    pb = dtype_bytes(cfg.precision)
    vh = pb * spec.vocab_size * spec.hidden_size
    out = {"head_gradient": 2 * vh if cfg.zero_stage == 3 else vh}
    if stage1_reduces_in_backward(spec, cfg, layout):
        # the partition from the first reduction on, priced from the head's gradient on (where the
        # bucket is larger than it, the first reduction comes a few layers later: priced as here);
        # the buckets, unless carried from the micro steps before (carried_reduce_bucket)
        out["gradient_partition"] = partition_grad_bytes(cfg) * partition_elements(spec, cluster, cfg)
        out["comm_buffers"] = reduce_bucket_bytes(spec, cfg, layout) if cfg.grad_accum == 1 else 0
    if cfg.zero_stage == 2 and offload_fp32_partition(spec, cluster, cfg):
        # the compact fp32 partition, made here at the first micro step (later ones carry it:
        # `accumulated_gradients`), and the 16-bit staging beside it on the rank that owns the head
        # (measured: transformers' tiny-llama, micro batch 3, grad_accum 1: rank 1's peak is here,
        # 1,195,532 B above the phase without the staging partition; rank 0's is the loss's)
        compact = offload_fp32_partition(spec, cluster, cfg) if cfg.grad_accum == 1 else 0
        out["gradient_partition"] = compact + dtype_bytes(cfg.precision) * partition_elements(spec, cluster, cfg)
        out["comm_buffers"] = reduce_bucket_bytes(spec, cfg, layout)
        out["reduced_fp32_head"] = 4 * spec.vocab_size * spec.hidden_size
    elif stage2_reduces_at_end(spec, cfg, layout):
        out["comm_buffers"] = reduce_bucket_bytes(spec, cfg, layout)  # the partition only at the end of backward
    elif cfg.zero_stage == 2:
        part = partition_elements(spec, cluster, cfg)
        out["gradient_partition"] = partition_grad_bytes(cfg) * part
        out["comm_buffers"] = reduce_bucket_bytes(spec, cfg, layout)
        if layout.reduce_bucket_size >= spec.num_params:
            # One bucket holds every gradient: in some runs a second partition is live at this point
            # of one step (measured on tiny-llama with reduce_bucket_size 4e6, with and without
            # overlap_comm: +P/N x 2 B in one run of two); priced as held, since a peak is a maximum.
            out["gradient_partition"] += dtype_bytes(cfg.precision) * part
        if cfg.grad_accum_dtype == "fp32" and pb != 4:
            # fp32 accumulation: the 16-bit partition stays beside the fp32 one, and the head's reduced
            # gradient is upcast (stage_1_and_2.py: "ZeRO-2 keeps low-precision staging and stores
            # the fp32 communication result in the owned partition"; measured: +2P/N + 4Vh bytes).
            out["gradient_partition"] += pb * part
            out["reduced_fp32_head"] = 4 * spec.vocab_size * spec.hidden_size
    return out


def gloo_allgather_bytes(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, trainable: int) -> int:
    """The temporary of the all-gather that ends stages 1-2's optimizer step on CPU ranks (gloo): a tensor of
    the whole flat 16-bit (model-dtype) group, every rank's updated partition. After the update DeepSpeed
    all-gathers the partitions into the flat model (stage_1_and_2.py `step`: all_gather_dp_groups after the
    per-group loop; runtime/utils.py all_gather_dp_groups -> all_gather_into_tensor_dp_groups ->
    dist.all_gather_into_tensor(group_flat, partition)); torch's gloo backend does not write into that output:
    ProcessGroupGloo::_allgather_base chunks it and calls allgather, whose AsyncAllgatherWork::allgather gathers
    into `flatOutputTensor = newLikeFlat(outputs[0])`, world x partition elements, and copies out of it
    (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp). By then the step's gradients and the update's
    temporaries are freed (`single_partition_of_fp32_groups[i].grad = None`, `averaged_gradients[i] = None`),
    so that point holds the states and this tensor: `allgather_phase`. The flat group is the trainable
    parameters padded to 2 x ranks (nccl_start_alignment_factor; `_padded_partition`). Measured: transformers'
    Llama of benchmarks/hf_memory.py (1,205,376 parameters), ZeRO-2 fp32 on 4 CPU ranks, micro batch 1, seq 96,
    one checkpointed layer: with Ulysses sp 2 every rank's step peak is the optimizer's, 13,259,228 B, the states
    (8,437,632 B) and one tensor of 4,821,504 B allocated by c10d::_allgather_base_ (P x 4 B): estimated
    13,284,172 B (+0.19%), 5.9% under without it; without sp the optimizer phase measured the same 13,259,228 B
    (this phase 13,259,980 B, the update's 12,054,604 B), below that run's backward peak (13,825,312 B, estimated
    +0.13%). It is the step's peak only where it exceeds the update's
    fp32 gradient partition and two temporaries (12 B per partition element without a fused optimizer): fp32
    from 4 ranks on (at 2 it is below them, which is why the 2-rank runs never showed it), 16-bit from 7.
    Gloo only: NCCL gathers into the output tensor itself (ProcessGroupNCCL::_allgather_base passes the output's
    buffer to ncclAllGather), so 0 off CPU. Not the BF16_Optimizer (`bf16_optimizer`): its step holds the whole
    16-bit gradients beside its fp32 ones, more than this tensor. 0 at stages 0 and 3 and on one rank."""
    if cfg.zero_stage not in (1, 2) or not cluster.gpu.is_cpu or cluster.world_size == 1 or bf16_optimizer(cfg):
        return 0
    return dtype_bytes(cfg.precision) * _padded_partition(trainable, cluster.world_size) * cluster.world_size


STEP_ONLY_TERMS = ("gradients", "optimizer_temporaries")
"""The optimizer phase's terms the all-gather after the update no longer holds (`gloo_allgather_bytes`)."""


def allgather_phase(
    spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, trainable: int, phases: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """`phases` with "optimizer (all-gather)": the optimizer phase without the step's gradients and
    temporaries, with gloo's all-gather output (`gloo_allgather_bytes`); unchanged where that is 0."""
    held = gloo_allgather_bytes(spec, cluster, cfg, trainable)
    if not held or "optimizer" not in phases:
        return phases
    after = {k: v for k, v in phases["optimizer"].items() if k not in STEP_ONLY_TERMS}
    return {**phases, "optimizer (all-gather)": {**after, "gloo_allgather_output": held}}
