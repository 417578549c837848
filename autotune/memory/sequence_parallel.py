"""Ulysses sequence parallelism (DeepSpeed ALST, runtime/sequence_parallel/ulysses_sp.py) as the memory model sees it:
each sp rank holds every parameter and runs the whole model on seq / sp tokens of each sequence; only attention,
between two all-to-alls, sees the whole sequence, for heads / sp of the heads (UlyssesSPAttentionHF
_combine_local_sequences: the same element count as all heads at seq / sp).

`local_view` turns (model, cluster, cfg) into one rank's (the sequence cut to seq / sp, sequence_parallel_size 1), which
the rest of memory/ prices unchanged; ZeRO shards over the sequence-data-parallel group, with tp 1 the whole world
(engine.py: `seq_data_parallel_group` is ZeRO's dp_process_group), so the cluster is unchanged; each rank's loss is on
its own shift_labels (autotune/trial/worker.py sequence_parallel_loss). `all_to_all_terms`, `zero3_fp32_head_phase` and
`zero1_fp32_reduce_phase` add what Ulysses holds beyond that. Measured rank by rank (`python
benchmarks/parallel_memory.py`): docs/parallelism.md, docs/measurements/memory.md."""

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
    """Bytes Ulysses adds per phase beyond the trace at seq / sp, {phase: {term: bytes}}:

    `sp_attention_output`: o_proj's input, per saved layer, a copy of the second all-to-all's output
    (UlyssesSPAttentionHF._partition_global_sequence) beside sdpa's own saved output, b x seq / sp x heads x head_dim
    elements more; only when o_proj's weight trains (method full). `sp_kv_replicated`: with sp above the KV heads each
    rank repeats k and v to sp heads before the all-to-all (ulysses_sp.py _combine_local_sequences,
    kv_replication_factor), 2 x (sp - kv) x b x seq / sp x head_dim more per saved layer. `sp_all_to_all_grad`: the last
    all-to-all's gradient (the first layer's q) stays live into the step and the next forward. `sp_fp32_allreduce`:
    ZeRO-0 in 16 bits all-reduces the flat gradient bucket in fp32, min(trainable, ALLREDUCE_BUCKET) elements
    (runtime/engine.py allreduce_bucket: `tensor.to(self.communication_data_type)`) (measured:
    docs/measurements/memory.md)."""
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
    """`phases` with ZeRO-3's reduction of the LM head's gradient in fp32 under Ulysses: stage 3 casts a bucket to the
    communication dtype before reduce-scattering it (stage3.py __avg_scatter_grads: `g.to(communication_data_type)`,
    fp32 with sp) and reduce_scatter_coalesced copies that. The head's V x h gradient, larger than the bucket, goes
    alone right after the loss's backward, every layer's activations saved: the loss's phase without the logits, + 2
    x 4 B x V x h. Only in 16 bits and with an untied head (a tied one completes at the end of backward) (measured:
    docs/measurements/memory.md)."""
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
    """`phases` with "backward (end, fp32 reduce)": ZeRO-1's reduction at the end of backward under Ulysses, each bucket
    of gradient slices all-reduced in fp32. Stage 1 reduces at the boundary in the flat group's order
    (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads), a gradient larger than the bucket alone and
    whole until then (extra_large_param_to_reduce); average_tensor cuts each into one slice per owning rank and, with
    use_multi_rank_bucket_allreduce (the default), gathers consecutive slices past the bucket size
    (allreduce_and_scatter); allreduce_bucket flattens them (aten::cat, two or more) and casts to fp32 because sp > 1
    (`if pg_correctness_test or self.sequence_parallel_size > 1: communication_data_type = torch.float32`).
    `_stage1_reduction` walks that schedule rank by rank. DeepSpeed's own cast, so NCCL makes it too. Only in 16
    bits, full fine-tuning, and where the ZeRO optimizer reduces at the end (not the BF16_Optimizer, overlap_comm or
    one bucket for every gradient); stage 2's same copies during backward are not priced (measured:
    docs/measurements/memory.md)."""
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
