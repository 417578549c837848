"""The tracer of the traced tier: a training step run on CPU fake tensors (FakeTensorMode: shapes,
no data, no RAM) under `LiveBytes`, a TorchDispatchMode that counts each storage until its last
reference dies (docs/platform.md "Fake tensors"). `builtin_program` (the stand-in) and
code_trace.py (any implementation) run their small programs with it; the extrapolation to L layers
and the ZeRO accounting on top are traced.py's, which needs no torch where every program is in the
trace cache (autotune/trace_cache.py): a later `autotune estimate` answers without importing this.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import weakref
from dataclasses import replace

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autotune.impl.builtin import Transformer
from autotune.memory.segments import classify, segment_points
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig, torch_dtype


class LiveBytes(TorchDispatchMode):
    """Live storage bytes after every op, and the peak of the current segment with its storages.

    While `log` is a list, every storage that starts or stops being counted is appended to it, (serial, +bytes) or
    (serial, -bytes), and `samples` gets (len(log), segment, kind) where a peak is compared (1 entering a segment, 0
    after an op, 2 at a `point`): the record seq_family.py replays with other sizes.

    Gradient accumulation as the real engine does it: it adds a second gradient into the first in place when it holds
    the only reference to it and its storage, dense and not a Tensor subclass (InputBuffer's `accumulate`,
    torch/csrc/autograd/input_buffer.cpp); a view shares its base's storage, so it is added out of place. A FakeTensor
    is a subclass and always allocates the sum, so while `accumulating` (`accumulation_hooks`) such an `add`'s sample is
    held to the next event: if the first gradient died with the add, the sample is the moment before the sum (measured:
    docs/measurements/memory.md)."""

    def __init__(self, cpu_promotion: bool = False) -> None:
        super().__init__()
        self.cpu_promotion = cpu_promotion
        self.live = 0
        # storage id -> (serial, nbytes, ref); a promotion temporary's key is a tuple and its ref None (`_promoted`)
        self.storages: dict[int | tuple, tuple[int, int, weakref.ref | None]] = {}
        self.serials = itertools.count()
        self.segment: str | None = None
        self.peaks: dict[str, tuple[int, dict[int, int]]] = {}
        self.log: list[tuple[int, int]] | None = None
        self.samples: list[tuple[int, str, int]] | None = None
        self.accumulating = False
        self._held: tuple | None = None  # (first gradient's storage id, out-of-place and in-place samples)

    def track(self, t: torch.Tensor) -> int:
        st = t.untyped_storage()
        key = id(st)
        if key not in self.storages:
            serial, n = next(self.serials), st.nbytes()
            self.storages[key] = (serial, n, weakref.ref(st, lambda _, k=key: self._free(k)))
            self.live += n
            if self.log is not None:
                self.log.append((serial, n))
        return self.storages[key][0]

    def _promoted(self, func, args, kwargs, out) -> int:
        """Bytes of the temporaries a CPU kernel makes for this op: TensorIterator promotes each input whose dtype
        differs from the op's common dtype by a copy of it in that dtype, on CPU only (aten/src/ATen/TensorIterator.cpp
        compute_types: "Promotes inputs by creating temporaries of the correct dtype", under `common_device == kCPU`;
        a CUDA kernel casts as it loads). Pointwise ops (torch.Tag.pointwise) with floating inputs of two dtypes:
        peft's `result + lora_B(...) * scaling` adds a 16-bit base output to fp32 adapters' (measured:
        docs/measurements/memory.md, "CPU promotion temporaries"). Live with the op's output, freed with the op."""
        if not self.cpu_promotion or torch.Tag.pointwise not in func.tags or func in _NOT_PROMOTING:
            return 0
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dtype.is_floating_point]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if len({t.dtype for t in ins}) < 2 or not outs:
            return 0
        common = outs[0].dtype if outs[0].dtype.is_floating_point else torch.result_type(*ins[:2])
        return sum(t.numel() * common.itemsize for t in ins if t.dtype != common and t.dim() > 0)

    def _free(self, key: int) -> None:
        serial, n, _ = self.storages.pop(key)
        self.live -= n
        if self.log is not None:
            self.log.append((serial, -n))

    def live_serials(self) -> dict[int, int]:
        return {serial: n for serial, n, _ in self.storages.values()}

    def _sample(self, segment: str, kind: int) -> None:
        if self.samples is not None:
            self.samples.append((len(self.log), segment, kind))

    def _moment(self) -> tuple[int, dict[int, int] | None, int]:
        """(live bytes, their storages, log position) now; the storages only where the bytes top
        the segment's peak, the one use they have (the segment's peak cannot change before the held
        sample is settled: settling is the next event)."""
        top = self.live > self.peaks[self.segment][0]
        return self.live, self.live_serials() if top else None, len(self.log) if self.log is not None else 0

    def _settle(self) -> None:
        """The sample held back at an accumulation (class docstring), now that it is known whether
        the first gradient outlived the add."""
        if self._held is None:
            return
        key, (live, storages, at), in_place = self._held
        self._held = None
        if key not in self.storages:  # it died with the add: the real engine added in place
            live, storages, at = in_place
        if self.segment is not None:
            if live > self.peaks[self.segment][0]:
                self.peaks[self.segment] = (live, storages)
            if self.samples is not None:
                self.samples.append((at, self.segment, 0))

    def enter(self, segment: str | None) -> None:
        self._settle()
        self.segment = segment
        if segment is not None:
            self.peaks[segment] = (self.live, self.live_serials())
            self._sample(segment, 1)

    def point(self, name: str) -> None:
        """The live storages now, as the peak of `name` (a moment, not a segment)."""
        self._settle()
        self.peaks[name] = (self.live, self.live_serials())
        self._sample(name, 2)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._settle()
        held = (
            self.accumulating
            and func is torch.ops.aten.add.Tensor
            and self.segment is not None
            and isinstance(args[0], torch.Tensor)
            and args[0]._base is None
            and is_non_overlapping_and_dense_or_false(args[0])
        )
        if held:  # the moment an in-place add would have: both gradients, no sum
            in_place = self._moment()
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.track(t)
        if held:
            self._held = (id(args[0].untyped_storage()), self._moment(), in_place)
            return out
        temporaries = self._promoted(func, args, kwargs, out)
        if temporaries:  # counted as a storage of its own for the moment of the op (seq_family replays it so)
            key = ("promoted", next(self.serials))
            self.storages[key] = (key[1], temporaries, None)
            self.live += temporaries
            if self.log is not None:
                self.log.append((key[1], temporaries))
        if self.segment is not None:
            if self.live > self.peaks[self.segment][0]:
                self.peaks[self.segment] = (self.live, self.live_serials())
            self._sample(self.segment, 0)
        if temporaries:
            self._free(key)
        return out


_NOT_PROMOTING = (torch.ops.aten.copy_.default, torch.ops.aten.copy.default)
"""Pointwise ops whose kernel casts as it copies (copy_: no temporaries)."""


class _GroupedMmAnyDtype(TorchDispatchMode):
    """torch._grouped_mm (transformers' MoE experts) on fake tensors of any dtype. Its meta function
    takes bf16 only, while its CPU kernel runs fp32 too (measured: transformers' Mixtral steps in
    fp32 on CPU, and failed on fake tensors with "Expected inputs of BF16 type"), so the shape is
    taken from a bf16 call and the result is made in the inputs' dtype. Sits between FakeTensorMode
    and the counting modes above it, which see the one op and its output only."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func._overloadpacket is torch.ops.aten._grouped_mm and args[0].dtype != torch.bfloat16:
            cast = [a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
            return func(*cast, **kwargs).to(args[0].dtype)
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_mode():
    """FakeTensorMode, with torch's own log of an op that fails on fake tensors held back: the
    exception reaches the caller, which says in one line why the code cannot be traced
    (code_trace.trace_program), and torch would print its whole traceback to stderr first."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with FakeTensorMode() as mode, _GroupedMmAnyDtype():
            yield mode
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def tracing(on_cpu: bool):
    """Fake tensors with their live bytes counted. With `on_cpu` (CPU clusters: what CPU ranks hold, in the measured
    peak) also torch.get_rng_state(), the real 5056-byte CPU tensor made outside the dispatcher that
    torch.utils.checkpoint keeps per checkpointed call, and the CPU kernels' promotion temporaries
    (`LiveBytes._promoted`)."""
    original = torch.get_rng_state
    with fake_mode(), LiveBytes(cpu_promotion=on_cpu) as live:

        def get_rng_state() -> torch.Tensor:
            state = original()
            live.track(state)
            return state

        torch.get_rng_state = get_rng_state if on_cpu else original
        try:
            yield live
        finally:
            torch.get_rng_state = original


# Fake parameters cannot be cast (`.to(dtype)` fails on fakes), so they are made in the dtype
# DeepSpeed casts the module to: torch's default dtype while the model is built.


def adamw(params, fused: bool) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, fused=True) if fused else torch.optim.AdamW(params, foreach=False)


def _hooks(model: Transformer, live: LiveBytes, marks: dict) -> None:
    """Segment boundaries: module hooks in forward, gradient hooks on block outputs in backward."""

    def on_grad(segment):
        return lambda grad: live.enter(segment)

    def measuring_forward() -> bool:  # a checkpointed block's recomputation repeats its hooks in backward
        return marks["measure"] and not marks["backward"]

    def block_pre(i):
        def hook(_, args):
            if measuring_forward():
                live.enter(f"fwd.block{i}")
                if i == 0:
                    args[0].register_hook(on_grad("bwd.end"))
                    marks["rope"] = {live.track(t) for t in tree_leaves(args[1:]) if isinstance(t, torch.Tensor)}

        return hook

    def block_post(i):
        def hook(_, args, out):
            if measuring_forward():
                out.register_hook(on_grad(f"bwd.block{i}"))

        return hook

    def model_post(_, args, loss):
        if marks["measure"]:
            marks["loss"] = live.track(loss)
            marks["saved"] = live.live_serials()
            live.point("fwd.end")

    model.register_forward_pre_hook(lambda *_: live.enter("fwd.start") if marks["measure"] else None)
    model.register_forward_hook(model_post)
    model.norm.register_forward_pre_hook(lambda *_: live.enter("fwd.head") if marks["measure"] else None)
    for i, block in enumerate(model.blocks):
        block.register_forward_pre_hook(block_pre(i))
        block.register_forward_hook(block_post(i))


def builtin_program(
    spec: ModelSpec, cfg: TrainConfig, *, ckpt: int, full: int, fused: bool, on_cpu: bool
) -> dict[str, dict[str, int]]:
    """Segment peaks by category of a (ckpt + full)-layer `spec`, its first `ckpt` blocks checkpointed."""
    marks = {"measure": False, "backward": False}  # measure: the module hooks are set before the warm-up
    with tracing(on_cpu) as live:
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch_dtype(cfg.precision))
        try:
            model = Transformer(replace(spec, num_layers=ckpt + full), attention=cfg.attention, ckpt_layers=ckpt)
        finally:
            torch.set_default_dtype(default)
        _hooks(model, live, marks)
        opt = adamw(model.parameters(), fused)
        # one (b, s+1) batch sliced into inputs and targets, as tests/test_memory_measured.py does
        for p in model.parameters():  # a first step makes the optimizer states: the steady state
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        batch = torch.randint(0, spec.vocab_size, (cfg.micro_batch, cfg.seq_len + 1))
        marks["measure"] = True
        loss = model(batch[:, :-1], batch[:, 1:])
        backward_and_step(live, marks, loss, opt)
        grads = {live.track(p.grad) for p in model.parameters()}
        del loss
        known = known_storages(live, model, opt, grads, batch, marks, shared=marks["rope"])
    return {name: classify(live.peaks[segment][1], known) for segment, name in segment_points(ckpt, full)}


def known_storages(
    live: LiveBytes, model, opt, grads: set[int], batch, marks: dict, shared: set[int]
) -> dict[str, set[int]]:
    """Serials of a measured step's storages by category, in the order `segments.classify` tries them (the
    stand-in registers no buffers, so its `module_buffers` is empty); activations: what the forward
    left saved (marks["saved"]) that is none of the others."""
    known = {
        "parameters": {live.track(p) for p in model.parameters()},
        "module_buffers": {live.track(b) for b in model.buffers()},
        "gradients": grads,
        "optimizer_states": {
            live.track(t) for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        },
        "batch_and_loss": {live.track(batch), marks["loss"]},
        "rotary_tables": shared,
    }
    known["activations"] = set(marks["saved"]) - set().union(*known.values())
    return known


def accumulation_hooks(live: LiveBytes, root) -> list:
    """Hooks on every node of the graph below `root` that tell `live` when the engine is handing a
    node's gradients on (after the node, before the next one): where it accumulates them. Leaves'
    AccumulateGrad nodes are left alone (they add into .grad in place themselves)."""

    def before(grad_outputs):
        live.accumulating = False

    def after(grad_inputs, grad_outputs):
        live.accumulating = True

    handles, seen, stack = [], set(), [root]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ != "AccumulateGrad":
            handles += [node.register_prehook(before), node.register_hook(after)]
        stack.extend(n for n, _ in node.next_functions)
    return handles


def backward_and_step(live: LiveBytes, marks: dict, loss, opt) -> None:
    """The measured step after the forward: backward from the loss's segment, then the optimizer's
    (marks["backward"] tells the module hooks that a recomputation is not the forward)."""
    marks["backward"] = True
    live.enter("bwd.head")
    handles = accumulation_hooks(live, loss.grad_fn)
    try:
        loss.backward()
    finally:
        live.accumulating = False
        for h in handles:
            h.remove()
    marks["backward"] = False
    live.enter("opt")
    opt.step()
    live.enter(None)


def builtin_param_numels(spec: ModelSpec, num_layers: int) -> list[int]:
    """Element counts of the stand-in's parameters, in the model's order, for `num_layers` layers."""
    with fake_mode():
        return [p.numel() for p in Transformer(replace(spec, num_layers=num_layers)).parameters()]


def step_peak(sizes: list[int], master: str, fused: bool) -> int:
    """Peak bytes of a second torch AdamW step over parameters of `sizes` elements in `master`'s
    dtype, above what the first left live (the states): the update's temporaries."""
    dtype = torch_dtype(master)
    with tracing(on_cpu=False) as live:
        params = [torch.zeros(n, dtype=dtype, requires_grad=True) for n in sizes]
        for p in params:
            p.grad = torch.zeros_like(p)
        opt = adamw(params, fused)
        opt.step()  # creates the states
        before = live.live
        live.enter("step")
        opt.step()
        live.enter(None)
    return live.peaks["step"][0] - before
