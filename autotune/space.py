"""The training configuration autotune searches over: `TrainConfig`, and its checks against a model
and a cluster (`check_config`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from autotune.hardware import Cluster
from autotune.models import ModelSpec, SpecError

PRECISIONS = ("fp32", "fp16", "bf16")
OPTIMIZERS = ("adamw", "adamw8bit")
ATTENTIONS = ("sdpa", "eager", "flash_attention_2")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One candidate: everything a DeepSpeed run needs besides the model and the GPUs."""

    zero_stage: int = 0
    """ZeRO stage 0-3 (Rajbhandari et al. 2020): 1 shards optimizer states, 2 also gradients,
    3 also parameters, over the data-parallel ranks."""
    ckpt_layers: int = 0
    """How many transformer blocks (the first k of L) recompute their activations in backward."""
    micro_batch: int = 1
    """Sequences per GPU per forward pass (DeepSpeed's train_micro_batch_size_per_gpu)."""
    grad_accum: int = 1
    """Micro batches accumulated per optimizer step."""
    precision: Literal["fp32", "fp16", "bf16"] = "bf16"
    """fp32; fp16 with dynamic loss scaling; bf16. Both 16-bit modes keep fp32 master weights."""
    optimizer: Literal["adamw", "adamw8bit"] = "adamw"
    """AdamW with fp32 moments, or 8-bit AdamW (bitsandbytes; moments in 1 byte each)."""
    offload_optimizer: bool = False
    """ZeRO-Offload: optimizer states and the step on the CPU (needs ZeRO >= 1)."""
    seq_len: int = 2048
    attention: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """transformers' attn_implementation names. sdpa: torch's scaled_dot_product_attention
    (memory-efficient/flash kernels, no s x s matrix kept; what transformers picks by default);
    eager: the explicit softmax(QK^T)V that keeps the s x s scores; flash_attention_2: the
    flash-attn package's kernels (GPU and the hf code only)."""

    def __post_init__(self) -> None:
        if self.zero_stage not in (0, 1, 2, 3):
            raise SpecError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        for name in ("micro_batch", "grad_accum", "seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise SpecError(f"{name} must be a positive integer, got {v!r}")
        if not isinstance(self.ckpt_layers, int) or self.ckpt_layers < 0:
            raise SpecError(f"ckpt_layers must be an integer >= 0, got {self.ckpt_layers!r}")
        if self.precision not in PRECISIONS:
            raise SpecError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.optimizer not in OPTIMIZERS:
            raise SpecError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.attention not in ATTENTIONS:
            raise SpecError(f"attention must be one of {', '.join(ATTENTIONS)}, got {self.attention!r}")
        if self.offload_optimizer and self.zero_stage == 0:
            raise SpecError("offload_optimizer needs ZeRO stage 1, 2 or 3 (DeepSpeed offloads the "
                            "partitioned optimizer only)")
        if self.offload_optimizer and self.optimizer == "adamw8bit":
            raise SpecError("offload_optimizer runs DeepSpeed's CPU Adam, which has no 8-bit states; "
                            "choose one of the two")

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq_len

    def to_dict(self) -> dict:
        return asdict(self)

    def key(self) -> tuple:
        """Identity of the candidate, for de-duplication."""
        return tuple(sorted(asdict(self).items()))

    def short(self) -> str:
        parts = [f"z{self.zero_stage}", self.precision, f"mb{self.micro_batch}", f"ga{self.grad_accum}",
                 f"ckpt{self.ckpt_layers}"]
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        if self.offload_optimizer:
            parts.append("offload")
        if self.attention != "sdpa":
            parts.append(self.attention)
        return " ".join(parts)


def check_config(cfg: TrainConfig, model: ModelSpec, cluster: Cluster) -> None:
    """Raise SpecError if `cfg` cannot run `model` on `cluster`, saying what is allowed."""
    if cfg.ckpt_layers > model.num_layers:
        raise SpecError(f"ckpt_layers {cfg.ckpt_layers} exceeds the model's {model.num_layers} layers "
                        f"(allowed: 0..{model.num_layers})")
    if cfg.precision == "bf16" and not cluster.gpu.bf16:
        raise SpecError(f"{cluster.gpu.name} has no native bf16 (Ampere or newer needed); "
                        f"use --precision fp16 or fp32")
    if cfg.precision == "fp16" and cluster.gpu.is_cpu:
        raise SpecError("fp16 cannot run on CPU ranks: DeepSpeed refuses it there "
                        "('Type fp16 is not supported on your device'); use bf16 or fp32, "
                        "or estimate it for a GPU")
    if model.position == "learned" and cfg.seq_len > model.max_seq_len:
        raise SpecError(f"seq_len {cfg.seq_len} exceeds {model.name}'s {model.max_seq_len} learned "
                        f"positions")
    if cfg.attention == "flash_attention_2":
        if cluster.gpu.is_cpu:
            raise SpecError("attention flash_attention_2 runs CUDA kernels only (flash-attn package); "
                            "CPU ranks can run sdpa or eager")
        if model.implementation != "hf":
            raise SpecError(f"attention flash_attention_2 is a transformers attn_implementation; the "
                            f"{model.implementation} code has sdpa or eager")
    if cfg.optimizer == "adamw8bit" and cluster.gpu.is_cpu:
        raise SpecError("8-bit AdamW (bitsandbytes) needs a GPU; CPU ranks can run adamw")
