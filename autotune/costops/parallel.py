"""Tensor and sequence parallelism in the cost model: what one rank computes (`shard_price`) and the collectives the
parallelism adds (`tp_comm_s`, `ulysses_comm_s`, costmodel.simulate's `tp_comm` and `sp_comm`); the reasoning in full
is in docs/measurements/costmodel.md ("costops.parallel").

- AutoTP: a rank runs memory/tensor_parallel.py's `local_model` (heads, KV heads and intermediate / tp, hidden whole; an
untied head V / tp wide with its logits gathered, `colwise_rep`; a tied one vocabulary-parallel). Per layer and micro
step two all-reduces of b x s x h in forward (AutoTP's row-parallel LinearAllreduce, deepspeed/module_inject/layers.py)
and two in backward (LinearLayer's input gradients), again in a checkpointed layer's recompute (Shoeybi et al. 2019,
Megatron-LM, arXiv:1909.08053, sec. 3 and fig. 4); an untied head's one all-gather of the logits. - Ulysses: each rank
runs every op outside attention on seq / sp tokens (UlyssesSPDataLoaderAdapter) and attention on the whole sequence for
heads / sp of the heads (UlyssesSPAttentionHF, runtime/sequence_parallel/ulysses_sp.py; Jacobs et al. 2023,
DeepSpeed-Ulysses, arXiv:2309.14509, sec. 3, fig. 1), which for a flash kernel linear in its heads is the full-sequence
price / sp. Per layer all-to-alls of q, k, v and the output in forward (`_combine_local_sequences`,
`_partition_global_sequence`), again in backward (deepspeed/sequence/layer.py `_DimZeroAllToAll`) and in a recompute,
each rank sending M / P of an aggregate M (sec. 3.2: 4Nh/P per layer); k and v at KV heads x head dim, repeated up to sp
(`kv_replication_factor`)."""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Callable

ALLREDUCES_PER_LAYER = 4
"""2 in forward + 2 in backward (Megatron-LM sec. 3)."""

FORWARD_ALLREDUCES_PER_LAYER = 2
"""What a checkpointed layer's recomputed forward all-reduces again (Megatron-LM sec. 3: two in forward)."""


def sequence_parallel_size(cfg) -> int:
    """Ulysses ranks of `cfg` (TrainConfig.sequence_parallel_size)."""
    return cfg.sequence_parallel_size


def tp_group(cluster, tp: int):
    """The cluster one tp group spans: tp ranks within a node (DeepSpeed's mesh puts tp innermost,
    utils/groups.py _init_tp_mesh_device), or whole nodes when tp exceeds a node."""
    if tp <= cluster.gpus_per_node:
        return dataclasses.replace(cluster, num_nodes=1, gpus_per_node=tp)
    return dataclasses.replace(cluster, num_nodes=tp // cluster.gpus_per_node)


def sp_group(cluster, tp: int, sp: int):
    """The cluster one Ulysses group's all-to-all crosses: sp ranks within a node when the tp x sp ranks beside
    each other fit in one (tp innermost, as tp_group), else sp ranks spread over nodes, bounded by the network
    as any collective that leaves a node (costmodel.link_bytes_per_s)."""
    if tp * sp <= cluster.gpus_per_node:
        return dataclasses.replace(cluster, num_nodes=1, gpus_per_node=sp)
    nodes = max(2, min(sp, tp * sp // cluster.gpus_per_node))
    return dataclasses.replace(cluster, num_nodes=nodes, gpus_per_node=max(1, sp // nodes))


def tp_comm_s(model, cfg, cluster, link_bytes_per_s: Callable, dtype_bytes: int) -> float:
    """Seconds of TP collectives in one micro step on a ring over the tp group (0 without tensor parallelism).
    `link_bytes_per_s(cluster)` is the cost model's bus bandwidth of a ring collective on that cluster."""
    tp = cfg.autotp_size
    if tp == 1:
        return 0.0
    link = link_bytes_per_s(tp_group(cluster, tp))
    tokens = cfg.micro_batch * (cfg.seq_len // sequence_parallel_size(cfg))  # this rank's tokens
    activation = tokens * model.hidden_size * dtype_bytes
    ring = (tp - 1) / tp  # bytes each rank sends per byte of the tensor: reduce-scatter or all-gather half
    per_layer = 2 * ring * activation / link  # ring all-reduce: 2 halves
    seconds = (model.num_layers * ALLREDUCES_PER_LAYER + cfg.ckpt_layers * FORWARD_ALLREDUCES_PER_LAYER) * per_layer
    if not model.tied_embeddings:
        seconds += ring * tokens * model.vocab_size * dtype_bytes / link  # the head's gathered logits
    return seconds


def ulysses_bytes_per_layer(model, cfg, dtype_bytes: int) -> float:
    """Bytes one rank holds in the four all-to-alls of a layer's forward (q, k, v and the attention output), its
    share of the aggregate message: micro batch x seq / sp tokens x (heads + 2 KV heads, repeated up to sp, + heads)
    x head dim / tp (a tp rank holds heads / tp of them)."""
    tp, sp = cfg.autotp_size, sequence_parallel_size(cfg)
    tokens = cfg.micro_batch * (cfg.seq_len // sp)
    heads, kv = model.num_heads // tp, max(model.num_kv_heads // tp, sp)
    return tokens * (2 * heads + 2 * kv) * model.head_dim * dtype_bytes


def ulysses_comm_s(model, cfg, cluster, link_bytes_per_s: Callable, dtype_bytes: int) -> float:
    """Seconds of Ulysses all-to-alls in one micro step (0 without sequence parallelism): per layer the forward's
    four, the backward's four, and a checkpointed layer's recomputed four. An all-to-all of S bytes per rank over
    n ranks sends (n-1)/n S from each rank, at the bus bandwidth of `link_bytes_per_s` (nccl-tests
    doc/PERFORMANCE.md: alltoall bus bandwidth = algorithm bandwidth x (n-1)/n); for large n that is
    DeepSpeed-Ulysses' M/P per link (S = M/P)."""
    sp = sequence_parallel_size(cfg)
    if sp == 1:
        return 0.0
    link = link_bytes_per_s(sp_group(cluster, cfg.autotp_size, sp))
    once = (sp - 1) / sp * ulysses_bytes_per_layer(model, cfg, dtype_bytes) / link
    return (2 * model.num_layers + cfg.ckpt_layers) * once


# ---- compute of one rank -----------------------------------------------------------------------
def _narrow_head(op, vocab: int, tp: int):
    """An untied head's GEMM as AutoTP runs it (colwise_rep): its vocabulary dimension V / tp wide. The traced
    local model has the whole V x h head (its logits are whole, as the gathered logits are)."""
    if op.cls != "gemm" or vocab not in op.shape[1:]:
        return op
    batch, *dims = op.shape
    i = len(dims) - 1 - dims[::-1].index(vocab)
    new = list(dims)
    new[i] = -(-vocab // tp)
    m, k, n = dims
    m2, k2, n2 = new
    elems = lambda a, b, c: a * b + b * c + a * c  # noqa: E731 - the three matrices a GEMM reads and writes
    return dataclasses.replace(
        op,
        flops=op.flops * new[i] / vocab,
        nbytes=round(op.nbytes * elems(m2, k2, n2) / elems(m, k, n)),
        shape=(batch, *new),
    )


def _sums(profile, num_layers: int, key: tuple, sustained: float, kernel: str, head=None):
    """Seconds per term of a profile (as costops.price), one block's forward, and one block's forward attention."""
    from autotune.costops import op_s

    per = {"gemm": 0.0, "attention": 0.0, "elementwise": 0.0}
    kernels = 0
    for part, times in ((profile.layer, num_layers), (profile.rest, 1)):
        for op, n in part:
            priced = head(op) if head is not None and part is profile.rest else op
            per[op.term or op.cls] += times * n * op_s(priced, key, sustained, kernel)
            kernels += times * n
    fwd = [(op, n) for op, n in profile.layer if op.phase == "fwd"]
    layer_fwd = sum(n * op_s(op, key, sustained, kernel) for op, n in fwd)
    attn_fwd = sum(n * op_s(op, key, sustained, kernel) for op, n in fwd if (op.term or op.cls) == "attention")
    return per, layer_fwd, attn_fwd, kernels


@cache
def shard_price(
    model,
    tp: int,
    sp: int,
    implementation: str,
    precision: str,
    attention: str,
    micro_batch: int,
    seq_len: int,
    key: tuple,
    sustained: float = 1.0,
    attention_kernel: str = "flash2",
):
    """Forward+backward of one micro step on one rank of a tp x sp group (module docstring), as a
    costops.ComputePrice: the tp shard's ops at seq / sp tokens, its attention kernels those of the full sequence
    / sp, the untied head's GEMMs V / tp wide. tp = sp = 1 is costops.micro_step_price."""
    from autotune.costops import ComputePrice, _profile, micro_step_price

    if tp == 1 and sp == 1:
        return micro_step_price(
            model, implementation, precision, attention, micro_batch, seq_len, key, sustained, attention_kernel
        )
    local = model
    if tp > 1:
        from autotune.memory.tensor_parallel import local_model

        local = local_model(model, tp)
    head = None
    if tp > 1 and not model.tied_embeddings:

        def head(op):
            return _narrow_head(op, model.vocab_size, tp)

    L = model.num_layers
    mine = _profile(local, implementation, precision, attention, micro_batch, seq_len // sp)
    per, layer_fwd, attn_fwd, kernels = _sums(mine, L, key, sustained, attention_kernel, head)
    if sp > 1:
        whole = _profile(local, implementation, precision, attention, micro_batch, seq_len)
        per_w, _, attn_fwd_w, _ = _sums(whole, L, key, sustained, attention_kernel)
        per["attention"] = per_w["attention"] / sp
        layer_fwd += attn_fwd_w / sp - attn_fwd
    return ComputePrice(
        gemm=per["gemm"],
        attention=per["attention"],
        elementwise=per["elementwise"],
        layer_forward=layer_fwd,
        kernels=kernels,
    )
