"""Ulysses sequence parallelism (DeepSpeed ALST, runtime/sequence_parallel/ulysses_sp.py) as the memory model sees
it: each of the sp ranks of a group holds every parameter and runs the whole model on seq / sp tokens of each
sequence; only attention, between two all-to-alls, sees the whole sequence, for heads / sp of the heads.
`local_view` turns (model, cluster, cfg) with sequence_parallel_size > 1 into that rank's own (model, cluster, cfg)
with the sequence cut to seq / sp and sequence_parallel_size 1, which every other term of memory/ then prices
unchanged (memory/__init__.estimate calls it beside tensor_parallel.local_view); `all_to_all_terms` adds what the
all-to-alls and the fp32 gradient reduction hold beyond that, `zero3_fp32_head_phase` ZeRO-3's fp32 reduction
of an untied head, and `zero1_fp32_reduce_phase` ZeRO-1's fp32 reduction at the end of backward.

What a rank holds, measured rank by rank (profiler live bytes, benchmarks/parallel_memory.py, docs/parallelism.md):
- parameters, gradients and optimizer states as a plain rank's: ZeRO shards over the sequence-data-parallel group,
  which with tp 1 is the whole world (engine.py: `seq_data_parallel_group` is ZeRO's dp_process_group; its
  allreduce divides by world / sp, summing over the sp ranks), so the cluster is unchanged;
- every activation of the residual stream, the MLP, the norms and the projections at seq / sp tokens;
- attention after the all-to-all: q, k, v at the whole sequence for heads / sp (and KV heads / sp) of the heads,
  the same element count as all heads at seq / sp (UlyssesSPAttentionHF._combine_local_sequences), and sdpa's
  output and log-sum-exp the same: the trace at seq / sp counts them;
- the logits and the loss at seq / sp: each rank computes cross entropy on its own shift_labels (the adapter's
  next tokens, cut with the sequence) and backpropagates its share of the group's token-weighted mean
  (autotune/trial/worker.py sequence_parallel_loss: two scalars more).
"""

from __future__ import annotations

import dataclasses

from autotune.hardware import Cluster
from autotune.memory.layout import Layout
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig


def local_view(model: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> tuple[ModelSpec, Cluster, TrainConfig]:
    """One sp rank's model (whole), the ranks ZeRO shards over (all of them with tp 1), and cfg at seq / sp tokens
    without sequence parallelism. seq_len is a multiple of sp (autotune/parallel.py refuses others)."""
    sp = cfg.sequence_parallel_size
    if sp == 1:
        return model, cluster, cfg
    return model, cluster, dataclasses.replace(cfg, seq_len=-(-cfg.seq_len // sp), sequence_parallel_size=1)


ACTIVATION_PHASES = ("forward", "forward (prefetch)", "backward (loss)", "backward (head)", "backward (layers)")
"""The phases that hold the layers' saved activations (memory/analytic.py, memory/traced.py)."""

RECOMPUTE_PHASES = ("backward (recompute first)", "backward (recompute last)")
"""One checkpointed layer recomputed, its saved set live (memory/analytic.py phases)."""

COMM_DTYPE_BYTES = 4
"""DeepSpeed reduces gradients in `seq_parallel_communication_data_type` once Ulysses is on (runtime/engine.py
_configure_distributed_model: `self.communication_data_type = self._config.seq_parallel_communication_data_type`),
default "fp32" (runtime/constants.py SEQ_PARALLEL_COMMUNICATION_DATA_TYPE_DEFAULT)."""

ALLREDUCE_BUCKET = 500_000_000
"""ZeRO-0's gradient all-reduce bucket in elements (runtime/engine.py allreduce_gradients' MEMORY_OPT_ALLREDUCE_SIZE,
buffered_allreduce_fallback)."""


def all_to_all_terms(model: ModelSpec, cfg: TrainConfig) -> dict[str, dict[str, int]]:
    """Bytes Ulysses adds per phase beyond the trace at seq / sp, {phase: {term: bytes}}; each measured against
    the same model without sp at seq / sp on the same ranks (Llama of benchmarks/hf_memory.py, micro batch 2, seq
    128 at sp 2 against seq 64, 2 CPU ranks, bf16, the profiler's live tensors by allocating op):

    - `sp_attention_output`: o_proj's input, per layer that saves its activations (not checkpointed). Without
      sp it is sdpa's own output, which sdpa saves too (one tensor); with sp it is a copy, the second all-to-all's
      output made contiguous (UlyssesSPAttentionHF._partition_global_sequence, then forward's reshape), while sdpa
      saves its output at heads / sp over the whole sequence: b x seq / sp x heads x head_dim elements more per
      layer. The rest balances: sdpa saves the gathered q, k, v (aten::clone < contiguous, 196,608 B over 4 layers)
      instead of the rotary outputs and v_proj's output (163,840 + 32,768 B). Measured +131,072 B = 4 x 2 x 64 x 128
      x 2 B in forward (+133,112 in all at ZeRO-1). Only when o_proj's weight trains (method full): a frozen base
      o_proj saves no input (LoRA measured without it), and every checkpointed layer saves only its input, one
      layer at a time in its recompute.
    - `sp_kv_replicated`: with sp above the KV heads, each rank repeats its k and v to sp heads before the all-to-all
      (`kv_replication_factor`, ulysses_sp.py _combine_local_sequences) and sdpa saves them: 2 x (sp - kv) x b x
      seq / sp x head_dim elements more per saved layer (read from the code; measured with it: sp 4 on 2 KV heads,
      Qwen2 ZeRO-1 and Llama ZeRO-3 on 4 CPU ranks, -0.41% and -0.50%).
    - `sp_all_to_all_grad`: the last all-to-all's gradient (the first layer's q, b x seq / sp x heads x head_dim)
      stays live past backward into the optimizer step and the next forward (measured: 32,768 B of
      GeneratedBackwardFor_deepspeed_dim_zero_all_to_all_default in every phase's table).
    - `sp_fp32_allreduce`: ZeRO-0 with 16-bit training: the engine all-reduces the flat gradient bucket in fp32
      (COMM_DTYPE_BYTES), a copy of min(trainable, ALLREDUCE_BUCKET) elements at backward's end (runtime/engine.py
      allreduce_bucket: `tensor.to(self.communication_data_type)`; measured +4,820,632 B at backward's end on
      1,205,376 parameters, 4,821,504 B in fp32).
    """
    sp = cfg.sequence_parallel_size
    if sp == 1:
        return {}
    from autotune.train_config import dtype_bytes

    a = dtype_bytes(cfg.precision)
    tokens = cfg.micro_batch * -(-cfg.seq_len // sp)
    q = tokens * model.num_heads * model.head_dim * a
    saved_layers = model.num_layers - cfg.ckpt_layers
    per_layer = (q if cfg.method == "full" else 0) + 2 * max(0, sp - model.num_kv_heads) * tokens * model.head_dim * a
    out: dict[str, dict[str, int]] = {}
    for phase in ACTIVATION_PHASES:
        out[phase] = {"sp_attention_output": saved_layers * per_layer}
    for name in RECOMPUTE_PHASES:
        out[name] = {"sp_attention_output": per_layer}
    for terms in out.values():
        terms["sp_all_to_all_grad"] = q
    out["backward (end)"] = {"sp_all_to_all_grad": q}
    out["optimizer"] = {"sp_all_to_all_grad": q}
    if cfg.zero_stage == 0 and a < COMM_DTYPE_BYTES:
        bucket = min(trainable_params(model, cfg), ALLREDUCE_BUCKET)
        out["backward (end)"]["sp_fp32_allreduce"] = bucket * COMM_DTYPE_BYTES
    return out


LOGITS_TERMS = ("logits_and_loss", "logits_transient")


def zero3_fp32_head_phase(
    model: ModelSpec, cfg: TrainConfig, phases: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """`phases` with ZeRO-3's reduction of the LM head's gradient in fp32 under Ulysses: stage 3 casts a bucket's
    gradients to the communication dtype before reduce-scattering them (runtime/zero/stage3.py __avg_scatter_grads:
    `g.to(communication_data_type)`, fp32 by default with sp, COMM_DTYPE_BYTES), and reduce_scatter_coalesced copies
    that (aten::clone < c10d::_reduce_scatter_base_). The head's V x h gradient, larger than the reduce bucket, goes
    alone, right after the loss's backward, every layer's activations still saved: the phase is the loss's without
    the logits, with 2 x 4 B x V x h (measured: Llama sp 2 x dp 2, ZeRO-3 bf16, 4 CPU ranks: an fp32 clone of
    1,048,576 B in the backward peak, 2,164,753 B above the loss's phase without its logits; -4.8% without it).
    Only with 16-bit training (fp32 gradients are reduced as they are) and an untied head: a tied head's gradient is
    the embedding's too, complete only at the end of backward, when the activations are gone (measured: Qwen2 at the
    same shape, -0.29% without this phase, +4.9% with it)."""
    from autotune.train_config import dtype_bytes

    if (
        cfg.sequence_parallel_size == 1
        or cfg.zero_stage != 3
        or model.tied_embeddings
        or dtype_bytes(cfg.precision) >= COMM_DTYPE_BYTES
    ):
        return phases
    base = phases.get("backward (loss)")
    if base is None:
        return phases
    head = {k: v for k, v in base.items() if k not in LOGITS_TERMS}
    head["sp_fp32_head_reduce"] = 2 * COMM_DTYPE_BYTES * model.vocab_size * model.hidden_size
    return {**phases, "backward (head, fp32 reduce)": head}


def trainable_params(model: ModelSpec, cfg: TrainConfig) -> int:
    if cfg.method == "full":
        return model.num_params
    from autotune.memory.lora import adapter_params

    return adapter_params(model, cfg)


BACKWARD_END_GRADIENT_TERMS = ("gradients", "comm_buffers", "embedding_gradient", "temporaries")
"""The end of backward's gradient terms, which `zero1_fp32_reduce_phase` replaces by its own."""


def zero1_fp32_reduce_phase(
    model: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout, phases: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    """`phases` with "backward (end, fp32 reduce)": ZeRO-1's reduction at the end of backward under Ulysses,
    where each bucket of gradient slices is all-reduced in fp32. Stage 1 reduces at the accumulation boundary
    (stage_1_and_2.py reduce_gradients -> reduce_ready_partitions_and_remove_grads ->
    reduce_independent_p_g_buckets_and_remove_grads, in the flat group's order); a gradient larger than the
    reduce bucket is reduced alone and stays whole until then (extra_large_param_to_reduce); average_tensor
    cuts what is reduced into one slice per owning rank and, with use_multi_rank_bucket_allreduce (DeepSpeed's
    default), gathers consecutive slices until they pass the bucket size (allreduce_and_scatter), and
    allreduce_bucket flattens them (a copy in the model dtype, aten::cat, when there are two or more) and casts
    that to fp32 because sp > 1 (`if pg_correctness_test or self.sequence_parallel_size > 1:
    communication_data_type = torch.float32`; `tensor.to(communication_data_type)`). Beside them: the
    gradients still whole (the extra-large ones not yet copied into this rank's partition; a gradient that fits
    the bucket is copied into it and its .grad becomes a view of it), the rank's partition once its first
    gradient is copied there (copy_grads_in_partition, whole parameters), and the bucket. `_stage1_reduction`
    walks that schedule rank by rank; the phase is its highest point, on the end of backward's other terms.
    Measured: transformers' Mistral of benchmarks/hf_memory.py (668,832 parameters, V x h = 172,800), sp 2 x
    dp 2 on 4 CPU ranks, ZeRO-1 bf16, micro batch 2, seq 64: rank 2's peak, 5,984,060 B, is the LM head's
    reduction: its 5,592 elements of rank 2 and 167,208 of rank 3 flattened together (aten::cat 345,600 B) and
    cast to fp32 (691,200 B), the states, rank 2's partition (672,192 B), the bucket (18,432 B) and 912,384 B
    of whole gradients (the embedding's, the head's, four MLP weights); -5.3% without this phase, +0.21% with it.
    Where a gradient lies in one rank's partition its slice is reduced alone and only the fp32 copy is made:
    for Llama of hf_memory.py at the same shape (its head in rank 3's) this phase is the estimate's peak,
    9,731,028 B against 9,714,140 B measured (+0.17%; -0.56% without it); Qwen2's (a tied head) is below its
    loss's phase. DeepSpeed's own cast, so GPUs (NCCL) make it too. Only with 16-bit training (fp32 is
    reduced as it is), full fine-tuning, and where the ZeRO optimizer reduces at the end (not the
    BF16_Optimizer, overlap_comm or one bucket for every gradient: memory/buffers.py). Stage 2 makes the same
    copies while it reduces during backward; not priced there (its recorded sp runs, bf16 on 2 ranks, are
    within +0.33% without them)."""
    from autotune.memory import buffers
    from autotune.train_config import dtype_bytes

    if (
        cfg.sequence_parallel_size == 1
        or cfg.zero_stage != 1
        or cfg.method != "full"
        or cfg.overlap_comm
        or dtype_bytes(cfg.precision) >= COMM_DTYPE_BYTES
        or buffers.bf16_optimizer(cfg)
        or cluster.world_size == 1
        or "backward (end)" not in phases
        or layout.reduce_bucket_size >= model.num_params
    ):
        return phases
    held = _stage1_reduction(model, cluster, cfg, layout)
    rest = {k: v for k, v in phases["backward (end)"].items() if k not in BACKWARD_END_GRADIENT_TERMS}
    return {**phases, "backward (end, fp32 reduce)": {**rest, **held}}


def _stage1_reduction(model: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout) -> dict[str, int]:
    """The highest point of stage 1's end-of-backward reduction over the ranks, by term (see
    `zero1_fp32_reduce_phase`)."""
    from autotune.memory import buffers
    from autotune.memory.code_trace import param_numels
    from autotune.train_config import dtype_bytes

    numels = param_numels(model)
    ranks, bucket = cluster.world_size, layout.reduce_bucket_size
    part = buffers._padded_partition(sum(numels), ranks)
    starts = [sum(numels[:i]) for i in range(len(numels))]
    grad_b, part_b, pb = buffers.stage1_grad_bytes(cfg), buffers.partition_grad_bytes(cfg), dtype_bytes(cfg.precision)
    fixed = buffers.reduce_bucket_bytes(model, cfg, layout)

    def owners(i: int) -> list[tuple[int, int]]:
        """(rank, elements) of parameter i's slices, in flat order."""
        at, n = starts[i], numels[i]
        return [
            (r, min(at + n, (r + 1) * part) - max(at, r * part))
            for r in range(ranks)
            if at < (r + 1) * part and r * part < at + n
        ]

    best: dict[str, int] = {}
    for rank in range(ranks):
        mine = [i for i in range(len(numels)) if any(r == rank for r, _ in owners(i))]
        partition = part_b * sum(numels[i] for i in mine)
        whole, allocated, pending, elements = grad_b * sum(numels), False, [], 0

        def flush() -> None:
            nonlocal whole, allocated
            if not pending:
                return
            entries: list[list[int]] = []  # [rank, elements]: consecutive slices to one rank merge
            for i in pending:
                for r, n in owners(i):
                    if entries and entries[-1][0] == r:
                        entries[-1][1] += n
                    else:
                        entries.append([r, n])
            groups, size, count = [], 0, 0
            for _, n in entries:
                size, count = size + n, count + 1
                if size > bucket:
                    groups.append((size, count))
                    size, count = 0, 0
            if count:
                groups.append((size, count))
            for size, count in groups:
                point = {
                    "gradients": whole,
                    "gradient_partition": partition if allocated else 0,
                    "comm_buffers": fixed,
                    "reduce_flatten": pb * size if count > 1 else 0,
                    "sp_fp32_reduce": COMM_DTYPE_BYTES * size,
                }
                if sum(point.values()) > sum(best.values()):
                    best.clear()
                    best.update(point)
            for i in pending:
                if i in mine:
                    allocated = True
                    if numels[i] > bucket:
                        whole -= grad_b * numels[i]  # its .grad becomes a view of the partition
            pending.clear()

        for i, n in enumerate(numels):
            if elements + n > bucket:
                flush()
                elements = 0
            if n <= bucket:
                whole -= grad_b * n  # copied into the bucket, its .grad a view of it
            pending.append(i)
            elements += n
        flush()
    return {k: v for k, v in best.items() if v}
