"""The Hugging Face implementation for autotune.costops: transformers' own modeling code, traced as
the code it is (GPT-2's eager `gelu_new`, dropout, Conv1D). A stand-in until autotune/impl.py's
`impl_for(spec).build/.loss` is wired in (same Build/Loss signatures)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from autotune.models import ModelSpec
from autotune.train_config import torch_dtype


def _config(spec: ModelSpec, num_layers: int, attention: str):
    if spec.family != "gpt2":
        raise ValueError(f"costops_hf prices the gpt2 family only (got {spec.family}); "
                         "autotune/impl.py's builders cover the rest")
    from transformers import GPT2Config

    # GPT-2's defaults stand: dropout 0.1 on embeddings, attention probabilities and residuals
    return GPT2Config(n_layer=num_layers, n_embd=spec.hidden_size, n_head=spec.num_heads,
                      n_inner=spec.ffn_hidden_size, n_positions=spec.max_seq_len, vocab_size=spec.vocab_size,
                      bos_token_id=spec.vocab_size - 1, eos_token_id=spec.vocab_size - 1,
                      attn_implementation=attention, use_cache=False, loss_type="ForCausalLM")


def hf_build(spec: ModelSpec, *, precision: str, attention: str) -> Callable[[int], nn.Module]:
    """autotune.costops.Build for transformers' GPT-2 (costops_hf must not import costops back)."""
    def build(num_layers: int) -> nn.Module:
        from transformers import GPT2LMHeadModel

        default = torch.get_default_dtype()
        torch.set_default_dtype(torch_dtype(precision))
        try:
            return GPT2LMHeadModel(_config(spec, num_layers, attention))
        finally:
            torch.set_default_dtype(default)
    return build


def hf_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM loss: labels are the inputs, shifted inside the model."""
    ids = batch[:, :-1]
    return model(input_ids=ids, labels=ids).loss
