"""Tensor parallelism's collectives per training step (DeepSpeed AutoTP): the per-layer all-reduces of the
row-parallel outputs and of the column-parallel inputs' gradients, and the gathered LM head, on the link the tp
group crosses. costmodel.simulate adds `tp_comm_s` to its breakdown as `tp_comm`.

Per transformer layer and micro batch, Megatron-style tensor parallelism all-reduces the activations twice in
forward (after the attention's output projection and after the MLP's down projection: AutoTP's row-parallel
LinearAllreduce, deepspeed/module_inject/layers.py) and twice in backward (the input gradients of the column-
parallel q/k/v and up/gate projections: LinearLayer's backward all-reduce) (Shoeybi et al. 2019, Megatron-LM,
arXiv:1909.08053, sec. 3 and fig. 4: "two all-reduce operations in the forward path and two in the backward
path"), each of micro batch x seq x hidden elements in the training dtype. An untied head is column-parallel with
its output gathered (tp_plan `colwise_rep`): one all-gather of the logits in forward; a tied head is vocabulary-
parallel (no gather; its loss all-reduces three b x s fp32 vectors, priced as nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

ALLREDUCES_PER_LAYER = 4
"""2 in forward + 2 in backward (Megatron-LM sec. 3)."""


def tp_group(cluster, tp: int):
    """The cluster one tp group spans: tp ranks within a node (DeepSpeed's mesh puts tp innermost,
    utils/groups.py _init_tp_mesh_device), or whole nodes when tp exceeds a node."""
    if tp <= cluster.gpus_per_node:
        return dataclasses.replace(cluster, num_nodes=1, gpus_per_node=tp)
    return dataclasses.replace(cluster, num_nodes=tp // cluster.gpus_per_node)


def tp_comm_s(model, cfg, cluster, link_bytes_per_s: Callable, dtype_bytes: int) -> float:
    """Seconds of TP collectives in one micro step on a ring over the tp group (0 without tensor parallelism).
    `link_bytes_per_s(cluster)` is the cost model's bus bandwidth of a ring collective on that cluster."""
    tp = cfg.autotp_size
    if tp == 1:
        return 0.0
    link = link_bytes_per_s(tp_group(cluster, tp))
    tokens = cfg.micro_batch * cfg.seq_len
    activation = tokens * model.hidden_size * dtype_bytes
    ring = (tp - 1) / tp   # bytes each rank sends per byte of the tensor: reduce-scatter or all-gather half
    seconds = model.num_layers * ALLREDUCES_PER_LAYER * 2 * ring * activation / link   # ring all-reduce: 2 halves
    if not model.tied_embeddings:
        seconds += ring * tokens * model.vocab_size * dtype_bytes / link   # the head's gathered logits
    return seconds
