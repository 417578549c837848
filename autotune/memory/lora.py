"""Memory of LoRA and QLoRA fine-tuning (method lora/qlora; autotune/impl/lora.py builds the module).

DeepSpeed 0.19.8 with only the adapters in the optimizer (the worker passes the parameters that require grad): the
frozen base stays in the module in the training dtype (engine._configure_distributed_model casts it) with no gradient,
master copy or optimizer state (stage_1_and_2.py and stage3.py build from `param_group['params']` only); ZeRO-3 still
partitions and gathers every parameter (zero.Init, `_convert_to_zero_parameters`), ZeRO-1/2 only the adapters. So the
adapters' terms are full fine-tuning's for a model of `adapter_params` parameters, the embedding and head make no
gradient, and the activations are traced from the peft module. QLoRA (Dettmers et al. 2023, arXiv:2305.14314, sec. 2-3):
the decoder layers' linear weights in NF4 with their constants (the constants below), each dequantised to the compute
dtype for its matmul one layer at a time (bitsandbytes MatMul4Bit: F.dequantize_4bit); the rest (embeddings, norms, the
LM head) stays 16-bit."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

from autotune import trace_cache
from autotune.errors import SpecError
from autotune.hardware import Cluster
from autotune.impl.lora import adapters_stay_fp32
from autotune.memory import code_trace
from autotune.memory.layout import Layout
from autotune.models import ModelSpec
from autotune.models.hf_config import default_attention
from autotune.train_config import TrainConfig, dtype_bytes

NF4_BYTES = 0.5
"""4-bit NormalFloat: two weights per byte (QLoRA sec. 3)."""
QUANT_BLOCK = 64
"""bitsandbytes' 4-bit block size: one absmax per 64 weights (QLoRA sec. 3, bnb_4bit blocksize 64)."""
ABSMAX_BYTES = 4 / QUANT_BLOCK
"""fp32 absmax per block without double quantisation: 32/64 bits = 0.5 bits/weight (QLoRA sec. 3)."""
DOUBLE_QUANT_BYTES = 1 / QUANT_BLOCK + 4 / (QUANT_BLOCK * 256)
"""8-bit absmax per block + one fp32 constant per 256 blocks: 8/64 + 32/(64*256) = 0.127 bits/weight."""
DOUBLE_QUANT = True
"""autotune's QLoRA uses double quantisation (bnb_4bit_use_double_quant=True, the paper's setup)."""


def qlora_bytes_per_weight(double_quant: bool = DOUBLE_QUANT) -> float:
    """Bytes one quantised base weight costs, constants included."""
    return NF4_BYTES + (DOUBLE_QUANT_BYTES if double_quant else ABSMAX_BYTES)


@cache
def _layout(
    spec: ModelSpec, method: str, rank: int, targets: str
) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...], tuple[tuple[int, ...], ...]]:
    """From the model on the meta device, built through the seam: (the adapter parameter sizes of each decoder layer in
    the optimizer's order, the adapted layers' names, the sizes of each decoder layer's linear weights). Adapters
    live only in decoder layers (peft's all-linear leaves the output layer out). One layer kind is read from one
    layer; a mixed stack from all of them, since its first layer can differ from the rest (measured:
    docs/measurements/memory.md). Kept in the trace cache beside the model's programs (code_trace.kept_on_disk): a
    later run reads it without torch or peft."""
    key = ("lora layout", code_trace.spec_key(spec), spec.uniform_blocks, method, rank, targets)
    layout = trace_cache.remembered(
        key, lambda: _read_layout(spec, method, rank, targets), keep=code_trace.kept_on_disk(spec)
    )
    sizes, names, linear = layout
    return tuple(map(tuple, sizes)), tuple(names), tuple(map(tuple, linear))


def _read_layout(spec: ModelSpec, method: str, rank: int, targets: str):
    import torch

    from autotune.impl import impl_for
    from autotune.impl.lora import LINEAR_TYPES

    # dropout makes no parameters; peft refuses it on wrapped parameters (MoE experts), which the trace says
    cfg = TrainConfig(method=method, lora_rank=rank, lora_targets=targets, lora_dropout=0.0)
    impl = impl_for(spec, cfg)
    with torch.device("meta"):
        model = impl.build(
            spec, dtype=torch.bfloat16, attention=default_attention(spec), num_layers=1 if spec.uniform_blocks else None
        )
    layers = impl.layers(model)
    sizes = [[p.numel() for p in layer.parameters() if p.requires_grad] for layer in layers]
    names = sorted({n.split(".lora_")[0] for layer in layers for n, p in layer.named_parameters() if p.requires_grad})
    # the base layers' weights: peft's wrappers hold them as base_layer (its adapters are excluded)
    linear = [
        [
            m.weight.numel()
            for n, m in layer.named_modules()
            if type(m).__name__ in LINEAR_TYPES and ".lora_" not in f".{n}" and not hasattr(m, "base_layer")
        ]
        for layer in layers
    ]
    if sum(map(len, sizes)) != len([p for p in model.parameters() if p.requires_grad]):
        raise SpecError(
            f"model {spec.name}: {method} adapters outside the decoder layers; autotune prices "
            "adapters of the decoder layers only"
        )
    return sizes, names, linear


def _key(spec: ModelSpec, cfg: TrainConfig):
    return spec, cfg.method, cfg.lora_rank, cfg.lora_targets


def _each_layer(spec: ModelSpec, cfg: TrainConfig, part: int) -> tuple[tuple[int, ...], ...]:
    """One of the layout's per-layer parts for every decoder layer of the stack."""
    per = _layout(*_key(spec, cfg))[part]
    return per * spec.num_layers if len(per) == 1 else per


def adapter_numels(spec: ModelSpec, cfg: TrainConfig, layers: int | None = None) -> list[int]:
    """Element counts of every trainable adapter tensor (of the first `layers` decoder layers), in
    the order an optimizer visits them."""
    return [n for layer in _each_layer(spec, cfg, 0)[:layers] for n in layer]


def adapter_params(spec: ModelSpec, cfg: TrainConfig) -> int:
    """Trainable parameters: r x (in + out) per adapted linear layer over all decoder layers; all of
    them for method full."""
    return sum(adapter_numels(spec, cfg)) if cfg.method != "full" else spec.num_params


def adapted_layers(spec: ModelSpec, cfg: TrainConfig) -> list[str]:
    """The adapted linear layers of the decoder layers, as the module names them."""
    return list(_layout(*_key(spec, cfg))[1])


def adapter_shapes(spec: ModelSpec, cfg: TrainConfig) -> list[tuple[int, int]]:
    """(in, out) of each adapted layer of every decoder layer: A is r x in, B is out x r."""
    r = cfg.lora_rank
    return [(a // r, b // r) for layer in _each_layer(spec, cfg, 0) for a, b in zip(layer[::2], layer[1::2])]


def quantized_weights(spec: ModelSpec, cfg: TrainConfig) -> tuple[int, int]:
    """(linear weight elements of all decoder layers, the largest one): what QLoRA stores in NF4."""
    linear = [n for layer in _each_layer(spec, cfg, 2) for n in layer if n > 0]
    return sum(linear), max(linear)


def adapter_view(spec: ModelSpec, cfg: TrainConfig) -> ModelSpec:
    """`spec` with the adapters' parameter count: the full fine-tuning terms of this view are the
    adapters' gradients, master weights, optimizer states and reduction buffers."""
    return replace(spec, param_count=adapter_params(spec, cfg))


def held_parameters(
    spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout, stepping: bool = False
) -> dict[str, int]:
    """Parameter bytes on one GPU: the frozen base (16-bit, or NF4 for QLoRA) and the adapters.
    ZeRO-3 partitions both and keeps the small ones (< stage3_param_persistence_threshold
    elements) whole on every rank, but while the optimizer is `stepping` (model_states.
    zero3_step_parameters: LoRA's adapters are often all small enough); below stage 3 every rank
    holds all of them."""
    pb, n = dtype_bytes(cfg.precision), cluster.world_size
    # peft's fp32 adapters, which DeepSpeed leaves in fp32 at ZeRO-3 (impl/lora.py adapters_stay_fp32): their
    # partition, the whole small ones and the gathered ones in fp32; the gradient partition and reduce bucket stay
    # in the training dtype (stage3.py: grad_partitions_flat_buffer in gradient_accumulation_dtype, ipg_buckets in
    # communication_data_type, both the model's dtype unless the config sets them)
    ab = 4 if adapters_stay_fp32(cfg) else pb
    adapters = adapter_params(spec, cfg)
    base = spec.num_params * pb
    out = {}
    if cfg.method == "qlora":
        q, _ = quantized_weights(spec, cfg)
        base = (spec.num_params - q) * pb + q * qlora_bytes_per_weight()
    if cfg.zero_stage == 3:
        threshold = layout.stage3_param_persistence_threshold
        keep_base = 0 if stepping else code_trace.persistent_params(spec, threshold)
        keep_adapters = 0 if stepping else sum(x for x in adapter_numels(spec, cfg) if x < threshold)
        out["frozen_parameters"] = int(base / n + pb * keep_base)
        out["adapter_parameters"] = int(ab * (adapters / n + keep_adapters))
        # held gathered from forward to backward: every module the backward runs through. Without
        # checkpointing nothing runs backward through a module upstream of every adapter (the frozen
        # input embedding; a hybrid's layers before its first adapted one), so DeepSpeed's reuse
        # trace releases it after its forward (code_trace.released_after_forward). QLoRA's base is
        # its 4-bit weights, which that 16-bit forward does not size: the embedding alone there.
        if n > 1 and cfg.method == "lora":
            released = sum(x for x in code_trace.released_after_forward(spec, cfg) if x >= threshold)
        else:
            released = 0 if cfg.ckpt_layers or spec.tied_embeddings else input_embedding_params(spec)
        gathered = base - pb * (keep_base + released) + ab * (adapters - keep_adapters)
        # ... up to stage3_max_reuse_distance elements, as in full fine-tuning (model_states.
        # zero3_held): the same coordinator releases a frozen module whose backward is further away
        # in the trace (a 70B's base was held whole: 128 GiB gathered per GPU at ZeRO-3 on 8 GPUs)
        elements = spec.num_params - keep_base - released + adapters - keep_adapters
        reuse = layout.stage3_max_reuse_distance
        out["_gathered"] = int(gathered * min(1.0, reuse / elements)) if n > 1 and elements > 0 else 0
        # ... less, once its backward has run, an untied frozen LM head: no module after it in the
        # step's trace uses its weight, so DeepSpeed's post-backward hook releases it (parameter_
        # offload.py _post_backward_module_hook -> partitioned_param_coordinator.py release_sub_module,
        # __params_to_release keeps only parameters that reoccur in __submodule_order[step_id:]). A
        # tied head's weight is the input embedding's, held on (measured: docs/measurements/memory.md).
        head = spec.vocab_size * spec.hidden_size
        after = head if n > 1 and not spec.tied_embeddings and head >= threshold else 0
        out["_gathered_after_head"] = (
            int(max(0, gathered - pb * after) * min(1.0, reuse / max(1, elements - after)))
            if n > 1 and elements > after
            else 0
        )
    else:
        out["frozen_parameters"] = int(base)
        out["adapter_parameters"] = ab * adapters
    return out


def input_embedding_params(spec: ModelSpec) -> int:
    """The input embeddings' parameters: tokens, and learned positions where the model has them."""
    return spec.vocab_size * spec.hidden_size + (
        spec.max_seq_len * spec.hidden_size if spec.position == "learned" else 0
    )


AFTER_HEAD_BACKWARD = ("backward (layers)", "backward (recompute first)", "backward (recompute last)", "backward (end)")
"""The phases after the LM head's backward (segments.PHASE_POINTS; the analytic tier's ZeRO-3 has
no 'backward (layers)'), where ZeRO-3 has released an untied frozen head (`held_parameters`)."""

FROZEN_DROPPED = ("embedding_gradient", "head_gradient")
"""Full fine-tuning terms with no LoRA counterpart: the frozen embedding and LM head make no gradient."""


def lora_phases(
    spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout, full_phases
) -> dict[str, dict[str, int]]:
    """autotune.memory's phases for a LoRA/QLoRA config: full fine-tuning's phases of the adapter
    view (`full_phases(view, cluster, cfg with method full)`), with the held parameters of the whole
    module instead of the adapters' alone, ZeRO-3's gathered base, no embedding or head gradient,
    and (QLoRA) the dequantised weight of the largest linear layer in forward and backward."""
    view = adapter_view(spec, cfg)
    plain = replace(cfg, method="full")
    phases = full_phases(view, cluster, plain, layout)
    held = held_parameters(spec, cluster, cfg, layout)
    gathered = held.pop("_gathered", 0)
    after_head = held.pop("_gathered_after_head", gathered)
    stepping = {
        k: v
        for k, v in held_parameters(spec, cluster, cfg, layout, stepping=True).items()
        if not k.startswith("_gathered")
    }
    dequant = dtype_bytes(cfg.precision) * quantized_weights(spec, cfg)[1] if cfg.method == "qlora" else 0
    out = {}
    for name, terms in phases.items():
        t = {k: v for k, v in terms.items() if k not in FROZEN_DROPPED and k != "parameters"}
        t = {**(stepping if name == "optimizer" else held), **t}
        if "zero3_gathered_params" in terms:
            t["zero3_gathered_params"] = after_head if name in AFTER_HEAD_BACKWARD else gathered
        if dequant and name != "optimizer":
            t["dequantized_weight"] = dequant
        out[name] = {k: v for k, v in t.items() if v}
    return out
