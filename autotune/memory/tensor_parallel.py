"""Tensor parallelism (DeepSpeed AutoTP) as the memory model sees it: one rank of a tp group holds a narrower
model, and ZeRO shards that over the dp = world / tp ranks. `local_view` turns (model, cluster, cfg) with
autotp_size > 1 into that rank's own (model, cluster, cfg) with autotp_size 1, which every other term of
memory/ then prices unchanged (memory/__init__.estimate calls it first).

What AutoTP shards (deepspeed 0.19.8, engine._apply_autotp_partitioning, from the model's HF tp_plan, e.g.
transformers' LlamaConfig.base_model_tp_plan; measured: the parameter shapes after deepspeed.initialize on 2
CPU ranks, docs/parallelism.md):
- q, k, v and the MLP's up/gate projections column-wise (their outputs and biases split by tp), o and down
  projections row-wise (their inputs split; a row-wise bias stays whole): the local model has heads / tp,
  key/value heads / tp and intermediate / tp, hidden unchanged, so its residual activations stay whole;
- norms stay whole (replicated), each rank holding every norm weight;
- an untied LM head column-wise with its output gathered (tp_plan `colwise_rep`): the head's weight is
  V / tp x h, the logits the loss sees are whole; the input embedding stays whole;
- a tied head and embedding vocabulary-parallel (AutoTP's auto vocab_parallel_lm_head, "supersedes the
  configured 'skip' partitioning for tied embedding"): both V / tp x h, logits V / tp, DeepSpeed's
  vocabulary-parallel cross entropy (sequence/cross_entropy.py) on them: the local model has vocab V / tp.
"""

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
    """Elements of the larger flat group of a ZeRO-3 shard (memory/layout.py Layout; model_states.step_terms
    prices its step); None without AutoTP at ZeRO-3. Stage 3 keeps the parameters AutoTP shards (partitioned over
    dp) and those it leaves whole (over the world) in separate groups and steps them one after the other, so the
    update's temporaries are the larger group's (measured: Llama tp 2 ZeRO-3 on 2 CPU ranks, sqrt and div
    1,884,160 B each = 4 B x 471,040, the shard without its replicated 131,648 elements)."""
    tp = cfg.autotp_size
    if tp == 1 or cfg.zero_stage != 3:
        return None
    local = local_model(model, tp)
    return zero3_partitioned(model, local, tp) - -(-replicated_params(model, local, tp) // tp)


def zero3_world_gathered(model: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> int:
    """Bytes of the parameters AutoTP leaves whole that ZeRO-3 gathers and holds beyond what the rest of memory/
    counts for the shard. Those R elements are partitioned over the world and gathered whole in forward, held
    through backward with the default reuse distance. With dp 1 the rest of memory/ sees one rank and counts no
    gather: all R is added (measured: Llama tp 2 ZeRO-3 on 2 CPU ranks, backward peak 522,769 B above the one-rank
    estimate; its embedding and norms, 263,296 elements in bf16, are 526,592 B). With dp > 1,
    model_states.zero3_gathered counts the shard's partitioned count (zero3_partitioned: R / tp of them), so the
    other R - R / tp are added (measured: Llama tp 2 x dp 2 ZeRO-3 on 4 CPU ranks, forward and backward peaks
    262,285 and 262,289 B above that estimate; 131,648 elements in bf16 are 263,296 B)."""
    tp = cfg.autotp_size
    if tp == 1 or cfg.zero_stage != 3:
        return 0
    from autotune.train_config import dtype_bytes

    r = replicated_params(model, local_model(model, tp), tp)
    return dtype_bytes(cfg.precision) * (r if cluster.world_size == tp else r - -(-r // tp))


def sharded_head(model: ModelSpec, cfg: TrainConfig, phases: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """`phases` with the LM head's gradient of an untied model's shard: the traced shard has the whole V x h head
    (its gathered logits are whole, as AutoTP's are) but AutoTP's head is V / tp x h, so is its weight gradient
    (the `head_gradient` term, buffers.head_gradient_bytes or the trace's). Measured: Llama tp 2 x dp 2, ZeRO-2
    fp32, 4 CPU ranks: with V x h x 4 B = 1,048,576 B for it the backward (head) phase was priced 1.07% over the
    measured peak, which is every rank's loss backward (11,767,968 B; the estimate's backward (loss) 11,768,720 B);
    the head's weight there is (1024, 128) (the parameter shapes after deepspeed.initialize), its gradient half."""
    tp = cfg.autotp_size
    if tp == 1 or model.tied_embeddings:
        return phases
    return {
        name: {k: (-(-v // tp) if k == "head_gradient" else v) for k, v in terms.items()}
        for name, terms in phases.items()
    }


def replicated_params(model: ModelSpec, local: ModelSpec, tp: int) -> int:
    """Elements every tp rank holds whole (embedding of an untied model, norms, row-wise biases): with P the
    model's count and L one rank's, L = S / tp + R and P = S + R, so R = (tp L - P) / (tp - 1)."""
    return (tp * local.num_params - model.num_params) // (tp - 1)


def zero3_partitioned(model: ModelSpec, local: ModelSpec, tp: int) -> int:
    """ZeRO-3's count of one rank's shard as dp ranks partition it: the model is built under zero.Init before
    AutoTP makes its groups, so the parameters AutoTP leaves whole stay partitioned over the whole world, and
    only those it replaces (its shards) are partitioned again over dp (engine._apply_autotp_partitioning:
    "AutoTP replaces the weights it shards when the model was built under zero.Init"). Per rank that is
    S / (tp dp) + R / (tp dp): as a count partitioned over dp, L - R + R / tp. Measured: the Llama of
    benchmarks/hf_memory.py at tp 2, ZeRO-3, 2 CPU ranks holds 602,688 partitioned elements per rank (its
    embedding's ds_tensor 131,072 of 262,144, each norm's 64 of 128), L - R / 2 exactly."""
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
