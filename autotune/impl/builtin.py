"""The decoder transformer a trial trains, built from a ModelSpec.

This is the code the memory model's activation terms describe (autotune/memory/activations.py):
change one and re-derive the other. It is deliberately small (nanoGPT-like) so that every tensor
autograd keeps is visible here:

- Llama family: RMSNorm, fused q/k/v projection with grouped-query heads, rotary embedding,
  SwiGLU MLP, untied LM head.
- GPT-2 / GPT-NeoX / MPT families: LayerNorm, fused qkv, GELU MLP; GPT-2 adds learned positions.
  (NeoX's parallel residual and MPT's ALiBi bias are not reproduced: parameter count and the
  tensors kept per layer match a sequential block; the difference is noted in the trial result.)
- Attention: torch's scaled_dot_product_attention (flash/memory-efficient: keeps q, k, v, out and
  the log-sum-exp) or an eager softmax(QK^T/sqrt(d))V that keeps the s x s probabilities.
- Loss: cross entropy on logits upcast to fp32, as Hugging Face's ForCausalLMLoss does.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from autotune.models import ModelSpec


class Norm(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.rms = spec.norm == "rmsnorm"
        self.weight = nn.Parameter(torch.ones(spec.hidden_size))
        self.bias = nn.Parameter(torch.zeros(spec.hidden_size)) if spec.norm_bias else None
        self.eps = 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def rotary_tables(seq_len: int, head_dim: int, dtype: torch.dtype, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of RoFormer (Su et al. 2021, eq. 34), theta = 10000, shape (s, head_dim)."""
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    t = torch.arange(seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(t, inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, attention: str):
        super().__init__()
        self.spec, self.attention = spec, attention
        self.qkv = nn.Linear(spec.hidden_size, spec.q_dim + 2 * spec.kv_dim, bias=spec.linear_bias)
        self.out = nn.Linear(spec.q_dim, spec.hidden_size, bias=spec.linear_bias)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        s = self.spec
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([s.q_dim, s.kv_dim, s.kv_dim], dim=-1)
        q = q.view(b, t, s.num_heads, s.head_dim).transpose(1, 2)
        k = k.view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = v.view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=s.num_kv_heads != s.num_heads)
        else:
            rep = s.num_heads // s.num_kv_heads
            if rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(s.head_dim)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            probs = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
            y = probs @ v
        return self.out(y.transpose(1, 2).reshape(b, t, s.q_dim))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        h, f, bias = spec.hidden_size, spec.ffn_hidden_size, spec.linear_bias
        self.swiglu = spec.mlp == "swiglu"
        if self.swiglu:
            self.gate = nn.Linear(h, f, bias=bias)
        self.up = nn.Linear(h, f, bias=bias)
        self.down = nn.Linear(f, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, attention: str):
        super().__init__()
        self.norm1, self.attn = Norm(spec), Attention(spec, attention)
        self.norm2, self.mlp = Norm(spec), MLP(spec)

    def forward(self, x: torch.Tensor, rope=None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    """Decoder-only LM; `ckpt_layers` first blocks are activation-checkpointed."""

    def __init__(self, spec: ModelSpec, *, attention: str = "sdpa", ckpt_layers: int = 0):
        super().__init__()
        self.spec, self.ckpt_layers = spec, ckpt_layers
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.pos = nn.Embedding(spec.max_seq_len, spec.hidden_size) if spec.position == "learned" else None
        self.blocks = nn.ModuleList(Block(spec, attention) for _ in range(spec.num_layers))
        self.norm = Norm(spec)
        self.lm_head = None if spec.tied_embeddings else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = self.spec
        t = tokens.shape[1]
        x = self.embed(tokens)
        if self.pos is not None:
            x = x + self.pos(torch.arange(t, device=tokens.device))
        rope = rotary_tables(t, s.head_dim, x.dtype, x.device) if s.position == "rotary" else None
        for i, block in enumerate(self.blocks):
            if i < self.ckpt_layers and torch.is_grad_enabled():
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope)
        x = self.norm(x)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(x, weight)
        return F.cross_entropy(logits.float().view(-1, s.vocab_size), targets.reshape(-1))


def init_weights(model: Transformer, seed: int = 0) -> None:
    """GPT-2 style init (normal std 0.02, zero biases, unit norms), deterministic per seed."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        with torch.no_grad():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.02)
