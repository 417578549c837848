"""Tensor parallelism (DeepSpeed AutoTP training) and Ulysses sequence parallelism (DeepSpeed ALST) against a
model and a cluster: what runs, what DeepSpeed refuses, and the data-parallel degree ZeRO shards over.
train_config.check_config calls `check_parallel`.

Every refusal below was found by running deepspeed 0.19.8 on 2 or 4 CPU ranks (gloo), except those whose text
says they were read from the code; docs/parallelism.md has the runs. This module imports no other of autotune's
but errors (and transformers, inside a function), so train_config can import it.
"""

from __future__ import annotations

import functools

from autotune.errors import SpecError

AUTOTP_UNSUPPORTED = ("deberta", "flaubert", "fsmt", "gpt2", "led", "longformer", "xlm", "xlnet")
"""Model classes AutoTP refuses: deepspeed/module_inject/auto_tp.py AutoTP.supported's `unsupported`
list (its tp_parser asserts "AutoTP not supported for model. Please use kernel injection since
container policy for model exists."; measured on GPT-2 at ZeRO 0-3, tp 2, 2 CPU ranks)."""


AUTOTP_PLAN_STYLES = (
    "colwise",
    "colwise_rep",
    "colwise_gather_output",
    "rowwise",
    "replicated_with_grad_allreduce",
    "embedding_rowwise",
)
"""The partition styles of a Hugging Face tp_plan that DeepSpeed 0.19.8 applies (module_inject/tp_plan_converter.py
SUPPORTED_STYLES). A plan with any other style is rejected whole ("HuggingFace tp_plan contains unsupported partition
style(s)"); measured at ZeRO-1 and -3, tp 2, 2 CPU ranks on Mixtral (moe_tp_experts, packed_colwise) and OLMo2
(rowwise_split_input) (`python benchmarks/parallel_families.py`)."""
AUTOTP_NOT_PRICED = {
    "gemma2": (
        3,
        "its per-rank peak at tp 2 is 18.4% above the estimate at ZeRO-0 and -1 (1.79 MB "
        "measured against 1.46 MB, 2.49 MB against 2.03 MB, a 3-layer config on 2 CPU ranks, "
        "fp32): AutoTP keeps more of Gemma2 whole than autotune's shard accounting assumes; "
        "exact at ZeRO-3",
    )
}
"""model_type -> (the lowest ZeRO stage measured exact under AutoTP, why lower stages are refused): an estimate that
under-states a rank's memory is the side that crashes a run (`python benchmarks/parallel_families.py`)."""


def data_parallel_size(cfg, world_size: int) -> int:
    """Ranks that see different batches: world / (tp x sp). A tp group's ranks see one batch (engine.py
    check_dataloader_inputs_same_across_ranks); an sp group's share one micro batch, each rank holding seq / sp of
    its tokens (runtime/sequence_parallel/ulysses_sp.py UlyssesSPDataLoaderAdapter refill), and DeepSpeed's batch
    arithmetic divides the world by sp too (runtime/config.py DeepSpeedConfig.__init__). So the global batch is micro
    x dp x grad accum."""
    return world_size // (cfg.autotp_size * cfg.sequence_parallel_size)


def data_parallel_rank(cfg, rank: int) -> int:
    """The data-parallel group `rank` belongs to, rank // (tp x sp): a tp group's ranks are consecutive (DeepSpeed's
    mesh puts tp innermost, utils/groups.py _init_tp_mesh_device), and so are a Ulysses group's
    (sequence_parallel/parallel_state_sp.py initialize_sequence_parallel)."""
    return rank // (cfg.autotp_size * cfg.sequence_parallel_size)


def global_batch(cfg, world_size: int) -> int:
    """Sequences per optimizer step: micro batch x dp x grad accum."""
    return cfg.micro_batch * data_parallel_size(cfg, world_size) * cfg.grad_accum


def check_parallel(cfg, model, cluster) -> None:
    """Raise SpecError unless `cfg`'s tensor parallelism (and DeepCompile) can run `model` on `cluster`."""
    if cfg.deepcompile and cluster.gpu.is_cpu:
        raise SpecError(
            "deepcompile runs on CUDA only (deepspeed/compile/util.py is_deepcompile_supported: torch >= 2.6 "
            "and a cuda accelerator); CPU ranks cannot run it (it is still estimated and simulated for GPUs, "
            "as without it)"
        )
    check_sequence_parallel(cfg, model, cluster)
    tp = cfg.autotp_size
    if tp == 1:
        return
    world = cluster.world_size
    if world % tp:
        raise SpecError(
            f"autotp_size {tp} must divide the world size {world} (dp = world / tp = {world / tp:g} is not whole)"
        )
    if model.implementation != "hf":
        raise SpecError(
            f"autotp_size {tp}: AutoTP shards a Hugging Face model by its tp_plan (DeepSpeed "
            f"engine._apply_autotp_partitioning); the {model.implementation} code has none (use --impl hf)"
        )
    _check_heads(tp, model)
    model_type = (model.hf_config or {}).get("model_type") or model.family
    if model_type in AUTOTP_UNSUPPORTED:
        raise SpecError(
            f"autotp_size {tp}: DeepSpeed's AutoTP refuses {model_type} models ('AutoTP not supported "
            "for model. Please use kernel injection since container policy for model exists.', "
            "module_inject/auto_tp.py AutoTP.supported); use autotp_size 1"
        )
    conf = config_object(model)
    plan = dict(getattr(conf, "base_model_tp_plan", None) or {}) if conf is not None else {}
    odd = sorted({str(v) for v in plan.values() if str(v).lower() not in AUTOTP_PLAN_STYLES})
    if odd:
        raise SpecError(
            f"autotp_size {tp}: {model_type}'s Hugging Face tp_plan has partition styles DeepSpeed 0.19.8 "
            f"does not apply ({', '.join(odd)}), and it rejects the whole plan ('HuggingFace tp_plan "
            "contains unsupported partition style(s)', module_inject/tp_plan_converter.py); use autotp_size 1"
        )
    if model_type in AUTOTP_NOT_PRICED and cfg.zero_stage < AUTOTP_NOT_PRICED[model_type][0]:
        lowest, why = AUTOTP_NOT_PRICED[model_type]
        raise SpecError(
            f"autotp_size {tp} with {model_type} at ZeRO-{cfg.zero_stage}: {why}; use ZeRO-{lowest} or autotp_size 1"
        )
    if cfg.method != "full":
        # measured: peft LoRA on q/k/v/o of the Llama of benchmarks/hf_memory.py, ZeRO-0 bf16, tp 2
        raise SpecError(
            f"method {cfg.method} with autotp_size {tp}: DeepSpeed 0.19.8's AutoTP replaces peft's "
            "adapted nn.Linear wrappers with its own sharded layers and drops lora_A/lora_B, so nothing "
            "trains and engine.backward fails ('loss must be a scalar tensor'); use autotp_size 1"
        )
    if cfg.offload_param != "none" or cfg.offload_optimizer:
        raise SpecError(
            f"autotp_size {tp} with ZeRO offload is not measured here (autotune prices AutoTP on "
            "the device only); use autotp_size 1 to offload"
        )


def _check_heads(tp: int, model) -> None:
    """tp must split the query heads and the key/value heads evenly."""
    if model.num_heads % tp:
        raise SpecError(
            f"autotp_size {tp} must divide the {model.num_heads} attention heads (the column-sharded "
            "q projection splits whole heads)"
        )
    if tp > model.num_kv_heads or model.num_kv_heads % tp:
        # engine._apply_autotp_partitioning: ranks past the KV head count get no attention shard ("attention
        # throughput will not scale past that point"), so the ranks' memory differs.
        raise SpecError(
            f"autotp_size {tp} must divide the {model.num_kv_heads} key/value heads: past them "
            "DeepSpeed gives the extra ranks no attention shard (their attention work and memory "
            "differ from the others', and attention does not scale); choose a divisor of "
            f"{model.num_kv_heads}"
        )


SP_NO_KV_HEADS = ("gpt2", "gpt_neox")
"""Measured: register_with_transformers reads `num_key_value_heads` of the model's text config
(runtime/sequence_parallel/ulysses_sp.py), which GPT2Config and GPTNeoXConfig lack (AttributeError). Any other
config transformers builds without one is refused the same way (`config_object`): measured on Falcon, OPT and GPT-J
(`python benchmarks/parallel_families.py`)."""
SP_NO_POSITION_IDS = ("gpt_bigcode",)
"""Measured (benchmarks/parallel_families.py): GPTBigCode's attention module calls the attention function without
position_ids, and Ulysses asserts them ("Ulysses SP requires position_ids in every forward() call",
ulysses_sp.py UlyssesSPAttentionHF.forward)."""


def check_sequence_parallel(cfg, model, cluster) -> None:
    """Raise SpecError unless `cfg`'s Ulysses sequence parallelism (DeepSpeed 0.19.8, UlyssesSPAttentionHF) can run
    `model` on `cluster`. Each refusal cites where DeepSpeed says so; docs/parallelism.md has the runs."""
    sp = cfg.sequence_parallel_size
    if sp == 1:
        return
    tp, world = cfg.autotp_size, cluster.world_size
    if world % (tp * sp):
        raise SpecError(
            f"sequence_parallel_size {sp} x autotp_size {tp} must divide the world size {world} "
            f"(dp = world / (tp x sp) = {world / (tp * sp):g} is not whole)"
        )
    if model.implementation != "hf":
        raise SpecError(
            f"sequence_parallel_size {sp}: Ulysses replaces a Hugging Face model's attention function "
            "(UlyssesSPAttentionHF.register_with_transformers overrides transformers' "
            f"ALL_ATTENTION_FUNCTIONS); the {model.implementation} code does not call it (use --impl hf)"
        )
    model_type = (model.hf_config or {}).get("model_type") or model.family
    conf = config_object(model)
    _check_layer_kinds(sp, cfg, conf, model_type)
    if model_type in SP_NO_POSITION_IDS:
        raise SpecError(
            f"sequence_parallel_size {sp}: {model_type}'s attention calls transformers' attention function "
            "without position_ids, which DeepSpeed's Ulysses asserts ('Ulysses SP requires position_ids in "
            "every forward() call', ulysses_sp.py; measured); use sequence_parallel_size 1"
        )
    if model_type in SP_NO_KV_HEADS or (conf is not None and getattr(conf, "num_key_value_heads", None) is None):
        raise SpecError(
            f"sequence_parallel_size {sp}: DeepSpeed's Ulysses reads the config's num_key_value_heads "
            f"(ulysses_sp.py register_with_transformers), which {model_type} configs lack "
            "(measured: AttributeError); use sequence_parallel_size 1"
        )
    if conf is not None and getattr(conf, "kv_lora_rank", None):
        raise SpecError(
            f"sequence_parallel_size {sp}: {model_type} attends with multi-head latent attention (query and "
            "key heads of qk_nope_head_dim + qk_rope_head_dim, value heads of v_head_dim), and DeepSpeed's "
            "Ulysses asserts one head size for query, key and value ('query input tensor does not match the "
            "required shape', ulysses_sp.py UlyssesSPAttentionHF.forward; measured on DeepSeek-V3); use "
            "sequence_parallel_size 1"
        )
    if conf is not None and hasattr(conf, "head_dim") and conf.head_dim is None:
        raise SpecError(
            f"sequence_parallel_size {sp}: {model_type}'s config has head_dim None, and DeepSpeed's Ulysses "
            "takes getattr(config, 'head_dim', hidden_size / heads) (ulysses_sp.py register_with_transformers), "
            "which is then None (measured on Mixtral: 'torch.Size() takes an iterable of int'); set head_dim "
            f"to {model.hidden_size // model.num_heads} in the config.json or use sequence_parallel_size 1"
        )
    if cfg.attention == "eager":
        raise SpecError(
            f"sequence_parallel_size {sp} with eager attention: DeepSpeed refuses it ('eager "
            "attn_implementation isn't currently supported by Ulysses sequence parallelism because it "
            "requires a 4D attention_mask', ulysses_sp.py register_with_transformers); use sdpa"
        )
    if model.num_heads % sp:
        raise SpecError(
            f"sequence_parallel_size {sp} must divide the {model.num_heads} attention heads (after "
            "the all-to-all each rank attends over heads / sp: 'Attention head count ... is not "
            "divisible by SP size', ulysses_sp.py UlyssesSPAttentionHF.__init__)"
        )
    kv = model.num_kv_heads
    if kv % sp and sp % kv:
        raise SpecError(
            f"sequence_parallel_size {sp} and the {kv} key/value heads must divide one another ('KV "
            "attention head count ... is not divisible by SP size or vice versa', ulysses_sp.py "
            "UlyssesSPAttentionHF.__init__)"
        )
    if cfg.seq_len % sp:
        raise SpecError(
            f"sequence_parallel_size {sp} must divide seq_len {cfg.seq_len} (\"batch's seqlen isn't "
            'divisible by sp-size", ulysses_sp.py UlyssesSPDataLoaderAdapter.refill)'
        )
    if tp > 1:
        # measured: llama tp 2 x sp 2 on 4 CPU ranks, ZeRO-1: the first forward fails with "No sequence parallel
        # group found" (deepspeed/utils/groups.py _get_sequence_parallel_group)
        raise SpecError(
            f"sequence_parallel_size {sp} with autotp_size {tp}: DeepSpeed 0.19.8's AutoTP replaces the "
            "mpu that carries Ulysses' groups with its own (runtime/engine.py "
            "_configure_tensor_parallel_states: `self.mpu = groups`), so the engine and the loss find no "
            "sequence-parallel group; use one of the two"
        )
    # method lora/qlora is allowed: peft wraps the projections and Ulysses the attention function only. ZeRO-3
    # offload is priced with sp (offload's terms beside Ulysses'); stage 1-2 offload misses past 2 ranks with or
    # without sp, so it stays refused (measured: docs/measurements/memory.md, `parallel.check_sequence_parallel`)
    offload = cfg.offload_param != "none" or cfg.offload_optimizer
    if offload and cfg.zero_stage in (1, 2):
        raise SpecError(
            f"sequence_parallel_size {sp} with offload_optimizer at ZeRO stage {cfg.zero_stage} is not "
            "priced: measured at sp 2 x dp 2 on 4 CPU ranks the estimate misses (ZeRO-1 bf16: -6.2% "
            "Llama, -5.9% Qwen2; ZeRO-2 fp32: +11.3% Qwen2), as it does for the same runs without sp "
            "(-10.5%, +11.1%): stage 1-2 offload past 2 ranks is not priced to 1%; use ZeRO stage 3 "
            "to offload with sequence parallelism, or sequence_parallel_size 1"
        )
    if offload and cfg.method != "full":
        raise SpecError(
            f"sequence_parallel_size {sp} with ZeRO offload and method {cfg.method} is not measured "
            "here (offload with sp is measured with full fine-tuning at ZeRO-3); use method full or "
            "sequence_parallel_size 1"
        )


# Layer kinds, in transformers' own vocabulary (configuration_utils.py ALLOWED_ATTN_LAYER_TYPES, with the legacy
# names its _LEGACY_LAYER_TYPE_REMAP maps: "mamba" -> "linear_attention", "attention" -> "full_attention"), read from
# the config's `layer_types`, `layers_block_type` and `block_types` (RecurrentGemma: "recurrent", "attention").
SP_ATTENTION_KINDS = ("full_attention", "sliding_attention", "attention")
"""Softmax attention that calls transformers' attention function, which DeepSpeed's Ulysses wraps: q, k and v go
through its all-to-all and attention sees the whole sequence (ulysses_sp.py register_with_transformers overrides
ALL_ATTENTION_FUNCTIONS[core_attn_implementation] with uattn_wrapper)."""
SP_TOKENWISE_KINDS = ("mlp", "moe", "dense", "sparse")
"""Layers that mix no tokens (Nemotron-H's MLP and MoE layers; `mlp_layer_types`' dense and sparse): each token's
output depends on that token only, so running them on seq / sp tokens is the same computation."""
SP_NOT_ATTENTION_KINDS = ("linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding", "recurrent")
"""Token mixers that are not softmax attention: Mamba/SSM mixers and gated-delta or lightning linear attention
("linear_attention"), LFM2's short convolutions ("conv"), layers that run a Mamba mixer beside attention
("hybrid": Zamba, Zamba2, Falcon-H1, Zaya) and RecurrentGemma's recurrent blocks. None calls the attention function
Ulysses wraps, so under sp each would run on this rank's seq / sp tokens with no exchange: the rank's slice starts
its scan, state or convolution without the tokens before it."""


def layer_kinds(model) -> tuple[str, ...] | None:
    """The kinds of the model's decoder layers, one per layer where the config lists them (jamba, bamba,
    granitemoehybrid, lfm2, qwen3_next, falcon_h1, zamba, nemotron_h, ...); () where it names none (Llama: every
    layer attention); None where transformers cannot build the config."""
    return _layer_kinds(config_object(model))


def sliding_window(model) -> int | None:
    """The window of the model's sliding-window layers, None where it has none. A config that lists its layers
    (`layer_types`) has them where it says "sliding_attention" (Qwen2 with use_sliding_window False lists none);
    one that lists none slides in every layer when `sliding_window` is set (modeling_mistral.py picks
    create_sliding_window_causal_mask when config.sliding_window is not None). Read from the config object:
    MistralConfig's default window is 4096, which a config dict without the key still gets."""
    return _sliding_window(config_object(model))


def config_object(model):
    """transformers' text config object for the model's config dict (its class defaults and properties filled in),
    None where there is no dict or transformers cannot build it. The object, not the dict: Jamba's and Bamba's
    layer_types are properties to_dict() leaves out."""
    import json

    d = model.hf_config
    if not d or not d.get("model_type"):
        return None
    return _text_config(json.dumps(d, sort_keys=True))


@functools.lru_cache(maxsize=64)
def _text_config(config_json: str):
    import json

    from transformers import CONFIG_MAPPING

    d = json.loads(config_json)
    if d["model_type"] not in CONFIG_MAPPING:
        return None
    try:
        return CONFIG_MAPPING[d["model_type"]].from_dict(d).get_text_config()
    except Exception:
        return None


def _layer_kinds(conf) -> tuple[str, ...] | None:
    if conf is None:
        return None
    for key in ("layer_types", "layers_block_type", "block_types"):  # the first the config has: Bamba has two
        value = getattr(conf, key, None)
        if isinstance(value, (list, tuple)):
            return tuple(str(v) for v in value)
    return ()


def _sliding_window(conf) -> int | None:
    if conf is None:
        return None
    kinds, window = _layer_kinds(conf), getattr(conf, "sliding_window", None)
    if (
        not isinstance(window, int)
        or getattr(conf, "use_sliding_window", None) is False
        or (kinds and "sliding_attention" not in kinds)
    ):
        return None
    return window


def _check_layer_kinds(sp: int, cfg, conf, model_type: str) -> None:
    """Refuse sp for a model whose layers are not all softmax attention (or token-wise), and sliding-window attention
    through sdpa on sequences longer than the window: Ulysses exchanges tokens only inside the attention function, so
    any other mixer runs on each rank's slice alone (measured at sp 2 on 2 CPU ranks, each rank's logits against the
    whole sequence's: `test_ulysses_logits_against_the_whole_sequence`; measured: docs/measurements/memory.md)."""
    kinds = _layer_kinds(conf) or ()
    odd = [k for k in dict.fromkeys(kinds) if k not in SP_ATTENTION_KINDS + SP_TOKENWISE_KINDS]
    if odd:
        n = sum(k in odd for k in kinds)
        if any(k in SP_NOT_ATTENTION_KINDS for k in odd):
            what = "are not softmax attention (Mamba/SSM mixers, short convolutions or linear attention)"
        else:
            what = (
                "are not plain causal or sliding-window softmax attention (Ulysses drops the 4D attention masks "
                "that carry chunked attention, and an indexer or compressor runs before the attention call, on "
                "this rank's slice; read from the code, not run)"
            )
        raise SpecError(
            f"sequence_parallel_size {sp}: {model_type} has {n} of {len(kinds)} layers of kind "
            f"{', '.join(odd)}, which {what}. DeepSpeed's Ulysses exchanges data only inside "
            "transformers' attention function (ulysses_sp.py register_with_transformers overrides "
            "ALL_ATTENTION_FUNCTIONS), so those layers would run on each rank's seq / sp tokens with no "
            "exchange and train a different model from the one without sp; use sequence_parallel_size 1"
        )
    window = _sliding_window(conf)
    # flash_attention_2 keeps the window: the attention module passes sliding_window= to the attention function
    # (modeling_mistral.py), uattn_wrapper hands its kwargs on, and _flash_attention_forward applies it as
    # window_size (modeling_flash_attention_utils.py); read from the code, CUDA only
    if window is not None and cfg.attention == "sdpa" and cfg.seq_len > window:
        raise SpecError(
            f"sequence_parallel_size {sp} with sdpa attention: {model_type}'s sliding window of {window} "
            f"tokens is shorter than seq_len {cfg.seq_len}, and DeepSpeed's Ulysses drops the 4D "
            "attention mask that carries the window (ulysses_sp.py uattn_wrapper: attention_mask = None), "
            "so sdpa attends causally over the whole sequence: a different model from the one without sp; "
            f"use seq_len <= {window}, attention flash_attention_2 (it takes the window as an argument, "
            "which the wrapper passes on), or sequence_parallel_size 1"
        )
