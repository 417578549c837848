"""Model shapes: `ModelSpec`, the presets in `data/models.yaml`, and Hugging Face `config.json` files.

The parameter count is computed exactly from the shape (no rounding, no published constant),
and tested against the counts the model cards publish.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from autotune.errors import SpecError
from autotune.models.spec import (  # noqa: F401 - the package's names
    FAMILY_DEFAULTS,
    IMPLEMENTATIONS,
    Family,
    Implementation,
    ModelSpec,
)

DEFAULT_SEQ_LEN = 2048


def default_seq_len(model: ModelSpec) -> int:
    """2048 tokens, or the model's own maximum where that is shorter (GPT-2: 1024)."""
    return min(DEFAULT_SEQ_LEN, model.max_seq_len)


def _build(name: str, family: str, shape: dict[str, Any], source: str) -> ModelSpec:
    if family not in FAMILY_DEFAULTS:
        raise SpecError(f"model {name}: unknown family {family!r}; known: {', '.join(FAMILY_DEFAULTS)}")
    kw = {**FAMILY_DEFAULTS[family], **shape}
    kw.setdefault("num_kv_heads", kw.get("num_heads"))
    try:
        return ModelSpec(name=name, family=family, source=source, **kw)
    except TypeError as e:
        raise SpecError(f"model {name}: {e}") from None


def from_shape(name: str, family: str, *, source: str = "", **shape: Any) -> ModelSpec:
    """A ModelSpec from its family and shape, the family's defaults filling the rest (as presets)."""
    return _build(name, family, shape, source)


@cache
def _raw() -> dict[str, dict]:
    """autotune/data/models.yaml, read once."""
    return yaml.safe_load(resources.files("autotune").joinpath("data/models.yaml").read_text())["models"]


@cache
def presets() -> dict[str, ModelSpec]:
    """Canonical name -> ModelSpec, from autotune/data/models.yaml."""
    out = {}
    for name, entry in _raw().items():
        entry = dict(entry)
        family, source = entry.pop("family"), entry.pop("source")
        entry.pop("aliases", None)
        entry.pop("published_params", None)
        entry.pop("model_type", None)
        out[name] = _build(name, family, entry, source)
    return out


@cache
def aliases() -> dict[str, str]:
    out = {}
    for name, entry in _raw().items():
        for a in entry.get("aliases", []):
            out[str(a).lower()] = name
    return out


def published_params() -> dict[str, int]:
    """Preset name -> parameter count its model card publishes (for tests)."""
    return {n: e["published_params"] for n, e in _raw().items() if "published_params" in e}


def resolve_model(text: str, *, implementation: Implementation = "hf", factory: str | None = None) -> ModelSpec:
    """A preset name, an alias (`13b`), a Hugging Face config.json, a directory holding one, or a
    hub id already in the local Hugging Face cache, for the code `implementation` names.

    hf: presets become the config of their family (autotune.models.hf_config.preset_config); a config keeps all
    its fields and its exact parameter count is that of the model built on the meta device.
    builtin: the stand-in of autotune/impl/builtin.py, for the four families it reproduces.
    factory: the shape from `text`, the module from `factory` ("package.module:function")."""
    if implementation not in IMPLEMENTATIONS:
        raise SpecError(f"--impl must be one of {', '.join(IMPLEMENTATIONS)}, got {implementation!r}")
    if implementation == "factory" and not factory:
        raise SpecError("--impl factory needs --model-factory package.module:function")
    if factory and implementation != "factory":
        implementation = "factory"  # --model-factory alone means the factory's code
    key = text.strip().lower()
    table = presets()
    name = key if key in table else aliases().get(key)
    if name is not None:
        spec = table[name]
        if implementation == "hf":
            from autotune.models import hf_config as hf

            return replace(
                spec, implementation="hf", hf_config=hf.preset_config(spec, _raw()[name].get("model_type", spec.family))
            )
        return replace(spec, implementation=implementation, factory=factory or "")
    path = Path(text).expanduser()
    if path.suffix == ".json" or path.exists():
        if path.is_dir():
            path = path / "config.json"
        if implementation == "builtin":
            return replace(from_hf_config(path), implementation="builtin")
        from autotune.models import hf_config as hf

        with hf.held_warnings():  # a refused config shows its error alone
            spec = hf.spec_from_config(hf.load_config(str(path)), name=str(path), source=f"config.json at {path}")
        return replace(spec, implementation=implementation, factory=factory or "")
    if "/" in text and implementation != "builtin":
        from autotune.models import hf_config as hf  # a hub id: only the local cache is read, never the network

        with hf.held_warnings():
            spec = hf.spec_from_config(
                hf.load_config(text), name=text, source=f"{text} in the local Hugging Face cache"
            )
        return replace(spec, implementation=implementation, factory=factory or "")
    names = sorted(set(table) | set(aliases()))
    close = difflib.get_close_matches(key, names, n=4, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise SpecError(
        f"unknown model {text!r}.{hint} Run `autotune models` for the presets, "
        f"or pass a Hugging Face config.json, a directory holding one, or a hub id in "
        f"the local Hugging Face cache."
    )


# ---- Hugging Face config.json ---------------------------------------------------------------
# Per model_type: our field <- (their key, default or REQUIRED). Defaults are those of the
# transformers configuration classes (configuration_<family>.py).
REQUIRED = object()
_HF_FIELDS: dict[str, tuple[str, dict[str, tuple[str, Any]]]] = {
    "llama": (
        "llama",
        {
            "num_layers": ("num_hidden_layers", REQUIRED),
            "hidden_size": ("hidden_size", REQUIRED),
            "num_heads": ("num_attention_heads", REQUIRED),
            "num_kv_heads": ("num_key_value_heads", None),
            "ffn_hidden_size": ("intermediate_size", REQUIRED),
            "vocab_size": ("vocab_size", REQUIRED),
            "max_seq_len": ("max_position_embeddings", 2048),
            "tied_embeddings": ("tie_word_embeddings", False),
            "linear_bias": ("attention_bias", False),
            "head_dim": ("head_dim", 0),
        },
    ),
    "gpt2": (
        "gpt2",
        {
            "num_layers": ("n_layer", REQUIRED),
            "hidden_size": ("n_embd", REQUIRED),
            "num_heads": ("n_head", REQUIRED),
            "ffn_hidden_size": ("n_inner", None),
            "vocab_size": ("vocab_size", REQUIRED),
            "max_seq_len": ("n_positions", 1024),
            "tied_embeddings": ("tie_word_embeddings", True),
        },
    ),
    "gpt_neox": (
        "gpt_neox",
        {
            "num_layers": ("num_hidden_layers", REQUIRED),
            "hidden_size": ("hidden_size", REQUIRED),
            "num_heads": ("num_attention_heads", REQUIRED),
            "ffn_hidden_size": ("intermediate_size", REQUIRED),
            "vocab_size": ("vocab_size", REQUIRED),
            "max_seq_len": ("max_position_embeddings", 2048),
            "tied_embeddings": ("tie_word_embeddings", False),
        },
    ),
    "mpt": (
        "mpt",
        {
            "num_layers": ("n_layers", REQUIRED),
            "hidden_size": ("d_model", REQUIRED),
            "num_heads": ("n_heads", REQUIRED),
            "ffn_hidden_size": ("expansion_ratio", 4),
            "vocab_size": ("vocab_size", REQUIRED),
            "max_seq_len": ("max_seq_len", 2048),
            "linear_bias": ("no_bias", True),
        },
    ),
}
_HF_FIELDS["mistral"] = _HF_FIELDS["llama"]


def from_hf_config(path: Path) -> ModelSpec:
    """Read a Hugging Face config.json (llama, mistral, gpt2, gpt_neox, mpt)."""
    try:
        cfg = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(f"model config {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise SpecError(f"model config {path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise SpecError(f"model config {path} must hold a JSON object")
    mtype = cfg.get("model_type")
    if mtype not in _HF_FIELDS:
        raise SpecError(
            f"model config {path}: model_type {mtype!r} is not supported; supported: {', '.join(sorted(_HF_FIELDS))}"
        )
    family, fields = _HF_FIELDS[mtype]
    shape: dict[str, Any] = {}
    for ours, (theirs, default) in fields.items():
        if theirs in cfg and cfg[theirs] is not None:
            shape[ours] = cfg[theirs]
        elif default is REQUIRED:
            raise SpecError(f"model config {path}: missing field {theirs!r} (needed for {ours}, model_type {mtype})")
        elif default is not None:
            shape[ours] = default
    if family == "llama" and bool(cfg.get("mlp_bias", False)) != bool(shape.get("linear_bias")):
        raise SpecError(f"model config {path}: attention_bias and mlp_bias differ; only both or neither is modelled")
    if family == "gpt2" and "ffn_hidden_size" not in shape:
        shape["ffn_hidden_size"] = 4 * shape["hidden_size"]  # GPT2MLP: inner_dim = n_inner or 4*n_embd
    if family == "mpt":
        shape["ffn_hidden_size"] = int(shape["ffn_hidden_size"] * shape["hidden_size"])
        shape["linear_bias"] = not shape["linear_bias"]  # MPT's key is no_bias
        shape["norm_bias"] = shape["linear_bias"]
        shape["tied_embeddings"] = True
    if family == "llama" and shape.get("num_kv_heads") is None:
        shape.pop("num_kv_heads", None)
    return _build(str(path), family, shape, source=f"config.json at {path}")
