"""The memory of the code a trial really runs (Hugging Face, a user's factory module, or the builtin stand-in), traced
through autotune/impl/'s one seam: `impl.build`, `impl.layers`, `impl.loss`, `impl.checkpoint_first`.

`trace_program(spec, cfg, ckpt=, full=, ...)` builds the model of `ckpt + full` layers on CPU fake tensors, makes
AdamW's states with a first step, and runs one step under `tracer.LiveBytes`; hooks on the decoder layers and their
output gradients cut it into traced.py's segments, each peak kept by category. Nothing here knows a family: what a layer
saves is whatever its code allocates. A program serves every ZeRO stage, cluster and grad_accum (the stage is accounted
analytically on top); `families(...)` replays a range of lengths or micro batches from one build (seq_family.py).
docs/memory.md ("Code other than the stand-in") explains the rest."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json

from autotune import trace_cache
from autotune.errors import SpecError
from autotune.impl.lora import adapters_stay_fp32
from autotune.memory import seq_family
from autotune.memory.segments import classify, segment_points
from autotune.models import ModelSpec
from autotune.models.hf_config import continued, default_attention, per_layer_lists
from autotune.train_config import TrainConfig, torch_dtype

_PROGRAMS: dict[tuple, dict[str, dict[str, int]]] = {}
"""Segment peaks by category of each small program traced, by `_key`."""


def impl_of(spec: ModelSpec, cfg: TrainConfig | None = None):
    """The ModelImpl that builds `spec`'s module in trials (autotune/impl/), with `cfg`'s LoRA
    adapters where its method says so, in the dtype DeepSpeed trains them in (fp32 at ZeRO-3 in 16 bits:
    impl/lora.py `adapters_stay_fp32`), since no deepspeed.initialize casts a traced module."""
    from autotune.impl import impl_for

    return impl_for(spec, cfg, as_trained=True)


_KEYS: dict[ModelSpec, str] = {}


def spec_key(spec: ModelSpec) -> str:
    """What a traced program depends on in `spec`: every field but its name, source and layer count
    (each program is built with its own layer count). Memoised: asdict copies the whole config."""
    if spec not in _KEYS:
        d = dataclasses.asdict(spec)
        for f in ("name", "source", "num_layers", "param_count"):
            d.pop(f, None)
        _KEYS[spec] = json.dumps(d, sort_keys=True, default=str)
    return _KEYS[spec]


TRACED_AS = {"flash_attention_2": "sdpa"}
"""Attention the trace cannot run: flash_attention_2 is the flash-attn package's CUDA kernels, which
neither load on CPU nor have fake-tensor rules. It is traced as sdpa, whose flash kernel keeps the
same per layer (q, k, v, the output and a fp32 log-sum-exp per head and token): an approximation,
unmeasured here, not the exact code."""


def build(spec: ModelSpec, precision: str, attention: str, num_layers: int, cfg: TrainConfig | None = None, impl=None):
    """`impl.build` in the training dtype: fake parameters cannot be cast after construction
    (`.to(dtype)` fails on fakes), so the default dtype is set while the model is built. `cfg`:
    the config whose LoRA adapters the module gets (None: the base alone); `impl`: impl_of's, made
    before a trace starts."""

    import torch

    attention = TRACED_AS.get(attention, attention)
    impl = impl or impl_of(spec, cfg)
    spec = _with_layer_types(spec, num_layers)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch_dtype(precision))
    try:
        model = impl.build(spec, dtype=torch_dtype(precision), attention=attention, num_layers=num_layers)
    finally:
        torch.set_default_dtype(default)
    return impl, model


def _with_layer_types(spec: ModelSpec, num_layers: int) -> ModelSpec:
    """A config that lists something per layer (`layer_types`, `mlp_layer_types`: hf_config.
    per_layer_lists) must list as many as are built; the programs traced may have more layers than
    a small config (one more than a mixed stack, for the per-layer split). Each list is continued as a
    deeper model of the same config has it (hf_config.continued). The extrapolation prices every layer
    like the traced ones: kinds that differ only in their mask's contents (sliding and full
    attention) keep the same tensors."""
    d = spec.hf_config or {}
    depth = d.get("num_hidden_layers", spec.num_layers)
    keys = per_layer_lists(d, depth) if isinstance(depth, int) and depth < num_layers else []
    if not keys:
        return spec
    more = {k: continued(d[k], num_layers) for k in keys}
    return dataclasses.replace(spec, hf_config={**d, **more, "num_hidden_layers": num_layers})  # validated together


def _first_grad_tensor(tree):
    """The first tensor in `tree` that requires grad, or None."""
    import torch
    from torch.utils._pytree import tree_leaves

    return next((t for t in tree_leaves(tree) if isinstance(t, torch.Tensor) and t.requires_grad), None)


def _hooks(impl, model, live, marks: dict) -> None:
    """Segment boundaries on the decoder layers: a forward pre-hook enters fwd.block<i>, the last
    layer's forward hook enters fwd.head (final norm, LM head, loss); gradient hooks on each layer's
    output enter bwd.block<i>, on the first layer's input bwd.end (embedding backward, reductions).
    transformers 5 checkpoints a layer's `forward`, not its `__call__`, so these hooks do not run
    again in the recomputation; `marks["backward"]` guards against implementations that do."""
    import torch
    from torch.utils._pytree import tree_leaves

    layers = impl.layers(model)
    last = len(layers) - 1

    def on_grad(segment):
        return lambda grad: live.enter(segment)

    def measuring_forward() -> bool:
        return marks["measure"] and not marks["backward"]

    def pre(i):
        def hook(_, args, kwargs):
            if not measuring_forward():
                return
            live.enter(f"fwd.block{i}")
            if i == 0:
                hidden = args[0] if args else kwargs.get("hidden_states")
                if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                    hidden.register_hook(on_grad("bwd.end"))
                # what the model hands every layer: rotary cos/sin, position ids, the eager mask
                shared = [
                    t
                    for t in tree_leaves((args[1:] if args else (), kwargs))
                    if isinstance(t, torch.Tensor) and t is not hidden
                ]
                marks["shared"] = {live.track(t) for t in shared}

        return hook

    def post(i):
        def hook(_, args, kwargs, out):
            if not measuring_forward():
                return
            t = _first_grad_tensor(out)
            if t is not None:
                t.register_hook(on_grad(f"bwd.block{i}"))
            if i == last:
                live.point("fwd.layers")  # what every layer left saved, before the head runs
                live.enter("fwd.head")

        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(pre(i), with_kwargs=True)
        layer.register_forward_hook(post(i), with_kwargs=True)


@contextlib.contextmanager
def unpacked_sequences():
    """transformers takes another branch on fake tensors: masking_utils' `find_packed_sequence_indices` cannot read fake
    position ids (`is_tracing`), so it returns a packing index and the model builds a 4-D mask where a real run
    passes none and lets SDPA use is_causal (measured: docs/measurements/memory.md). The trial's positions are 0..s-1
    in every row (impl.loss passes none), so a real run reads "not packed": the function still runs (its small int64
    temporaries are real) and None is returned."""
    try:
        from transformers import masking_utils
    except ImportError:  # no transformers: nothing to correct
        yield
        return
    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def unpacked(*args, **kwargs):
        original(*args, **kwargs)
        return None

    masking_utils.find_packed_sequence_indices = unpacked
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original


def zero3_linear(cfg: TrainConfig) -> bool:
    """Whether the step runs DeepSpeed's ZeRO-3 linear (`zero3_linear_function`): under zero.Init,
    with frozen weights to tell it apart from torch's (LoRA). QLoRA's 4-bit layers call
    bitsandbytes' matmul, not torch.nn.functional.linear, and keep the 16-bit LoRA trace."""
    return cfg.zero_stage == 3 and cfg.method == "lora"


@contextlib.contextmanager
def zero3_linear_function(on: bool):
    """torch.nn.functional.linear as DeepSpeed's zero.Init leaves it for the rest of the process
    (partition_parameters.py `_enable_mem_efficient_linear`, zero/linear.py
    LinearFunctionForZeroStage3): an autograd function that saves its input, weight and bias for
    every linear layer. torch's own saves a frozen layer's input for nothing (no weight gradient),
    so LoRA's frozen base keeps its inputs under ZeRO-3 only."""
    if not on:
        yield
        return
    import torch

    class Zero3Linear(torch.autograd.Function):
        @staticmethod
        def forward(input, weight, bias=None):
            if input.dim() == 2 and bias is not None:
                return torch.addmm(bias, input, weight.t())
            output = input.matmul(weight.t())
            if bias is not None:
                output += bias
            return output

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0], inputs[1], inputs[2] if len(inputs) > 2 else None)

        @staticmethod
        def backward(ctx, grad_output):
            input, weight, bias = ctx.saved_tensors
            grad_input = grad_weight = grad_bias = None
            if ctx.needs_input_grad[0]:
                grad_input = grad_output.matmul(weight)
            if ctx.needs_input_grad[1]:
                grad_weight = (
                    grad_output.reshape(-1, grad_output.shape[-1]).t().matmul(input.reshape(-1, input.shape[-1]))
                )
            if bias is not None and ctx.needs_input_grad[2]:
                grad_bias = grad_output.sum(list(range(grad_output.dim() - 1)))
            return grad_input, grad_weight, grad_bias

    original = torch.nn.functional.linear
    torch.nn.functional.linear = lambda input, weight, bias=None: Zero3Linear.apply(input, weight, bias)
    try:
        yield
    finally:
        torch.nn.functional.linear = original


def _run(
    spec: ModelSpec,
    cfg: TrainConfig,
    *,
    ckpt: int,
    full: int,
    fused: bool,
    on_cpu: bool,
    vary: tuple[str, tuple[int, ...]] | None = None,
):
    """One program: its segment peaks by category. With `vary` = (field, values), one measured step at
    each value of `cfg`'s field ("seq_len" or "micro_batch") in one build, and each step's
    (peaks, seq_family.Record) returned: every step starts from the same steady state (optimizer
    states made, gradients freed), which seq_family.fit checks in the records."""
    import torch

    from autotune.memory.tracer import adamw, tracing

    marks = {"measure": False, "backward": False, "shared": set()}
    impl = impl_of(spec, cfg)  # outside the trace: what it imports is no part of the step
    with tracing(on_cpu) as live, unpacked_sequences(), zero3_linear_function(zero3_linear(cfg)):
        impl, model = build(spec, cfg.precision, cfg.attention, ckpt + full, cfg, impl)
        impl.checkpoint_first(model, ckpt)
        _hooks(impl, model, live, marks)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = adamw(params, fused)
        for p in params:  # a first step makes the optimizer states: the steady state
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step = dict(
            live=live,
            marks=marks,
            impl=impl,
            model=model,
            opt=opt,
            params=params,
            ckpt=ckpt,
            full=full,
            vocab=spec.vocab_size,
        )
        if vary is None:
            return _measured_step(**step, shape=(cfg.micro_batch, cfg.seq_len))[0]
        name, values = vary
        return [
            _measured_step(
                **step,
                shape=(v if name == "micro_batch" else cfg.micro_batch, v if name == "seq_len" else cfg.seq_len),
                record=True,
            )
            for v in values
        ]


def _measured_step(
    *,
    live,
    marks,
    impl,
    model,
    opt,
    params,
    ckpt: int,
    full: int,
    vocab: int,
    shape: tuple[int, int],
    record: bool = False,
):
    """One training step of a (micro batch, seq) batch from the steady state, and back to it:
    (segment peaks by category, the step's seq_family.Record where `record`, else None)."""
    import torch

    from autotune.memory.tracer import backward_and_step, known_storages

    if record:
        baseline = sorted(live.live_serials().items())
        live.log, live.samples = [], []
    batch = torch.randint(0, vocab, (shape[0], shape[1] + 1))
    marks.update(measure=True, backward=False, shared=set())
    # the moment each gradient is accumulated (`bwd.grad.N`, N from 1), where ZeRO-2 reduces its bucket when the
    # arriving gradient would overflow it (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads) and the
    # first reduction allocates the partition (copy_grads_in_partition): what the layers and the head's backward still
    # hold then. `bwd.reduce`, the second: where a first gradient larger than the bucket (the LM head's:
    # buffers.reduces_first_at_head) is reduced
    arrived = []

    def on_grad(_):
        arrived.append(1)
        live.point(f"bwd.grad.{len(arrived)}")
        if len(arrived) == 2:
            live.point("bwd.reduce")

    grad_hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in params]
    live.enter("fwd.start")
    loss = impl.loss(model, batch)
    marks["loss"] = live.track(loss)
    marks["saved"] = live.live_serials()
    live.point("fwd.end")
    try:
        backward_and_step(live, marks, loss, opt)
    finally:
        for h in grad_hooks:
            h.remove()
    # A parameter the loss does not reach has no gradient (a module a user's model builds but does not
    # call; cross-attention in a decoder run without its encoder): no gradient of it is live
    grads = {live.track(p.grad) for p in params if p.grad is not None}
    del loss
    known = known_storages(live, model, opt, grads, batch, marks, shared=marks["shared"])
    points = (
        segment_points(ckpt, full)
        + [("fwd.layers", "fwd.layers"), ("bwd.reduce", "bwd.reduce")]
        + [(f"bwd.grad.{n}", f"bwd.grad.{n}") for n in range(1, len(arrived) + 1)]
    )
    peaks = {name: classify(live.peaks[segment][1], known) for segment, name in points if segment in live.peaks}
    rec = (
        seq_family.Record(baseline=baseline, log=live.log, samples=live.samples, known=known, points=points)
        if record
        else None
    )
    marks["measure"] = False
    opt.zero_grad(set_to_none=True)
    live.log = live.samples = None
    live.peaks.clear()
    return peaks, rec


def kept_on_disk(spec: ModelSpec) -> bool:
    """Whether `spec`'s programs are kept in the disk cache (trace_cache.py): transformers' code and
    the stand-in, whose versions and sources are in its fingerprint; a user's module can change
    between runs and is not."""
    return spec.implementation in ("hf", "builtin")


def trace_program(
    spec: ModelSpec, cfg: TrainConfig, *, ckpt: int, full: int, fused: bool, on_cpu: bool, only_cached: bool = False
) -> dict[str, dict[str, int]] | None:
    """Segment peaks by category of a (ckpt + full)-layer `spec` in its own code, its first `ckpt`
    layers checkpointed (tracer.py's `builtin_program` contract), cached. Only the fields that change
    the program are in the key: not the ZeRO stage, cluster size or grad_accum. Inside `families`,
    a value in its range of the field it names is replayed from the program's family
    (seq_family.py) where that is exact. `only_cached`: None where it would have to be traced."""
    key = _key(spec, cfg, ckpt, full, fused, on_cpu)
    kept = kept_on_disk(spec)
    if key not in _PROGRAMS and kept:
        stored = trace_cache.load(key)
        if stored is not None:
            _PROGRAMS[key] = stored
    if "refused" in _PROGRAMS.get(key, {}):
        raise SpecError(_PROGRAMS[key]["refused"])
    if key not in _PROGRAMS and _VARY is not None and _VARY[1][0] <= getattr(cfg, _VARY[0]) <= _VARY[1][-1]:
        family = _family(spec, cfg, ckpt, full, fused, on_cpu, kept, only_cached)
        if family is not None:  # exact: kept in memory; on disk the family is
            _PROGRAMS[key] = family.program(getattr(cfg, _VARY[0]))
    if key not in _PROGRAMS and only_cached:
        return None
    if key not in _PROGRAMS:
        try:
            program = _run(spec, cfg, ckpt=ckpt, full=full, fused=fused, on_cpu=on_cpu)
        except Exception as e:
            # The model's own code refused the step (measured: a sequence past MPT's ALiBi table; a
            # module converting its own dtype in __init__ cannot on fake tensors, torch's "Couldn't
            # swap"). What it says is the user's answer, not a traceback of the tracer.
            refused = (
                f"model {spec.name}: its code cannot run a training step (traced on CPU fake "
                f"tensors) at {cfg.precision}, attention {cfg.attention}, micro batch "
                f"{cfg.micro_batch}, seq {cfg.seq_len} "
                f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                + (
                    f"; the sequence is longer than the config's max_seq_len {spec.max_seq_len}"
                    if cfg.seq_len > spec.max_seq_len
                    else ""
                )
            )
            _PROGRAMS[key] = {"refused": refused}  # as deterministic as a trace: kept, so not tried again
            if kept:
                trace_cache.store(key, _PROGRAMS[key])
            raise SpecError(refused) from e
        _PROGRAMS[key] = program
        if kept:
            trace_cache.store(key, program)
    return _PROGRAMS[key]


def _key(spec: ModelSpec, cfg: TrainConfig, ckpt: int, full: int, fused: bool, on_cpu: bool) -> tuple:
    return (
        (
            spec_key(spec),
            cfg.precision,
            cfg.attention,
            cfg.seq_len,
            cfg.micro_batch,
            ckpt,
            full,
            fused,
            on_cpu,
            cfg.method,
            cfg.lora_rank,
            cfg.lora_targets,
            cfg.lora_dropout,
        )
        + (("zero3 linear",) if zero3_linear(cfg) else ())
        + (("fp32 adapters",) if adapters_stay_fp32(cfg) else ())
    )


_VARY: tuple[str, tuple[int, int, int]] | None = None
"""The field and values `families` traces programs at, while inside it."""
_FAMILIES: dict[tuple, object] = {}
"""seq_family.Family of each program (None where it is not exact), by its key without the field."""


@contextlib.contextmanager
def families(name: str, values: tuple[int, int, int]):
    """Within: a program at a value of `name` ("seq_len" or "micro_batch") in [values[0], values[-1]]
    is replayed from one build of it stepped at the three `values` (seq_family.py) where that is
    exact, not traced on its own."""
    global _VARY
    previous, _VARY = _VARY, (name, tuple(values))
    try:
        yield
    finally:
        _VARY = previous


def _family(
    spec: ModelSpec,
    cfg: TrainConfig,
    ckpt: int,
    full: int,
    fused: bool,
    on_cpu: bool,
    kept: bool,
    only_cached: bool = False,
):
    """The program's seq_family.Family over `families`' values, or None where it is not exact: read
    from the disk cache or traced (one build, three steps, each also kept as its own value's program).
    `only_cached`: None where it would have to be traced."""

    name, values = _VARY
    fkey = list(_key(spec, cfg, ckpt, full, fused, on_cpu))
    fkey[3 if name == "seq_len" else 4] = None
    fkey = ("family", name, values, *fkey)
    if fkey not in _FAMILIES and kept:
        stored = trace_cache.load(fkey)
        if stored is not None:
            _FAMILIES[fkey] = seq_family.Family.from_json(stored) if stored["exact"] else None
    if fkey not in _FAMILIES and only_cached:
        return None
    if fkey not in _FAMILIES:
        try:
            steps = _run(spec, cfg, ckpt=ckpt, full=full, fused=fused, on_cpu=on_cpu, vary=(name, values))
        except (RuntimeError, ValueError, TypeError, NotImplementedError, AssertionError):
            steps = []  # the code refuses one of the values: each is traced on its own, and says so
        family = seq_family.fit(values, [r for _, r in steps], [p for p, _ in steps]) if steps else None
        for v, (program, _) in zip(values, steps):  # each step is a trace of its own value
            key = _key(spec, dataclasses.replace(cfg, **{name: v}), ckpt, full, fused, on_cpu)
            if key not in _PROGRAMS:
                _PROGRAMS[key] = program
                if kept:
                    trace_cache.store(key, program)
        _FAMILIES[fkey] = family
        if kept:
            trace_cache.store(fkey, {"exact": True, **family.to_json()} if family else {"exact": False})
    return _FAMILIES[fkey]


_NUMELS: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}


def _numels(spec: ModelSpec, layers: int = 2) -> tuple[tuple[int, ...], tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """(before the first layer, each layer's, after the last) parameter sizes: a uniform stack's one
    layer from a `layers`-layer model (it stands for every layer), a mixed stack's every layer from
    the whole model (read from its first two, a Jamba's sizes summed to 55% of its parameters and
    missed its experts, the largest gradient ZeRO-2 holds). Kept in the trace cache where the model's
    programs are (`kept_on_disk`)."""
    key = spec_key(spec)
    if key not in _NUMELS:
        depth = layers if spec.uniform_blocks else spec.num_layers
        pre, per, post = trace_cache.remembered(
            ("numels", key, depth), lambda: _count_numels(spec, depth), keep=kept_on_disk(spec)
        )
        per = per[:1] if spec.uniform_blocks else per
        _NUMELS[key] = (tuple(pre), tuple(map(tuple, per)), tuple(post))
    return _NUMELS[key]


def _count_numels(spec: ModelSpec, layers: int) -> list:
    import torch

    with torch.device("meta"):
        impl, model = build(spec, "fp32", default_attention(spec), layers)
    where: dict[int, int] = {}
    for i, layer in enumerate(impl.layers(model)):
        for p in layer.parameters():
            where.setdefault(id(p), i)  # a block shared by layers (Zamba2's) is its first layer's
    named = [(where.get(id(p)), p.numel()) for p in model.parameters()]
    first = next(i for i, (layer, _) in enumerate(named) if layer is not None)
    end = max(i for i, (layer, _) in enumerate(named) if layer is not None) + 1
    per = [[n for layer, n in named[first:end] if layer == i] for i in range(layers)]
    return [[n for _, n in named[:first]], per, [n for _, n in named[end:]]]


def param_numels(spec: ModelSpec, num_layers: int | None = None) -> list[int]:
    """Element counts of the module's parameters in the order an optimizer visits them, for
    `num_layers` layers (spec's by default; a mixed stack's first ones): what comes before the first
    layer, each layer's, what comes after."""
    pre, per, post = _numels(spec)
    n = spec.num_layers if num_layers is None else num_layers
    layers = per * n if len(per) == 1 else per[:n]
    return [*pre, *(x for layer in layers for x in layer), *post]


def layer_numels(spec: ModelSpec) -> tuple[int, ...]:
    """Element counts of the decoder layers' parameters: one layer's for a uniform stack, every
    layer's for a mixed one."""
    return tuple(x for layer in _numels(spec)[1] for x in layer)


@functools.cache  # asked per estimate at ZeRO-3, of a handful of (model, threshold) pairs
def persistent_params(spec: ModelSpec, threshold: int) -> int:
    """Parameters ZeRO-3 keeps whole on every rank: those with fewer than `threshold` elements
    (DeepSpeed stage3.py, persistence_threshold), counted on the module itself."""
    return sum(n for n in param_numels(spec) if n < threshold)


RELEASED_SEQ = 16
"""Tokens of the forward `released_after_forward` runs: which outputs need a gradient does not depend
on the batch's shape, so the shortest that every traced family runs will do."""


def released_after_forward(spec: ModelSpec, cfg: TrainConfig) -> list[int]:
    """Element counts of the frozen parameters ZeRO-3 releases after their module's forward under LoRA (those before the
    layers, each layer's, those after): those whose every owning module's output needs no gradient. DeepSpeed fetches
    a module again in backward from a hook on its outputs that fires only when their gradient is computed
    (parameter_offload.py _pre_backward_module_hook), so a module upstream of every adapter is not in the trace again
    and is released (partitioned_param_coordinator.py __params_to_release). Found by running the forward on fake
    tensors with a hook on every module after `checkpoint_first` (with checkpointing the embedding's output requires
    grad, and nothing is released); a uniform stack's second layer stands for every later one. Kept in the trace
    cache beside the model's programs, and for this process."""
    depth = min(spec.num_layers, 2) if spec.uniform_blocks else spec.num_layers
    key = (
        "released after forward",
        spec_key(spec),
        cfg.precision,
        TRACED_AS.get(cfg.attention, cfg.attention),
        cfg.method,
        cfg.lora_rank,
        cfg.lora_targets,
        cfg.lora_dropout,
        bool(cfg.ckpt_layers),
        depth,
    )
    if key not in _RELEASED:
        _RELEASED[key] = trace_cache.remembered(
            key, lambda: _released_after_forward(spec, cfg, depth), keep=kept_on_disk(spec)
        )
    pre, per, post = _RELEASED[key]
    layers = per if len(per) == spec.num_layers else per[:1] + per[-1:] * (spec.num_layers - 1)
    return [*pre, *(x for layer in layers for x in layer), *post]


_RELEASED: dict[tuple, list] = {}


def _released_after_forward(spec: ModelSpec, cfg: TrainConfig, depth: int) -> list:
    import torch

    from autotune.memory.tracer import tracing

    needs_grad: dict[int, bool] = {}

    def hook(module, args, out):
        needs_grad[id(module)] = needs_grad.get(id(module), False) or _first_grad_tensor(out) is not None

    with tracing(False), unpacked_sequences(), zero3_linear_function(zero3_linear(cfg)):
        impl, model = build(spec, cfg.precision, cfg.attention, depth, cfg)
        impl.checkpoint_first(model, min(cfg.ckpt_layers, depth))
        for m in model.modules():  # after checkpoint_first's: they see the output as DeepSpeed's hook does
            m.register_forward_hook(hook)
        impl.loss(model, torch.randint(0, spec.vocab_size, (1, min(cfg.seq_len, RELEASED_SEQ) + 1)))
        owners: dict[int, list[int]] = {}
        for m in model.modules():
            for p in m.parameters(recurse=False):
                owners.setdefault(id(p), []).append(id(m))
        where: dict[int, int] = {}
        for i, layer in enumerate(impl.layers(model)):
            for p in layer.parameters():
                where.setdefault(id(p), i)
        named = [
            (
                where.get(id(p)),
                p.numel()
                if not p.requires_grad and all(m in needs_grad and not needs_grad[m] for m in owners[id(p)])
                else 0,
            )
            for p in model.parameters()
        ]
    first = next(i for i, (layer, _) in enumerate(named) if layer is not None)
    end = max(i for i, (layer, _) in enumerate(named) if layer is not None) + 1
    per = [[n for layer, n in named[first:end] if layer == i and n] for i in range(depth)]
    return [[n for _, n in named[:first] if n], per, [n for _, n in named[end:] if n]]
