"""A user's own torch module for `--model-factory tiny_factory:make` (the contract in docs/models.md):
the function takes the ModelSpec (and the attention name), returns an nn.Module whose forward takes
input ids (b, s) and returns logits (b, s, vocab); its decoder layers are the ModuleList `.layers`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """Initialised in its own constructor (reset_parameters): under ZeRO-3, deepspeed.zero.Init
    partitions each module's parameters as its __init__ returns, so a loop over parameters in the
    top module's __init__ would only see empty shards."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


class Layer(nn.Module):
    """Pre-norm block: causal multi-head attention (torch's sdpa) and a GELU MLP."""

    def __init__(self, h: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.out = Linear(h, 3 * h), Linear(h, h)
        self.up, self.down = Linear(h, ffn), Linear(ffn, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in self.qkv(self.norm1(x)).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, h))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.embed = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            Layer(spec.hidden_size, spec.num_heads, spec.ffn_hidden_size) for _ in range(spec.num_layers)
        )
        self.norm = nn.LayerNorm(spec.hidden_size)
        self.head = Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def make(spec, attention: str = "sdpa") -> nn.Module:
    if attention != "sdpa":
        raise ValueError(f"TinyLM has sdpa attention only, not {attention}")
    return TinyLM(spec)


def make_with_an_unused_layer(spec, attention: str = "sdpa") -> nn.Module:
    """TinyLM with a trained parameter its forward never uses (as an encoder-decoder's cross-attention
    is in its decoder-only causal LM): it gets no gradient."""
    model = make(spec, attention)
    model.unused = Linear(spec.hidden_size, spec.hidden_size)
    return model
