"""The op tracer of the cost model (autotune/costops/): one forward+backward on fake tensors under
a TorchDispatchMode that records every kernel-launching op as a costops.Op. Imported only when a
profile is traced, not read from the trace cache (autotune/trace_cache.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.utils.flop_counter as fc
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autotune.costops.ops import Op, OpProfile

aten = torch.ops.aten
GEMM_OPS = {aten.mm, aten.addmm, aten.bmm, aten.baddbmm}
"""aten ops a linear layer or a matmul lowers to (nn.Linear -> addmm/mm; q @ k^T -> bmm)."""
SDPA_FWD = {
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
}
SDPA_BWD = {
    aten._scaled_dot_product_flash_attention_backward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward,
    aten._scaled_dot_product_efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention_backward,
}
NO_KERNEL = {
    aten.empty,
    aten.empty_strided,
    aten.empty_like,
    aten.detach,
    aten.lift_fresh,
    aten._unsafe_view,
    aten._local_scalar_dense,
    aten.sym_size,
    aten.sym_stride,
    aten.sym_numel,
}
"""Ops that allocate or describe a tensor without launching a kernel (views are skipped by their
schema: OpOverload.is_view)."""


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for `t`: its elements, at most its storage (a broadcast (expanded)
    input is read once per stored element, not once per logical element)."""
    return min(t.numel(), t.untyped_storage().nbytes() // max(t.element_size(), 1)) * t.element_size()


def _grouped_gemm(args, out) -> tuple[float, tuple]:
    """FLOPs and (groups, m, k, n) of torch._grouped_mm, the GEMM of transformers' MoE experts: (S, K)
    x (E, K, N) -> (S, N), each row through its group's (expert's) weight; (M, S) x (S, N) -> (E, M,
    N), the weight gradient, each group summing its own rows; or (E, M, K) x (E, K, N), batched
    (torch's `_grouped_mm` documentation). The groups' sizes are data (offs, the routing), so the
    tile shape assumes an even split; the FLOPs do not depend on it."""
    a, b = args[0], args[1]
    if a.dim() == 2 and b.dim() == 3:
        (rows, k), groups, n = a.shape, b.shape[0], b.shape[2]
        return 2.0 * rows * k * n, (groups, max(1, rows // groups), k, n)
    if a.dim() == 2 and b.dim() == 2:
        (m, rows), groups, n = a.shape, out.shape[0], b.shape[1]
        return 2.0 * m * rows * n, (groups, m, max(1, rows // groups), n)
    m, k, n = out.shape[-2] if out.dim() == 3 else out.shape[0], a.shape[-1], out.shape[-1]
    groups = out.numel() // (m * n)
    return 2.0 * groups * m * k * n, (groups, m, k, n)


def _gemm_shape(func, args) -> tuple:
    packet = func._overloadpacket
    a, b = (args[1], args[2]) if packet in (aten.addmm, aten.baddbmm) else (args[0], args[1])
    if a.dim() == 3:
        return (a.shape[0], a.shape[1], a.shape[2], b.shape[2])
    return (1, a.shape[0], a.shape[1], b.shape[1])


class _Recorder(TorchDispatchMode):
    """Counts each kernel-launching op of the step (see Op)."""

    def __init__(self, seq_len: int, score_numel: int) -> None:
        super().__init__()
        self.ops: Counter[Op] = Counter()
        self.phase = "fwd"
        self.seq_len, self.score_numel = seq_len, score_numel

    def _touches_scores(self, tensors: list[torch.Tensor]) -> bool:
        """An eager attention score tensor: (..., s, s) with micro batch x heads x s x s elements
        (not a weight or an activation whose hidden size happens to equal s)."""
        s = self.seq_len
        return any(t.dim() >= 3 and tuple(t.shape[-2:]) == (s, s) and t.numel() == self.score_numel for t in tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if func.is_view or packet in NO_KERNEL or func.namespace == "prim":
            return out
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        nbytes = sum(_nbytes(t) for t in tensors)
        scores = "attention" if self._touches_scores(tensors) else ""
        if packet in GEMM_OPS:
            op = Op(
                "gemm",
                packet.__name__,
                self.phase,
                float(fc.flop_registry[packet](*args, **kwargs, out_val=out)),
                nbytes,
                _gemm_shape(func, args),
                scores,
            )
        elif packet is aten._grouped_mm:
            flops, shape = _grouped_gemm(args, out)
            op = Op("gemm", packet.__name__, self.phase, flops, nbytes, shape, scores)
        elif packet in SDPA_FWD or packet in SDPA_BWD:
            op = self._attention(packet, args, kwargs, nbytes)
        else:
            op = Op("elementwise", packet.__name__, self.phase, 0.0, nbytes, term=scores)
        self.ops[op] += 1
        return out

    def _attention(self, packet, args, kwargs, nbytes: int) -> Op:
        """FLOPs as torch.utils.flop_counter counts sdpa (full s x s, causal or not; backward = the
        recomputed scores + four matmuls); the CPU flash op has no registered formula, so the
        formula is called on the shapes here."""
        if packet in SDPA_FWD:
            q, k, v = args[:3]
            flops = fc.sdpa_flop_count(q.shape, k.shape, v.shape)
        else:
            grad, q, k, v = args[:4]
            flops = fc.sdpa_backward_flop_count(grad.shape, q.shape, k.shape, v.shape)
        causal = bool(kwargs.get("is_causal", False) or any(a is True for a in args[3:]))
        b, h, s, d = q.shape
        return Op("attention", packet.__name__, self.phase, float(flops), nbytes, (b, h, s, k.shape[2], d, causal))


Build = Callable[[int], nn.Module]
"""Builds the model with the given number of blocks (in the target dtype, on the fake mode)."""
Loss = Callable[[nn.Module, torch.Tensor], torch.Tensor]
"""The training loss of the model on a (micro batch, seq len + 1) token batch."""


def _trace(
    build: Build, loss: Loss, num_layers: int, micro_batch: int, seq_len: int, vocab: int, heads: int = 0
) -> Counter[Op]:
    """The ops of one forward+backward on fake tensors, on the branch a real run takes: transformers'
    masks read the position ids, which fake tensors cannot, and would build a 4-D mask where a real
    run passes none and runs a causal kernel (memory/code_trace.py `unpacked_sequences`)."""
    from autotune.memory.code_trace import unpacked_sequences
    from autotune.memory.tracer import fake_mode

    with fake_mode(), unpacked_sequences():
        model = build(num_layers)
        model.train()  # dropout where the code has it, as in training
        batch = torch.randint(0, vocab, (micro_batch, seq_len + 1))
        with _Recorder(seq_len, micro_batch * heads * seq_len * seq_len) as rec:
            value = loss(model, batch)
            rec.phase = "bwd"
            value.backward()
    return rec.ops


def op_profile(
    build: Build,
    loss: Loss,
    *,
    micro_batch: int,
    seq_len: int,
    vocab: int,
    heads: int = 0,
    depth: int = 0,
    uniform: bool = True,
) -> OpProfile:
    """Trace 1- and 2-block copies and split their ops into one block's and the rest (the
    difference of the two multisets is one block; blocks run the same ops). `heads`: attention
    heads, to report eager attention's kernels under attention (0: by class only).

    Where the blocks differ (not `uniform`: ModelSpec.uniform_blocks, DeepSeek's dense first blocks
    before its MoE ones, Jamba's attention among Mamba blocks; or where the two copies do not
    split), the model is traced at its whole `depth` and with no block: `rest` is the blockless
    program, `layer` the mean block (fractional counts), so that `ops(depth)` is the whole model's
    program op for op and a checkpointed block reruns a mean block's forward."""
    if uniform:
        one, two = (_trace(build, loss, n, micro_batch, seq_len, vocab, heads) for n in (1, 2))
        layer = two - one
        rest = one - layer
        if one - rest == layer:
            return OpProfile(layer=tuple(sorted(layer.items(), key=repr)), rest=tuple(sorted(rest.items(), key=repr)))
    if depth < 1:
        raise ValueError("the traced blocks do not run the same ops and the model's depth is not given")
    whole, none = (_trace(build, loss, n, micro_batch, seq_len, vocab, heads) for n in (depth, 0))
    if none - whole:  # an op of the blockless program the whole one does not run: no split either
        raise ValueError(
            "the traced blocks do not run the same ops, and the blockless program is not "
            "part of the whole one; cannot extrapolate per block"
        )
    mean = {op: (whole[op] - none[op]) / depth for op in whole if whole[op] > none[op]}
    return OpProfile(layer=tuple(sorted(mean.items(), key=repr)), rest=tuple(sorted(none.items(), key=repr)))
