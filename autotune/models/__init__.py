"""Model shapes: `ModelSpec`, the presets in `data/models.yaml`, and Hugging Face `config.json` files.

The parameter count is computed exactly from the shape (no rounding, no published constant),
and tested against the counts the model cards publish.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field, replace
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml

from autotune.errors import SpecError  # noqa: F401 - re-exported: models raise it

Family = Literal["llama", "gpt2", "gpt_neox", "mpt"]
Implementation = Literal["hf", "builtin", "factory"]
IMPLEMENTATIONS = ("hf", "builtin", "factory")


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The shape of a decoder-only transformer, as much as memory and speed depend on."""

    name: str
    """Canonical name (a preset key) or the path of the config.json it came from."""
    family: Family
    """Architecture family, decides the defaults below and the trial's code path."""
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    """Key/value heads: equal to num_heads for multi-head attention, fewer for GQA/MQA."""
    ffn_hidden_size: int
    """Inner width of the MLP (SwiGLU has three matrices of h x ffn, GELU two)."""
    vocab_size: int
    max_seq_len: int
    mlp: Literal["swiglu", "gelu"]
    norm: Literal["rmsnorm", "layernorm"]
    norm_bias: bool
    """LayerNorm with a bias vector (GPT-2, GPT-NeoX) or without (MPT's low-precision LN)."""
    linear_bias: bool
    """Biases on the attention and MLP projections (GPT-2, GPT-NeoX yes; Llama, MPT no)."""
    position: Literal["rotary", "learned", "alibi"]
    """Learned absolute position embeddings add max_seq_len x hidden parameters; rotary and ALiBi none."""
    tied_embeddings: bool
    """The LM head reuses the token embedding matrix (GPT-2, MPT) or has its own (Llama)."""
    head_dim: int = 0
    """Per-head width; 0 means hidden_size // num_heads."""
    source: str = ""
    """Where the shape comes from (model card, config.json on the Hub, paper)."""
    implementation: Implementation = "hf"
    """Whose code trials run and the memory model prices (autotune/impl.py): `hf` the Hugging Face
    transformers model of `hf_config`, `builtin` the stand-in of autotune/builtin.py, `factory`
    the user's module made by `factory`."""
    hf_config: dict | None = field(default=None, hash=False)
    """The Hugging Face config (PretrainedConfig.to_dict(), or for a preset the few keys of its
    family's config class that its shape sets); None: built from the shape when needed
    (autotune.models.hf_config.config_dict). Not hashed: a dict is not hashable, and the shape fields identify."""
    factory: str = ""
    """`package.module:function` that makes the module, for implementation `factory` (docs/models.md)."""
    param_count: int = 0
    """Exact parameter count of the model built on the meta device, where it was built (Hugging Face
    configs); 0: the shape's count (`shape_params`), which tests check equal to it for the presets."""
    uniform_blocks: bool = True
    """Every decoder layer is the same module (class and parameter shapes), so the memory model may
    extrapolate from a few of them; False for stacks that mix kinds (DeepSeek's dense first layers
    before its MoE ones, Jamba's attention among Mamba layers), read from the meta-device model."""

    def __post_init__(self) -> None:
        if self.implementation not in IMPLEMENTATIONS:
            raise SpecError(f"model {self.name}: implementation must be one of "
                            f"{', '.join(IMPLEMENTATIONS)}, got {self.implementation!r}")
        if self.implementation == "factory" and ":" not in self.factory:
            raise SpecError(f"model {self.name}: implementation factory needs factory="
                            f"'package.module:function', got {self.factory!r}")
        for f in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "ffn_hidden_size",
                  "vocab_size", "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise SpecError(f"model {self.name}: {f} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise SpecError(f"model {self.name}: num_heads ({self.num_heads}) must be a multiple of "
                            f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise SpecError(f"model {self.name}: hidden_size {self.hidden_size} is not divisible "
                                f"by num_heads {self.num_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def norm_params(self) -> int:
        """Parameters of one norm layer: weight, plus bias for LayerNorm with bias."""
        return self.hidden_size * (2 if self.norm_bias else 1)

    @property
    def attention_params(self) -> int:
        h, b = self.hidden_size, self.linear_bias
        qkv = h * (self.q_dim + 2 * self.kv_dim) + (self.q_dim + 2 * self.kv_dim if b else 0)
        out = self.q_dim * h + (h if b else 0)
        return qkv + out

    @property
    def mlp_params(self) -> int:
        h, f, b = self.hidden_size, self.ffn_hidden_size, self.linear_bias
        if self.mlp == "swiglu":  # gate, up: h->f; down: f->h (Shazeer 2020, "GLU Variants")
            return 3 * h * f + ((2 * f + h) if b else 0)
        return 2 * h * f + ((f + h) if b else 0)

    @property
    def layer_params(self) -> int:
        """One transformer block: attention, MLP and its two norms."""
        return self.attention_params + self.mlp_params + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Token embedding (+ learned positions) + final norm + untied LM head."""
        n = self.vocab_size * self.hidden_size
        if self.position == "learned":
            n += self.max_seq_len * self.hidden_size
        n += self.norm_params
        if not self.tied_embeddings:
            n += self.vocab_size * self.hidden_size
        return n

    @property
    def shape_params(self) -> int:
        """Parameter count from the shape (Llama-2-13B: 13,015,864,320 as on its model card's safetensors)."""
        return self.embedding_params + self.num_layers * self.layer_params

    @property
    def num_params(self) -> int:
        """Exact parameter count: the meta-device model's where it was counted, else the shape's."""
        return self.param_count or self.shape_params

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, forward+backward: 6N plus attention's 12*L*h*s.

        Kaplan et al. 2020 (arXiv:2001.08361) Table 1 count 2N + 2*L*s*d_attn per token forward
        and twice that backward; the attention term here uses q_dim for d_attn. This is the
        "model FLOPs" of the PaLM paper's MFU (Chowdhery et al. 2022, App. B): recomputation
        for checkpointing is not counted.
        """
        return 6.0 * self.num_params + 12.0 * self.num_layers * self.q_dim * seq_len

    def describe(self) -> str:
        from autotune.units import fmt_count

        kv = f", {self.num_kv_heads} kv heads" if self.num_kv_heads != self.num_heads else ""
        return (f"{self.name}: {fmt_count(self.num_params)} params, {self.num_layers} layers, hidden "
                f"{self.hidden_size}, {self.num_heads} heads{kv}, ffn {self.ffn_hidden_size}, "
                f"vocab {self.vocab_size} ({self.family}; code: {self.code_name})")

    @property
    def code_name(self) -> str:
        """Which code the numbers describe, for reports: `hf:LlamaForCausalLM`-like, `builtin`, or
        `factory:pkg.mod:fn`."""
        if self.implementation == "factory":
            return f"factory:{self.factory}"
        if self.implementation == "hf":
            arch = (self.hf_config or {}).get("architectures") or []
            return f"hf:{arch[0]}" if arch else f"hf:{self.model_type}"
        return "builtin"

    @property
    def model_type(self) -> str:
        """The Hugging Face model_type: the config's, else the family's (mistral-7b: mistral)."""
        return (self.hf_config or {}).get("model_type") or self.family


# ---- family defaults ------------------------------------------------------------------------
# What each Hugging Face architecture really builds, read from transformers' modeling files:
#   llama/mistral: modeling_llama.py  - LlamaRMSNorm (weight only), q/k/v/o bias=config.attention_bias
#                  (default False), gate/up/down bias=config.mlp_bias (default False), rotary.
#   gpt2:          modeling_gpt2.py   - LayerNorm with bias, Conv1D with bias, learned wpe, tied lm_head.
#   gpt_neox:      modeling_gpt_neox.py - LayerNorm with bias, Linear with bias, rotary, untied embed_out.
#   mpt:           modeling_mpt.py    - LayerNorm bias=False when no_bias (default True), ALiBi, tied.
FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": dict(mlp="swiglu", norm="rmsnorm", norm_bias=False, linear_bias=False,
                  position="rotary", tied_embeddings=False),
    "gpt2": dict(mlp="gelu", norm="layernorm", norm_bias=True, linear_bias=True,
                 position="learned", tied_embeddings=True),
    "gpt_neox": dict(mlp="gelu", norm="layernorm", norm_bias=True, linear_bias=True,
                     position="rotary", tied_embeddings=False),
    "mpt": dict(mlp="gelu", norm="layernorm", norm_bias=False, linear_bias=False,
                position="alibi", tied_embeddings=True),
}


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
    builtin: the stand-in of autotune/builtin.py, for the four families it reproduces.
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

            return replace(spec, implementation="hf",
                           hf_config=hf.preset_config(spec, _raw()[name].get("model_type", spec.family)))
        return replace(spec, implementation=implementation, factory=factory or "")
    path = Path(text).expanduser()
    if path.suffix == ".json" or path.exists():
        if path.is_dir():
            path = path / "config.json"
        if implementation == "builtin":
            return replace(from_hf_config(path), implementation="builtin")
        from autotune.models import hf_config as hf

        spec = hf.spec_from_config(hf.load_config(str(path)), name=str(path), source=f"config.json at {path}")
        return replace(spec, implementation=implementation, factory=factory or "")
    if "/" in text and implementation != "builtin":
        from autotune.models import hf_config as hf  # a hub id: only the local cache is read, never the network

        spec = hf.spec_from_config(hf.load_config(text), name=text, source=f"{text} in the local Hugging Face cache")
        return replace(spec, implementation=implementation, factory=factory or "")
    names = sorted(set(table) | set(aliases()))
    close = difflib.get_close_matches(key, names, n=4, cutoff=0.5)
    hint = f" Did you mean: {', '.join(close)}?" if close else ""
    raise SpecError(f"unknown model {text!r}.{hint} Run `autotune models` for the presets, "
                    f"or pass a Hugging Face config.json, a directory holding one, or a hub id in "
                    f"the local Hugging Face cache.")


# ---- Hugging Face config.json ---------------------------------------------------------------
# Per model_type: our field <- (their key, default or REQUIRED). Defaults are those of the
# transformers configuration classes (configuration_<family>.py).
REQUIRED = object()
_HF_FIELDS: dict[str, tuple[str, dict[str, tuple[str, Any]]]] = {
    "llama": ("llama", {
        "num_layers": ("num_hidden_layers", REQUIRED), "hidden_size": ("hidden_size", REQUIRED),
        "num_heads": ("num_attention_heads", REQUIRED), "num_kv_heads": ("num_key_value_heads", None),
        "ffn_hidden_size": ("intermediate_size", REQUIRED), "vocab_size": ("vocab_size", REQUIRED),
        "max_seq_len": ("max_position_embeddings", 2048), "tied_embeddings": ("tie_word_embeddings", False),
        "linear_bias": ("attention_bias", False), "head_dim": ("head_dim", 0)}),
    "gpt2": ("gpt2", {
        "num_layers": ("n_layer", REQUIRED), "hidden_size": ("n_embd", REQUIRED),
        "num_heads": ("n_head", REQUIRED), "ffn_hidden_size": ("n_inner", None),
        "vocab_size": ("vocab_size", REQUIRED), "max_seq_len": ("n_positions", 1024),
        "tied_embeddings": ("tie_word_embeddings", True)}),
    "gpt_neox": ("gpt_neox", {
        "num_layers": ("num_hidden_layers", REQUIRED), "hidden_size": ("hidden_size", REQUIRED),
        "num_heads": ("num_attention_heads", REQUIRED), "ffn_hidden_size": ("intermediate_size", REQUIRED),
        "vocab_size": ("vocab_size", REQUIRED), "max_seq_len": ("max_position_embeddings", 2048),
        "tied_embeddings": ("tie_word_embeddings", False)}),
    "mpt": ("mpt", {
        "num_layers": ("n_layers", REQUIRED), "hidden_size": ("d_model", REQUIRED),
        "num_heads": ("n_heads", REQUIRED), "ffn_hidden_size": ("expansion_ratio", 4),
        "vocab_size": ("vocab_size", REQUIRED), "max_seq_len": ("max_seq_len", 2048),
        "linear_bias": ("no_bias", True)}),
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
        raise SpecError(f"model config {path}: model_type {mtype!r} is not supported; "
                        f"supported: {', '.join(sorted(_HF_FIELDS))}")
    family, fields = _HF_FIELDS[mtype]
    shape: dict[str, Any] = {}
    for ours, (theirs, default) in fields.items():
        if theirs in cfg and cfg[theirs] is not None:
            shape[ours] = cfg[theirs]
        elif default is REQUIRED:
            raise SpecError(f"model config {path}: missing field {theirs!r} (needed for {ours}, "
                            f"model_type {mtype})")
        elif default is not None:
            shape[ours] = default
    if family == "llama" and bool(cfg.get("mlp_bias", False)) != bool(shape.get("linear_bias")):
        raise SpecError(f"model config {path}: attention_bias and mlp_bias differ; only both or "
                        f"neither is modelled")
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
