"""Activation memory of the trial transformer (autotune/impl/builtin.py), in bytes.

Every count below is the list of tensors autograd saves for backward in that code, read off with
`torch.autograd.graph.saved_tensors_hooks` (measured: tests/test_memory_activations.py compares
these functions with the live bytes the profiler sees after a real forward, to the byte).
Notation: T = micro_batch * seq_len tokens, h hidden, q = heads*head_dim, kv = kv_heads*head_dim,
f ffn width, V vocab, e = bytes per activation element (4 fp32, 2 bf16/fp16).

Compared with Korthikanti et al. 2023 ("Reducing Activation Recomputation in Large Transformer
Models", arXiv:2205.05198, eq. 1: 34*s*b*h + 5*a*s^2*b per layer for GPT-3 in 16-bit), the terms
differ where the code differs: no dropout masks (no dropout), flash/memory-efficient attention
keeps a log-sum-exp instead of the a*s^2 scores, RMSNorm in PyTorch's composite kernel keeps two
fp32 copies of its input, SwiGLU keeps four f-wide tensors.
"""

from __future__ import annotations

from autotune.models import ModelSpec
from autotune.train_config import dtype_bytes

LSE_BYTES = 4
"""Flash / memory-efficient SDPA keeps a fp32 log-sum-exp per head and token (PyTorch
aten/src/ATen/native/transformers/attention.cpp, _scaled_dot_product_flash_attention_cpu)."""
INDEX_BYTES = 8
"""int64 targets, copied contiguous by `targets.reshape(-1)` and kept by nll_loss; also the int64
position indices (torch.arange) the learned position embedding keeps."""
LOSS_SCALARS_BYTES = 4
"""nll_loss keeps its fp32 total_weight, a 0-dim tensor (aten nll_loss_forward)."""
EAGER_SCALE_BYTES = 8
"""The eager path divides by math.sqrt(head_dim): autograd keeps that Python float as a 0-dim
float64 tensor per layer."""
CHECKPOINT_RNG_STATE_BYTES = 5056
"""torch.utils.checkpoint (preserve_rng_state=True) keeps torch.get_rng_state(), a 5056-byte
uint8 tensor (the mt19937 CPU generator state), per checkpointed call. It is host memory: on a GPU
it is not in the device's peak, and this term overstates that by 5 KB per layer."""


def norm_saved_per_token(spec: ModelSpec, e: int) -> int:
    """Bytes one norm layer keeps per token, its output (the next matmul's input) included.

    RMSNorm (F.rms_norm, composite): the input upcast to fp32 (x itself when already fp32), the
    fp32 rsqrt, the fp32 normalized tensor: 8h + 4; output e*h.
    LayerNorm (F.layer_norm, native): input e*h, mean and rstd e each; output e*h.
    """
    h = spec.hidden_size
    if spec.norm == "rmsnorm":
        return 8 * h + 4 + e * h
    return e * h + 2 * e + e * h


def attention_saved_per_token(spec: ModelSpec, e: int, seq_len: int, attention: str) -> float:
    """Bytes the attention block keeps per token (without its input norm).

    sdpa: the fused qkv output stays alive (v is a view of it), rotary adds the rotated q and k,
    SDPA keeps its output (which the out-projection reads as a view) and a fp32 log-sum-exp.
    eager: rotated q, the contiguous k^T and v the batched matmuls keep (after GQA repeat), the
    softmax probabilities (heads * s per token) and the re-laid-out output. The bool causal mask
    (s*s bytes per layer, whatever the micro batch) is `eager_mask_bytes`.
    """
    q, kv, heads = spec.q_dim, spec.kv_dim, spec.num_heads
    if attention == "sdpa":
        n = e * (q + 2 * kv) + e * q + LSE_BYTES * heads
        if spec.position == "rotary":
            n += e * (q + kv)
        return n
    return 4 * e * q + e * heads * seq_len


def eager_mask_bytes(seq_len: int) -> int:
    """The eager path's causal mask: a bool s x s tensor per layer (torch.ones(...).triu(1))."""
    return seq_len * seq_len


def mlp_saved_per_token(spec: ModelSpec, e: int) -> int:
    """SwiGLU keeps gate, up, silu(gate) and their product (4 e*f); GELU keeps up and gelu(up)."""
    return (4 if spec.mlp == "swiglu" else 2) * e * spec.ffn_hidden_size


def layer_saved_bytes(
    spec: ModelSpec, *, micro_batch: int, seq_len: int, precision: str, attention: str = "sdpa"
) -> int:
    """Bytes one un-checkpointed transformer block keeps from forward until its backward."""
    e = dtype_bytes(precision)
    tokens = micro_batch * seq_len
    per_token = (
        2 * norm_saved_per_token(spec, e)
        + attention_saved_per_token(spec, e, seq_len, attention)
        + mlp_saved_per_token(spec, e)
    )
    n = int(per_token * tokens)
    if attention == "eager":
        n += eager_mask_bytes(seq_len) + EAGER_SCALE_BYTES
    return n


def checkpointed_layer_bytes(
    spec: ModelSpec, *, micro_batch: int, seq_len: int, precision: str, attention: str = "sdpa"
) -> int:
    """A block under torch.utils.checkpoint(use_reentrant=False) keeps only its input x, the RNG
    state it restores for the recomputation and (eager path, measured) the 0-dim 1/sqrt(d)."""
    n = dtype_bytes(precision) * spec.hidden_size * micro_batch * seq_len + CHECKPOINT_RNG_STATE_BYTES
    return n + (EAGER_SCALE_BYTES if attention == "eager" else 0)


def rotary_table_bytes(spec: ModelSpec, *, seq_len: int, precision: str) -> int:
    """cos and sin tables (s x head_dim each), shared by all layers, kept once."""
    if spec.position != "rotary":
        return 0
    return 2 * seq_len * spec.head_dim * dtype_bytes(precision)


def head_saved_bytes(spec: ModelSpec, *, micro_batch: int, seq_len: int, precision: str) -> int:
    """Final norm, LM-head input, fp32 log-softmax output (V per token), int64 targets, the loss's
    scalars; with learned positions, the position indices the embedding keeps."""
    e = dtype_bytes(precision)
    tokens = micro_batch * seq_len
    per_token = norm_saved_per_token(spec, e) + 4 * spec.vocab_size + INDEX_BYTES
    positions = INDEX_BYTES * seq_len if spec.position == "learned" else 0
    return per_token * tokens + positions + LOSS_SCALARS_BYTES


def logits_forward_transient_bytes(spec: ModelSpec, *, micro_batch: int, seq_len: int, precision: str) -> int:
    """Live during cross entropy on top of what is saved: the logits in the model dtype (the
    local `logits` stays referenced) plus, for 16-bit models, their fp32 upcast."""
    e = dtype_bytes(precision)
    tokens = micro_batch * seq_len
    return tokens * spec.vocab_size * (e + (4 if e != 4 else 0))


def logits_backward_transient_bytes(spec: ModelSpec, *, micro_batch: int, seq_len: int, precision: str) -> int:
    """Backward of the loss: the fp32 gradient of the log-softmax output and of its input
    exist together (log_softmax_backward_data), on top of the saved log-softmax output."""
    return 8 * spec.vocab_size * micro_batch * seq_len


def activation_bytes(
    spec: ModelSpec, *, micro_batch: int, seq_len: int, precision: str, ckpt_layers: int, attention: str = "sdpa"
) -> dict[str, int]:
    """Everything saved at the end of forward, by term."""
    kw = dict(micro_batch=micro_batch, seq_len=seq_len, precision=precision)
    full = spec.num_layers - ckpt_layers
    return {
        "activations": full * layer_saved_bytes(spec, attention=attention, **kw),
        "checkpointed_inputs": ckpt_layers * checkpointed_layer_bytes(spec, attention=attention, **kw),
        "rotary_tables": rotary_table_bytes(spec, seq_len=seq_len, precision=precision),
        "logits_and_loss": head_saved_bytes(spec, **kw),
    }
