"""Hugging Face configs as model specs: where a config comes from and the ModelSpec it gives.

- Configs: a config.json, a directory holding one, or a hub id already in the local Hugging Face
  cache (read with local_files_only: never the network). Presets become the config class of their
  family (`preset_config`).
- Shape: the fields the memory model uses come from the config; the exact parameter count from
  the model built on the meta device (no memory, no per-family arithmetic), so any architecture
  AutoModelForCausalLM knows is accepted.
The code a trial runs from such a config is autotune/impl/hf.py.
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import Any

from autotune.errors import SpecError
from autotune.models.spec import FAMILY_DEFAULTS, ModelSpec

# ---- configs --------------------------------------------------------------------------------


def preset_config(spec: ModelSpec, model_type: str) -> dict[str, Any]:
    """The keys of `model_type`'s config class that the preset's shape sets; the class's defaults
    fill the rest when it is built (`config_object`). No transformers import: presets stay cheap."""
    common = {"vocab_size": spec.vocab_size, "tie_word_embeddings": spec.tied_embeddings}
    if model_type in ("llama", "mistral", "qwen2"):
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        d = {
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.ffn_hidden_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads,
            "num_key_value_heads": spec.num_kv_heads,
            "max_position_embeddings": spec.max_seq_len,
            "head_dim": spec.head_dim,
        }
        if model_type == "llama":
            d |= {"attention_bias": spec.linear_bias, "mlp_bias": spec.linear_bias}
    elif model_type == "gpt2":
        arch = {"gpt2": "GPT2LMHeadModel"}
        d = {
            "n_layer": spec.num_layers,
            "n_embd": spec.hidden_size,
            "n_head": spec.num_heads,
            "n_inner": spec.ffn_hidden_size,
            "n_positions": spec.max_seq_len,
            # GPT2Config's default 50256 is outside a smaller vocabulary (transformers warns)
            "bos_token_id": min(50256, spec.vocab_size - 1),
            "eos_token_id": min(50256, spec.vocab_size - 1),
        }
    elif model_type == "gpt_neox":
        arch = {"gpt_neox": "GPTNeoXForCausalLM"}
        d = {
            "hidden_size": spec.hidden_size,
            "intermediate_size": spec.ffn_hidden_size,
            "num_hidden_layers": spec.num_layers,
            "num_attention_heads": spec.num_heads,
            "max_position_embeddings": spec.max_seq_len,
        }
    elif model_type == "mpt":
        arch = {"mpt": "MptForCausalLM"}
        if spec.ffn_hidden_size % spec.hidden_size:
            raise SpecError(
                f"model {spec.name}: MPT's ffn width is expansion_ratio x d_model; "
                f"{spec.ffn_hidden_size} is not a multiple of {spec.hidden_size}"
            )
        d = {
            "d_model": spec.hidden_size,
            "n_heads": spec.num_heads,
            "n_layers": spec.num_layers,
            "expansion_ratio": spec.ffn_hidden_size // spec.hidden_size,
            "max_seq_len": spec.max_seq_len,
            "no_bias": not spec.linear_bias,
        }
    else:
        raise SpecError(
            f"model {spec.name}: no Hugging Face config for model_type {model_type!r}; "
            f"known: llama, mistral, qwen2, gpt2, gpt_neox, mpt"
        )
    return {"model_type": model_type, "architectures": [arch[model_type]], **common, **d}


def config_dict(spec: ModelSpec) -> dict[str, Any]:
    """The spec's Hugging Face config as a dict: its own, else its family's built from the shape."""
    return spec.hf_config if spec.hf_config is not None else preset_config(spec, spec.family)


def attentions(spec: ModelSpec) -> tuple[str, ...] | None:
    """The attn_implementation names the spec's Hugging Face class supports, in the order
    transformers prefers them when none is asked for (sdpa where the class supports it, else
    eager), from the class's own flags (`_supports_sdpa`, `_supports_flash_attn`); None for code
    that is not Hugging Face's (builtin, factory: sdpa and eager both run)."""
    if spec.implementation != "hf":
        return None
    return _class_attentions(config_dict(spec).get("model_type"))


def default_attention(spec: ModelSpec) -> str:
    """What transformers picks for the spec's class when none is asked for (sdpa where supported,
    else eager); sdpa for other code. For building a module only to count or inspect it."""
    return (attentions(spec) or ("sdpa",))[0]


@cache
def _class_attentions(model_type: str) -> tuple[str, ...]:
    from autotune import trace_cache

    # kept on disk: a later run answers without importing transformers (about 2 s)
    return tuple(trace_cache.remembered(("attentions", model_type), lambda: list(_read_attentions(model_type))))


def _read_attentions(model_type: str) -> tuple[str, ...]:
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    cls = AutoModelForCausalLM._model_mapping[CONFIG_MAPPING[model_type]]
    flags = (
        ("sdpa", getattr(cls, "_supports_sdpa", False)),
        ("eager", True),
        ("flash_attention_2", getattr(cls, "_supports_flash_attn", False)),
    )
    return tuple(name for name, ok in flags if ok)


def config_object(spec: ModelSpec, num_layers: int | None = None):
    """A transformers PretrainedConfig for the spec, with `num_layers` decoder layers if given."""
    from transformers import CONFIG_MAPPING

    d = dict(config_dict(spec))
    mtype = d.get("model_type")
    if mtype not in CONFIG_MAPPING:
        raise SpecError(f"model {spec.name}: transformers {_version()} has no model_type {mtype!r}")
    config = CONFIG_MAPPING[mtype].from_dict(d)
    if num_layers is not None and num_layers != config.num_hidden_layers:
        config = copy.deepcopy(config)
        lists = per_layer_lists(config.to_dict(), config.num_hidden_layers)
        config.num_hidden_layers = num_layers  # attribute_map routes it (gpt2: n_layer, mpt: n_layers)
        for key in lists:  # per-layer lists must match
            try:
                setattr(config, key, getattr(config, key)[:num_layers])
            except AttributeError:  # a property derived from num_hidden_layers (Bamba, Jamba): follows it
                pass
    return config


def per_layer_lists(d: dict, depth: int) -> list[str]:
    """The keys of a config dict that list one entry per decoder layer: `layer_types` (Qwen2, Gemma
    2/3: sliding or full attention), `mlp_layer_types` (DeepSeek-style dense or sparse, transformers
    5), `num_attention_heads_per_layer` (Laguna): lists of `depth` entries under a key naming layers."""
    return [k for k, v in d.items() if "layer" in k and isinstance(v, list) and len(v) == depth]


def continued(values: list, n: int) -> list:
    """A per-layer list taken to `n` entries as a deeper model of the same config has it: repeating
    its shortest period where it has one (Gemma 2's full, sliding, full, ...), else its last entry
    (dense first layers, then sparse ones to the end: DeepSeek's `first_k_dense_replace`)."""
    period = next(
        (p for p in range(1, len(values)) if all(values[i] == values[i - p] for i in range(p, len(values)))), None
    )
    if period is None:
        return values[:n] + [values[-1]] * (n - len(values))
    return [values[i % period] for i in range(n)]


@contextmanager
def held_warnings():
    """transformers' logged warnings and Python's (torch's) while a config is read and its model built on the meta
    device: shown once the config is accepted, dropped when it is refused, where the SpecError says what is wrong and
    they would only come before it (a vocab_size of 0: transformers warns of bos/eos token ids outside the vocabulary,
    torch of zero-element tensors)."""
    import logging
    import warnings

    from transformers.utils import logging as hf_logging

    lib = hf_logging.get_logger()  # the library's root logger, with its handler: its modules' loggers reach it
    held: list[logging.LogRecord] = []

    class Hold(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            held.append(record)

    handlers, hold = lib.handlers[:], Hold()
    for h in handlers:
        lib.removeHandler(h)
    lib.addHandler(hold)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # each held, and shown by the caller's filters below
            yield
    finally:
        lib.removeHandler(hold)
        for h in handlers:
            lib.addHandler(h)
    for record in held:  # accepted: what would have been shown, now
        lib.handle(record)
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _version() -> str:
    import transformers

    return transformers.__version__


def load_config(text: str):
    """A PretrainedConfig from a config.json, a directory holding one, or a hub id in the local
    Hugging Face cache; SpecError naming where it looked."""
    from transformers import AutoConfig

    path = Path(text).expanduser()
    if path.suffix == ".json" or path.exists():
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise SpecError(f"model config {file} does not exist")
        try:
            return AutoConfig.from_pretrained(str(file))
        except Exception as e:
            # (ValueError, KeyError, huggingface_hub's StrictDataclassClassValidationError, ...)
            raise SpecError(
                f"model config {file}: transformers {_version()} cannot read it: {' '.join(str(e).split())}"
            ) from None
    from huggingface_hub import constants
    from transformers.utils import cached_file

    try:  # local_files_only: the cache or nothing; autotune never downloads
        file = cached_file(text, "config.json", local_files_only=True)
    except (OSError, ValueError) as e:
        raise SpecError(
            f"model {text!r} is not a preset, not a path, and not in the local Hugging Face "
            f"cache (looked in {constants.HF_HUB_CACHE}; autotune never downloads). Put its "
            f"config.json in a directory and pass that directory. ({type(e).__name__})"
        ) from None
    return load_config(file)


# ---- shape and parameter count ----------------------------------------------------------------
_FAMILY_OF = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "gpt2": "gpt2",
    "gpt_neox": "gpt_neox",
    "mpt": "mpt",
}


def meta_model(config):
    """The model of `config` on the meta device: shapes and counts, no memory."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def decoder_layers(model) -> list:
    """The decoder layers in order: the longest ModuleList of GradientCheckpointingLayer."""
    from torch import nn
    from transformers.modeling_layers import GradientCheckpointingLayer

    best: list = []
    for m in model.modules():
        if (
            isinstance(m, nn.ModuleList)
            and len(m) > len(best)
            and all(isinstance(c, GradientCheckpointingLayer) for c in m)
        ):
            best = list(m)
    if not best:
        raise SpecError(
            f"{type(model).__name__}: no ModuleList of GradientCheckpointingLayer found; "
            f"transformers cannot checkpoint its layers one by one"
        )
    return best


def _blocks(model) -> list:
    """The decoder layers, [] where none is found (the trace says why)."""
    try:
        return decoder_layers(model)
    except SpecError:
        return []


def _block_kind(block) -> tuple:
    """What a layer's memory depends on besides the batch: its class and parameter shapes."""
    return type(block).__name__, tuple((n, tuple(p.shape)) for n, p in block.named_parameters())


def spec_from_config(config, *, name: str, source: str) -> ModelSpec:
    """ModelSpec of an AutoModelForCausalLM config; `param_count` from the meta-device model."""
    from transformers import AutoModelForCausalLM

    if type(config) not in AutoModelForCausalLM._model_mapping:
        names = sorted(c.model_type for c in AutoModelForCausalLM._model_mapping.keys())
        raise SpecError(
            f"model {name}: AutoModelForCausalLM cannot build model_type "
            f"{config.model_type!r}; known: {', '.join(names)}"
        )
    try:
        text = config.get_text_config()
    except ValueError as e:  # several text parts (MusicGen's text encoder and decoder): which is ambiguous
        raise SpecError(
            f"model {name}: model_type {config.model_type!r} has several text parts and transformers "
            f"cannot say which is its language model ({' '.join(str(e).split())[:160]}); autotune "
            "prices a language model's own code: give that part's config"
        ) from None
    if text is not config:  # a multimodal model: the language model's config is one of its parts
        raise SpecError(
            f"model {name}: model_type {config.model_type!r} is a multimodal model whose language "
            f"model is its {text.model_type!r} part; autotune prices a language model's own code: "
            f"give that part's config (its text_config, model_type {text.model_type!r})"
        )
    try:
        model = meta_model(config)
    except Exception as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), "")
        raise SpecError(
            f"model {name}: transformers {_version()} cannot build model_type {config.model_type!r} "
            f"from this config ({type(e).__name__}: {first})"
        ) from None
    count = sum(p.numel() for p in model.parameters())  # parameters() counts a tied matrix once
    blocks = _blocks(model)
    uniform = len({_block_kind(b) for b in blocks}) <= 1
    if blocks and len(blocks) != getattr(config, "num_hidden_layers", len(blocks)):
        # BART's causal LM: its decoder, while num_hidden_layers is the encoder's depth
        raise SpecError(
            f"model {name}: its config's num_hidden_layers {config.num_hidden_layers} is not the "
            f"{len(blocks)} decoder layers its causal LM ({type(model).__name__}) builds; autotune "
            "sizes and traces a model by num_hidden_layers"
        )
    g = lambda *keys, default=None: next(  # noqa: E731
        (getattr(config, k) for k in keys if getattr(config, k, None) is not None), default
    )
    h, heads = g("hidden_size"), g("num_attention_heads")
    if h is None or heads is None:  # a state-space or recurrent model (Mamba, RWKV): not a transformer's shape
        raise SpecError(
            f"model {name}: its config ({config.model_type}) names no "
            f"{'hidden_size' if h is None else 'num_attention_heads'}; autotune prices transformers "
            "whose config gives hidden_size, num_attention_heads and num_hidden_layers"
        )
    family = _FAMILY_OF.get(config.model_type)
    if family is None:  # nearest family for the analytic formulas; the count above is exact anyway
        family = "llama" if g("hidden_act", "activation_function", default="") in ("silu", "swish") else "gpt_neox"
    ffn = g("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size")  # ffn_dim: OPT, XGLM; Falcon's own
    if ffn is None:
        ratio = g("expansion_ratio")
        ffn = int(ratio * h) if ratio is not None else 4 * h  # GPT2MLP: n_inner or 4 * n_embd
    out, inp = model.get_output_embeddings(), model.get_input_embeddings()
    tied = out is not None and inp is not None and out.weight is inp.weight
    shape = {
        **FAMILY_DEFAULTS[family],
        "num_layers": g("num_hidden_layers"),
        "hidden_size": h,
        "num_heads": heads,
        "num_kv_heads": g("num_key_value_heads", default=heads),
        "ffn_hidden_size": ffn,
        "vocab_size": g("vocab_size"),
        "max_seq_len": g("max_position_embeddings", "n_positions", "max_seq_len", default=2048),
        "head_dim": g("head_dim", default=0),
        "tied_embeddings": tied,
    }
    if family == "llama":
        shape["linear_bias"] = bool(g("attention_bias", default=False))
    if family == "mpt":
        shape["linear_bias"] = shape["norm_bias"] = not g("no_bias", default=True)
    d = config.to_dict()
    if d.get("loss_type", "") is None:
        del d["loss_type"]  # to_dict writes None, which from_dict reads back as a named loss (a warning)
    if not d.get("architectures"):
        d["architectures"] = [type(model).__name__]
    # As the study will store it (JSON): tuples become lists, so a resumed spec compares equal.
    d = json.loads(json.dumps(d, default=str))
    try:
        return ModelSpec(
            name=name,
            family=family,
            source=source,
            implementation="hf",
            hf_config=d,
            param_count=count,
            uniform_blocks=uniform,
            **shape,
        )
    except TypeError as e:
        raise SpecError(f"model {name}: {e}") from None
