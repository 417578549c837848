"""Tensor parallelism (DeepSpeed AutoTP) as the memory model sees it: one rank of a tp group holds a narrower model,
which ZeRO shards over the dp = world / tp ranks. `local_view` turns (model, cluster, cfg) into that rank's own, with
autotp_size 1, which the rest of memory/ prices unchanged (memory/__init__.estimate).

What AutoTP shards (deepspeed 0.19.8 engine._apply_autotp_partitioning, from the model's HF tp_plan, e.g.
LlamaConfig.base_model_tp_plan; measured: the parameter shapes after deepspeed.initialize, docs/parallelism.md): q, k,
v, up and gate column-wise, o and down row-wise (a row-wise bias stays whole), so heads, KV heads and intermediate / tp
with hidden whole; norms replicated; an untied head column-wise with its output gathered (`colwise_rep`: weight V / tp x
h, whole logits) beside a whole input embedding; a tied head and embedding vocabulary-parallel (AutoTP's
vocab_parallel_lm_head: both V / tp x h, logits V / tp, sequence/cross_entropy.py's loss)."""

from __future__ import annotations

import dataclasses
from functools import cache

from autotune.errors import SpecError
from autotune.hardware import Cluster
from autotune.impl.hf import VOCAB_PARALLEL_LOSS
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig

SHARDED_KEYS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
"""The Hugging Face config keys a rank's shard divides by tp (the families AutoTP trains here: Llama,
Qwen2 and their kin; GPT-2-style configs are refused before this, autotune/parallel.py)."""


def local_view(model: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> tuple[ModelSpec, Cluster, TrainConfig]:
    """One tp rank's model, the dp ranks ZeRO shards over, and cfg without tensor parallelism."""
    tp = cfg.autotp_size
    if tp == 1:
        return model, cluster, cfg
    local = local_model(model, tp)
    if cfg.zero_stage == 3:
        local = dataclasses.replace(local, param_count=zero3_partitioned(model, local, tp))
    return local, dp_cluster(cluster, tp), dataclasses.replace(cfg, autotp_size=1)


def zero3_largest_group(model: ModelSpec, cfg: TrainConfig) -> int | None:
    """Elements of the larger flat group of a ZeRO-3 shard, which model_states.step_terms steps (memory/layout.py
    Layout); None without AutoTP at ZeRO-3. Stage 3 keeps the parameters AutoTP shards (partitioned over dp) and
    those it leaves whole (over the world) in separate groups and steps them one after the other (measured:
    docs/measurements/memory.md)."""
    tp = cfg.autotp_size
    if tp == 1 or cfg.zero_stage != 3:
        return None
    local = local_model(model, tp)
    return zero3_partitioned(model, local, tp) - -(-replicated_params(model, local, tp) // tp)


def zero3_world_gathered(model: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """Bytes of the R parameters AutoTP leaves whole that ZeRO-3 gathers and holds beyond what the rest of memory/
    counts for the shard: partitioned over the world, gathered whole in forward and held through backward. With dp 1
    the rest of memory/ counts no gather, so all R; with dp > 1 model_states.zero3_gathered counts R / tp of them
    (zero3_partitioned), so R - R / tp (measured: docs/measurements/memory.md)."""
    tp = cfg.autotp_size
    if tp == 1 or cfg.zero_stage != 3:
        return 0
    from autotune.train_config import dtype_bytes

    r = replicated_params(model, local_model(model, tp), tp)
    return dtype_bytes(cfg.precision) * (r if cluster.world_size == tp else r - -(-r // tp))


LOGITS_GATHER_PHASES = ("forward", "backward (loss)")
"""Where the untied head's logits gather may still be held (`sharded_head`): from the logits to the loss's backward."""


def sharded_head(model: ModelSpec, cfg: TrainConfig, phases: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """`phases` with the LM head's gradient of an untied model's shard: the traced shard has the whole V x h head (its
    gathered logits are whole, as AutoTP's are) but AutoTP's head is V / tp x h, so is its weight gradient (the
    `head_gradient` term). And at its worst timing the gather of its logits: module_inject/layers.py
    GatherFromTensorParallelRegion gathers the rank's V / tp shard into a new buffer of all of them
    (all_gather_into_tensor) and concatenates it; the buffer and the shard are released by the collective's worker
    thread, in some steps only after the loss's backward has begun (`tp_logits_gather`, b s (V + V / tp) in the
    logits' dtype, a timing-dependent term: docs/memory.md; measured on Llama and Mistral, tp 2 ZeRO-1 fp32, the
    largest steps 1.5 whole logits above the others)."""
    tp = cfg.autotp_size
    if tp == 1 or model.tied_embeddings:
        return phases
    from autotune.train_config import dtype_bytes

    vocab = model.vocab_size
    gather = dtype_bytes(cfg.precision) * cfg.micro_batch * cfg.seq_len * (vocab + -(-vocab // tp))
    return {
        name: {k: (-(-v // tp) if k == "head_gradient" else v) for k, v in terms.items()}
        | ({"tp_logits_gather": gather} if name in LOGITS_GATHER_PHASES else {})
        for name, terms in phases.items()
    }


def replicated_params(model: ModelSpec, local: ModelSpec, tp: int) -> int:
    """Elements every tp rank holds whole (embedding of an untied model, norms, row-wise biases): with P the
    model's count and L one rank's, L = S / tp + R and P = S + R, so R = (tp L - P) / (tp - 1)."""
    return (tp * local.num_params - model.num_params) // (tp - 1)


def zero3_partitioned(model: ModelSpec, local: ModelSpec, tp: int) -> int:
    """ZeRO-3's count of one rank's shard as dp ranks partition it: the model is built under zero.Init before AutoTP
    makes its groups, so the parameters AutoTP leaves whole stay partitioned over the world and only its shards are
    partitioned again over dp (engine._apply_autotp_partitioning: "AutoTP replaces the weights it shards when the
    model was built under zero.Init"): S / (tp dp) + R / (tp dp) per rank, as a count over dp L - R + R / tp
    (measured: docs/measurements/memory.md)."""
    r = replicated_params(model, local, tp)
    return local.num_params - r + -(-r // tp)


def dp_cluster(cluster: Cluster, tp: int) -> Cluster:
    """The cluster as ZeRO sees it: world / tp ranks of the same device (only the world size and the
    device enter the memory terms). tp within a node (the usual layout, DeepSpeed's mesh puts tp innermost:
    utils/groups.py _init_tp_mesh_device) leaves gpus_per_node / tp ranks per node."""
    if cluster.gpus_per_node % tp == 0:
        return dataclasses.replace(cluster, gpus_per_node=cluster.gpus_per_node // tp)
    return dataclasses.replace(cluster, num_nodes=cluster.world_size // tp, gpus_per_node=1)


@cache  # a ModelSpec is hashable (hf_config is left out of its hash); one meta build per (model, tp)
def local_model(model: ModelSpec, tp: int) -> ModelSpec:
    """The model one tp rank holds, as a ModelSpec of the narrower Hugging Face config with its exact
    parameter count (the meta-device build of autotune.models.hf_config.spec_from_config)."""
    from transformers import AutoConfig

    from autotune.models.hf_config import config_dict, spec_from_config

    d = dict(config_dict(model))
    missing = [k for k in SHARDED_KEYS if k not in d]
    if missing:
        raise SpecError(
            f"model {model.name}: autotune prices AutoTP from the config keys {', '.join(SHARDED_KEYS)}; "
            f"its {d.get('model_type')} config lacks {', '.join(missing)}"
        )
    d["head_dim"] = model.head_dim  # kept whole: the heads are split, not narrowed
    d["num_attention_heads"] = model.num_heads // tp
    d["num_key_value_heads"] = model.num_kv_heads // tp
    d["intermediate_size"] = -(-d["intermediate_size"] // tp)  # an uneven split: the largest shard
    if model.tied_embeddings:
        d["vocab_size"] = -(-model.vocab_size // tp)
        d[VOCAB_PARALLEL_LOSS] = True  # the trace runs DeepSpeed's vocabulary-parallel loss (autotune/impl/hf.py)
    mtype = d.pop("model_type")
    local = spec_from_config(
        AutoConfig.for_model(mtype, **_without_derived(d)), name=f"{model.name} (tp {tp} shard)", source=model.source
    )
    if not model.tied_embeddings:
        # the built local model has the whole V x h head; AutoTP's is V / tp x h (colwise_rep)
        head = model.vocab_size * model.hidden_size
        local = dataclasses.replace(local, param_count=local.num_params - head + -(-head // tp))
    return local


def _without_derived(d: dict) -> dict:
    """The config dict without keys PretrainedConfig.to_dict() adds that for_model must not get back."""
    return {k: v for k, v in d.items() if k not in ("transformers_version", "architectures", "_name_or_path")}
