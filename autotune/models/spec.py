"""ModelSpec, the shape of a model as memory and speed depend on it, and each family's defaults.

Apart from autotune.models (presets, config files, resolving what a user names) so that the
modules reading configs (autotune.models.hf_config) import the spec without importing back the
package that imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

from autotune.errors import SpecError

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
    """Whose code trials run and the memory model prices (autotune/impl/): `hf` the Hugging Face
    transformers model of `hf_config`, `builtin` the stand-in of autotune/impl/builtin.py, `factory`
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
            raise SpecError(
                f"model {self.name}: implementation must be one of "
                f"{', '.join(IMPLEMENTATIONS)}, got {self.implementation!r}"
            )
        if self.implementation == "factory" and ":" not in self.factory:
            raise SpecError(
                f"model {self.name}: implementation factory needs factory="
                f"'package.module:function', got {self.factory!r}"
            )
        for f in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "ffn_hidden_size",
            "vocab_size",
            "max_seq_len",
        ):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise SpecError(f"model {self.name}: {f} must be a positive integer, got {v!r}")
        if self.num_heads % self.num_kv_heads:
            raise SpecError(
                f"model {self.name}: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise SpecError(
                    f"model {self.name}: hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
                )
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

    @cached_property
    def num_params(self) -> int:
        """Exact parameter count: the meta-device model's where it was counted, else the shape's (kept on
        the frozen instance: the memory model asks it many times per estimate)."""
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
        return (
            f"{self.name}: {fmt_count(self.num_params)} params, {self.num_layers} layers, hidden "
            f"{self.hidden_size}, {self.num_heads} heads{kv}, ffn {self.ffn_hidden_size}, "
            f"vocab {self.vocab_size} ({self.family}; code: {self.code_name})"
        )

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
    "llama": dict(
        mlp="swiglu", norm="rmsnorm", norm_bias=False, linear_bias=False, position="rotary", tied_embeddings=False
    ),
    "gpt2": dict(
        mlp="gelu", norm="layernorm", norm_bias=True, linear_bias=True, position="learned", tied_embeddings=True
    ),
    "gpt_neox": dict(
        mlp="gelu", norm="layernorm", norm_bias=True, linear_bias=True, position="rotary", tied_embeddings=False
    ),
    "mpt": dict(
        mlp="gelu", norm="layernorm", norm_bias=False, linear_bias=False, position="alibi", tied_embeddings=True
    ),
}
