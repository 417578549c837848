"""Traced tier of the memory model: `trace(model, cluster, cfg)` runs the trial model's own code on fake tensors and
counts the bytes it allocates; `compare(est, traced)` sets it beside `autotune.memory.estimate`. docs/memory.md ("The
traced tier") explains it; tests/test_traced.py checks it against real CPU runs and direct traces.

In short: CPU fake tensors (FakeTensorMode), two AdamW iterations, the second measured by `tracer.LiveBytes` (a
TorchDispatchMode counting each storage until its last reference dies; memory/tracer.py, imported only when a program is
traced); the peak of each segment of the step (module and gradient hooks) by category; small models traced and each
segment peak extrapolated to L layers (affine in the checkpointed and full layer counts); ZeRO from the analytic
model-state and buffer terms, on top of the traced activations."""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple

from autotune.hardware import Cluster
from autotune.memory import buffers, code_trace, model_states
from autotune.memory.analytic import MemoryEstimate, builtin
from autotune.memory.analytic import phases as _phases
from autotune.memory.layout import Layout
from autotune.memory.lora import adapter_numels
from autotune.memory.segments import CATEGORIES, PHASE_POINTS, classify, segment_points  # noqa: F401 - re-exported
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig, dtype_bytes
from autotune.units import fmt_bytes

TRACED_TERMS = {
    "activations",
    "checkpointed_inputs",
    "rotary_tables",
    "logits_and_loss",
    "logits_transient",
    "recomputed_layer",
    "optimizer_temporaries",
    "module_buffers",
}
"""Analytic terms the trace replaces; every other term of a phase (model states, gradients, buffers
for the ZeRO stage) is taken from autotune.memory as it stands."""


MIXED_TRACED_LAYERS = 24
"""Depth up to which a stack of mixed layer kinds (ModelSpec.uniform_blocks False) is traced whole; a deeper one is
extrapolated from its first layers like a uniform one, and `autotune estimate` says the figure is approximate
(`mixed_blocks_note`). Chosen for the first estimate's time (measured: docs/measurements/memory.md)."""


def _plan(ckpt: int, full: int, uniform: bool = True) -> list[tuple[int, int]]:
    """(checkpointed, full) layers of the small models traced for a (ckpt, full) target: a count of up to 3 as it is and
    with one block more (for the per-layer split), a larger one at 2 and 3, extrapolated. Never from 1: a lone block
    is first and last of its run, and the last frees the rotary tables. A mixed stack (not `uniform`) up to
    MIXED_TRACED_LAYERS deep is traced at its own counts, as its first layers do not stand for the rest (measured:
    docs/measurements/memory.md)."""
    whole = not uniform and ckpt + full <= MIXED_TRACED_LAYERS

    def counts(n):
        return [0] if n == 0 else [n, n + 1] if n <= 3 or whole else [2, 3]

    ks, ms = counts(ckpt), counts(full)
    return sorted({(ks[0], ms[0]), (ks[-1], ms[0]), (ks[0], ms[-1])})


Affine = tuple[int, int, int]
"""(c, a, b): bytes = c + a * checkpointed layers + b * full layers."""


_FITS: dict[tuple, tuple[dict, dict, dict]] = {}
"""_fit's results by the identity of the programs fitted and the depth (code_trace keeps each program once,
so a search's tens of thousands of candidates fit a few dozen sets); each entry holds its programs, so no id
is reused. The dicts are shared between estimates and never modified."""


def _fit(
    traces: dict[tuple[int, int], dict[str, dict[str, int]]], ckpt: int, full: int
) -> tuple[dict[str, dict[str, Affine]], dict[str, dict[str, int]]]:
    """The programs' affine fits, and each point's bytes by category at `ckpt` checkpointed and `full` layers."""
    key = (tuple((km, id(v)) for km, v in traces.items()), ckpt, full)
    if key not in _FITS:
        fits = _fit_programs(traces)
        points = {p: {c: f[0] + f[1] * ckpt + f[2] * full for c, f in cats.items()} for p, cats in fits.items()}
        _FITS[key] = (traces, fits, points)
    return _FITS[key][1], _FITS[key][2]


def _fit_programs(traces: dict[tuple[int, int], dict[str, dict[str, int]]]) -> dict[str, dict[str, Affine]]:
    k0, m0 = min(traces)
    out: dict[str, dict[str, Affine]] = {}
    for point, cats in traces[(k0, m0)].items():
        out[point] = {}
        for cat, v0 in cats.items():
            a = traces[(k0 + 1, m0)][point][cat] - v0 if (k0 + 1, m0) in traces else 0
            b = traces[(k0, m0 + 1)][point][cat] - v0 if (k0, m0 + 1) in traces else 0
            out[point][cat] = (v0 - a * k0 - b * m0, a, b)
    return out


def _trace_step(spec: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout) -> tuple[int, str] | None:
    """Peak temporaries of AdamW's update on the tensors DeepSpeed steps (model_states.step_terms' layout): fp32 master
    weights, or bf16 ones with `bf16_master_weights_and_grads` (whose states are then bf16 too, TrainConfig's check);
    None where torch cannot run that optimizer (offload on a GPU: CPUAdam; 8-bit: bitsandbytes) (measured:
    docs/measurements/memory.md)."""
    if (cfg.offload_optimizer and not cluster.gpu.is_cpu) or cfg.optimizer == "adamw8bit":
        return None  # on CPU ranks an offloaded step is torch AdamW on the same memory (step_terms)
    fused = not cluster.gpu.is_cpu
    master = "bf16" if cfg.bf16_master_weights_and_grads else "fp32"  # the states follow (TrainConfig's check)
    trained = spec.num_params
    if cfg.method != "full":  # only the adapters are stepped
        trained = sum(adapter_numels(spec, cfg))
    part = math.ceil(trained / cluster.world_size)
    if cfg.zero_stage == 0 and cfg.method != "full":
        sizes = adapter_numels(spec, cfg, layers=2)  # two layers hold every pair of neighbours
        what = f"each {master} adapter, in the module's order"
    elif cfg.zero_stage == 0 and not builtin(spec):
        sizes, what = (
            code_trace.param_numels(spec, min(2, spec.num_layers)),
            f"each {master} parameter, in the module's order",
        )
    elif cfg.zero_stage == 0:
        # in the model's order: single-tensor AdamW's `denom` of one parameter lives on while the
        # next one's is made; two layers hold every pair of neighbours
        from autotune.memory.tracer import builtin_param_numels

        sizes, what = (
            builtin_param_numels(spec, min(2, spec.num_layers)),
            f"each {master} parameter, in the model's order",
        )
    elif cfg.zero_stage in (1, 2):
        sizes, what = [part], f"the flat {master} partition ({part:,} elements)"
    else:
        # an AutoTP shard steps its larger group (memory/tensor_parallel.py zero3_largest_group)
        group = trained if layout.zero3_largest_group is None else layout.zero3_largest_group
        part = math.ceil(group / cluster.world_size)
        sizes = [min(part, model_states.STAGE3_SUB_GROUP_SIZE)]
        what = f"one {master} sub-group ({sizes[0]:,} elements)"
    kind = "fused=True (in place, as FusedAdam)" if fused else "foreach=False"
    return _step_peak(sizes, master, fused, kept=code_trace.kept_on_disk(spec)), f"torch AdamW {kind} over {what}"


def _step_peak(sizes: list[int], master: str, fused: bool, kept: bool) -> int:
    """tracer.step_peak, read from the trace cache where `kept` (it depends on nothing else)."""
    from autotune import trace_cache

    def run() -> int:
        from autotune.memory.tracer import step_peak

        return step_peak(sizes, master, fused)

    return trace_cache.remembered(("adamw step", tuple(sizes), master, fused), run, keep=kept)


_STEPS: dict[tuple, tuple[int, str] | None] = {}
"""`_trace_step`'s answers, by what they depend on."""


@dataclass(frozen=True, kw_only=True)
class TracedEstimate:
    """Traced bytes per phase and term, comparable with autotune.memory.estimate (same phase names)."""

    model: str
    config: TrainConfig
    phases: dict[str, dict[str, int]]
    """Per phase, bytes by term on one GPU: traced activations and temporaries + the analytic model's
    states, gradients and buffers for the ZeRO stage. Extra traced terms: batch_and_loss (the token
    batch and the loss value), layer_transient, saved_activations, temporaries."""
    raw_phases: dict[str, dict[str, int]]
    """The single-process program as traced (full states, plain AdamW), by CATEGORIES."""
    analytic_phases: dict[str, dict[str, int]]
    """autotune.memory's terms per phase for the same inputs (what `phases` took its states from)."""
    points: dict[str, dict[str, int]]
    """Every segment peak of the raw program (PHASE_POINTS' names, plus 'fwd.end': after forward)."""
    layer_bytes: dict[str, int]
    """From the fit at the end of forward: bytes one full / checkpointed layer keeps, and the rest."""
    optimizer_step: str
    traced_layers: tuple[tuple[int, int], ...]
    """(checkpointed, full) layers of each model traced."""
    trace_s: float

    @property
    def totals(self) -> dict[str, int]:
        return {name: sum(terms.values()) for name, terms in self.phases.items()}

    @property
    def phase(self) -> str:
        return max(self.totals, key=self.totals.get)

    @property
    def tensor_peak_bytes(self) -> int:
        return self.totals[self.phase]

    @property
    def raw_peaks(self) -> dict[str, int]:
        """Peak of the single-process program's forward, backward and optimizer step, as a profiler
        around `model(...)`, `loss.backward()` and `opt.step()` measures them."""
        tot = {name: sum(c.values()) for name, c in self.raw_phases.items()}
        return {
            "forward": tot["forward"],
            "optimizer": tot["optimizer"],
            "backward": max(v for n, v in tot.items() if n.startswith("backward")),
        }

    def to_json(self) -> dict:
        return {
            "tensor_peak_bytes": self.tensor_peak_bytes,
            "phase": self.phase,
            "terms": self.phases[self.phase],
            "phases": self.totals,
            "layer_bytes": self.layer_bytes,
            "optimizer_step": self.optimizer_step,
            "traced_layers": self.traced_layers,
            "trace_s": round(self.trace_s, 3),
            "source": "traced",
        }


def _stage_terms(
    phase: str,
    point: str,
    points: dict[str, dict[str, int]],
    fit: dict[str, Affine],
    analytic: dict[str, dict[str, int]],
    cfg: TrainConfig,
    full: int,
    held: int,
    reduces: bool,
    uniform: bool = True,
    buckets: int = 0,
    fixed: tuple[int, int] = (0, 0),
    first_reduction: tuple[int, int] | None = None,
    late: int = 0,
) -> dict[str, int]:
    """One phase at one segment peak: traced terms (estimate()'s names where one fits) plus the analytic model's states,
    gradients and buffers for the stage.

    Gradients in backward: stages 0-1 keep them in param.grad while backward runs, as the traced program does
    (stage_1_and_2.py process_gradients reduces during backward only with partition_gradients or overlap_comm), so the
    analytic end-of-backward gradients are scaled by the fraction the trace holds at that point, except, with
    overlap_comm (`reduces`), the partition and buckets in `fixed`, whole from the first reduction on
    (buffers.stage1_reduces_in_backward); with grad_accum > 1 the analytic terms stand. Stage 2 holds the analytic
    partition from the first reduction on (copy_grads_in_partition), and through the layers' backward its bucket and
    `held` (buffers.held_extra_large_gradient) with, at its worst timing, `late` (buffers.late_freed_gradient); stage
    3's partition is static. A mixed stack (not `uniform`) has no
    per-layer slopes: its layers' part is the trace's `fwd.layers` point. Stage 2 reduces first once the gradients
    that arrived exceed its bucket (`first_reduction`: its elements and bytes; buffers.reduces_first_at_head); at a point of the
    layers' backward where the trace holds no more than that, the partition does not exist yet, the bucket does
    (measured: docs/measurements/memory.md)."""
    cats, ckpt, in_grad = points[point], cfg.ckpt_layers, cfg.zero_stage <= 1
    layers = phase == "backward (layers)"  # the end of backward's states, in the middle of it
    source = analytic["backward (end)" if layers else phase]
    # at stages 0-1 the layers' backward is before the reduction; stage 2 (`reduces`) during it
    dropped = (
        TRACED_TERMS
        | ({"embedding_gradient"} if in_grad or layers else set())
        | ({"comm_buffers"} if layers and not reduces else set())
    )
    out = {k: v for k, v in source.items() if k not in dropped}
    if layers:
        out["unreduced_gradient"] = held
        out["late_freed_gradient"] = late
        if not reduces:  # the buckets exist from the first gradient on (buffers.buckets_in_backward) ...
            out["comm_buffers"] = buckets
            for end_only in ("gradient_partition", "epilogue_partition", "late_freed_partition", "reduced_fp32_head"):
                if cfg.zero_stage in (1, 2):  # the epilogue's (buffers.stage2_end_of_one_bucket); stage 3's is a state
                    out.pop(end_only, None)
            if cfg.zero_stage == 2:  # ... and hold every gradient; the partition comes at the end
                out.pop("gradients", None)
    if first_reduction is not None and (layers or phase.startswith("backward (recompute")):
        bucket_elements, bucket_bytes = first_reduction
        if cats["gradients"] <= bucket_elements * dtype_bytes(cfg.precision):  # nothing reduced yet
            out.pop("unreduced_gradient", None)
            out.pop("late_freed_gradient", None)
            if layers:
                out.pop("gradients", None)  # the partition; the bucket is comm_buffers
            else:
                out["gradients"] = bucket_bytes  # gradients_during_backward's partition + bucket: the bucket
    if in_grad and cfg.grad_accum == 1 and phase.startswith("backward"):
        full_grads = analytic["backward (end)"].get("gradients", 0)
        part, bucket_bytes = fixed if cats["gradients"] else (0, 0)  # from the first reduction on
        if first_reduction is not None and cats["gradients"] <= first_reduction[0] * dtype_bytes(cfg.precision):
            part = 0  # the gradients that arrived still fit the bucket: nothing reduced, no partition yet
        out["gradients"] = round((full_grads - part) * cats["gradients"] / points["opt"]["gradients"]) + part
        if bucket_bytes and "comm_buffers" not in out:
            out["comm_buffers"] = bucket_bytes
    # the module's registered buffers (a causal-mask table, sinusoidal positions): whole on every rank
    # at every stage, as ZeRO partitions parameters only (DeepSpeed stage3.py)
    out.update(
        batch_and_loss=cats["batch_and_loss"],
        rotary_tables=cats["rotary_tables"],
        module_buffers=cats.get("module_buffers", 0),
    )
    transient = cats["temporaries"]
    if phase in ("forward", "backward (loss)"):
        _, a, b = fit["activations"]
        saved, inputs = (
            (b * full, a * ckpt) if uniform or "fwd.layers" not in points else (points["fwd.layers"]["activations"], 0)
        )
        out.update(activations=saved, checkpointed_inputs=inputs, logits_and_loss=cats["activations"] - saved - inputs)
        out["logits_transient" if point in ("fwd.head", "bwd.head") else "layer_transient"] = transient
        if point == "bwd.head" and not in_grad:
            # the LM head's weight gradient as autograd makes it, before DeepSpeed's hook reduces it
            # (stage 2) or copies and reduce-scatters it (stage 3): live beside the logits' gradient
            # at the trace's own peak of the loss's backward where it is there
            out["head_gradient"] = cats["gradients"]
    elif phase.startswith("backward (recompute"):
        out.update(checkpointed_inputs=cats["activations"], recomputed_layer=transient)
    elif phase == "backward (end)":
        out.update(saved_activations=cats["activations"])
        out.update(_end_of_backward(out, transient))
    elif phase != "optimizer":
        out.update(saved_activations=cats["activations"], temporaries=transient)
    return {k: v for k, v in out.items() if v}


def _end_of_backward(out: dict[str, int], transient: int) -> dict[str, int]:
    """The code's own transient at the end of backward, or DeepSpeed's, whichever is larger, not both: DeepSpeed's
    extras (buffers.backward_end_extra) come after autograd has summed a tied embedding's gradient and freed its two
    parts (measured: docs/measurements/memory.md)."""
    extras = {k: out.pop(k) for k in ("comm_buffers", "embedding_gradient") if k in out}
    return extras if sum(extras.values()) >= transient else {"temporaries": transient}


def _with_head_phase(
    phases: dict,
    head: dict[str, int],
    end: dict[str, int],
    fit: dict[str, Affine],
    ckpt: int,
    full: int,
    layers: dict[str, int] | None,
    uniform: bool,
    reduce_point: dict[str, int] | None = None,
) -> dict:
    """`phases` with 'backward (head)' after 'backward (loss)' at ZeRO-2: the LM head's gradient exists and every
    layer's activations are saved, where stage 2's first reduction allocates the partition and the bucket (a second
    partition where one bucket holds every gradient, fp32 accumulation's extras: buffers.head_gradient_bytes).
    DeepSpeed allocates them, not the module, so the trace cannot see them: the analytic phase's states and buffers
    with the trace's activations, the layers' part read at `fwd.layers` (`layers`: after the last layer's forward),
    since a mixed stack's slopes come from a layer of another kind. Stages 0-1 hold the head's gradient in param.grad
    as the trace does; stage 3 was exact without it. Where the first reduction is the head's
    (buffers.reduces_first_at_head) it runs when the second gradient arrives (the final norm's): `reduce_point`, the
    trace at that moment, gives what is saved then (the final norm's inputs too) and the gradients in flight
    (measured: docs/measurements/memory.md, "Issue 51")."""
    _, a, b = fit["activations"]
    saved = layers["activations"] if layers is not None else a * ckpt + b * full
    if reduce_point is not None:
        saved = reduce_point["activations"]
    ckpt_part = a * ckpt if uniform else 0  # a mixed stack's whole program has no per-layer split
    terms = {k: v for k, v in head.items() if k not in TRACED_TERMS}
    terms.update(
        activations=saved - ckpt_part,
        checkpointed_inputs=ckpt_part,
        rotary_tables=end["rotary_tables"],
        batch_and_loss=end["batch_and_loss"],
        module_buffers=end.get("module_buffers", 0),
    )
    if reduce_point is not None:
        terms["temporaries"] = reduce_point["temporaries"]
    out = {}
    for name, t in phases.items():
        out[name] = t
        if name == "backward (loss)":
            out["backward (head)"] = {k: v for k, v in terms.items() if v}
    return out


def _first_reduction(
    points: dict[str, dict[str, int]], fits: dict[str, dict[str, Affine]], bucket: int, cfg: TrainConfig
) -> str | None:
    """The `bwd.grad.N` point (code_trace: the moment the N-th gradient is accumulated) where the first reduction of
    stage 2, or of stage 1 with overlap_comm, comes when the bucket holds the LM head's gradient: the first arrival that would overflow the bucket
    (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads, `bucket.elements + param.numel() >
    reduce_bucket_size`), there the rank owning the last parameters allocates its partition (copy_grads_in_partition),
    inside a layer's backward. None where it is past the parameters every traced program accumulates alike (the
    gradients at the point grow with the layer counts: a deeper layer of the model, where the layers' points price it)
    or the trace has no such points."""
    pb, n = dtype_bytes(cfg.precision), 1
    while f"bwd.grad.{n}" in points:
        name = f"bwd.grad.{n}"
        if fits[name]["gradients"][1:] != (0, 0):
            return None
        if points[name]["gradients"] > bucket * pb:
            return name if n > 1 else None
        n += 1
    return None


def _first_reduction_terms(
    points: dict[str, dict[str, int]], at: str, head: dict[str, int], partition: int
) -> dict[str, int]:
    """'backward (first reduction)': the phase's states and buffers as at the head's gradient (`head`, the analytic
    'backward (head)': the bucket, two with overlap_comm), the partition copy_grads_in_partition allocates, the arriving
    gradient (not in the bucket yet), and what the trace holds at that moment beside its gradients (the gradients
    before it are in the bucket). With grad_accum > 1 the partition is the carried `accumulated_gradients` from the
    second micro step on, allocated at the first one's first reduction: counted once."""
    cats = points[at]
    n = int(at.rsplit(".", 1)[1])
    arriving = cats["gradients"] - points[f"bwd.grad.{n - 1}"]["gradients"]
    terms = {k: v for k, v in head.items() if k not in TRACED_TERMS and k != "head_gradient"}
    terms.update(
        gradient_partition=0 if head.get("accumulated_gradients") else partition,
        unreduced_gradient=arriving,
        activations=cats["activations"],
        temporaries=cats["temporaries"],
        batch_and_loss=cats["batch_and_loss"],
        rotary_tables=cats["rotary_tables"],
        module_buffers=cats.get("module_buffers", 0),
    )
    return {k: v for k, v in terms.items() if v}


def _programs(model: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> dict[tuple[int, int], Callable]:
    """The small programs `trace` steps, by (checkpointed, full) layers: each a call that traces it
    (or reads it from the cache) and returns its segment peaks by category."""
    ckpt, full = cfg.ckpt_layers, model.num_layers - cfg.ckpt_layers
    opts = dict(fused=not cluster.gpu.is_cpu, on_cpu=cluster.gpu.is_cpu)
    if builtin(model):
        from autotune.memory.tracer import builtin_program as program
    else:
        program = code_trace.trace_program
    return {
        km: functools.partial(program, model, cfg, ckpt=km[0], full=km[1], **opts)
        for km in _plan(ckpt, full, model.uniform_blocks)
    }


def mixed_blocks_note(model: ModelSpec) -> str:
    """A warning for a stack of mixed layer kinds too deep to trace whole, else ''."""
    if model.uniform_blocks or model.num_layers <= MIXED_TRACED_LAYERS:
        return ""
    return (
        f"{model.name}'s layers are not all the same module (dense and MoE, attention and recurrent) and "
        f"its {model.num_layers} layers are more than the {MIXED_TRACED_LAYERS} the memory model traces whole: "
        f"its activations are extrapolated from its first layers, approximate"
    )


def trace_jobs(model: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> list[Callable[[], object]]:
    """What `estimate` of code that must be traced (hf, factory) has yet to trace, one call per small
    program, for running them ahead (trace_cache.in_parallel); [] for the builtin model (analytic)
    and where every program is in the cache already."""
    if builtin(model):
        return []
    return [p for p in _programs(model, cluster, cfg).values() if p(only_cached=True) is None]


def trace(model: ModelSpec, cluster: Cluster, cfg: TrainConfig, layout: Layout | None = None) -> TracedEstimate:
    """Trace one training step of `model` under `cfg` on fake tensors; see the module docstring. `layout`:
    memory.estimate's (memory/layout.py), else that of (model, cluster, cfg)."""
    t0 = time.perf_counter()
    layout = layout or Layout.of(model, cluster, cfg)
    ckpt, full = cfg.ckpt_layers, model.num_layers - cfg.ckpt_layers
    traces = {km: program() for km, program in _programs(model, cluster, cfg).items()}
    fits, points = _fit(traces, ckpt, full)
    analytic = _phases(model, cluster, cfg, layout)
    held = buffers.held_extra_large_gradient(model, cfg, layout)
    at_end = buffers.stage2_reduces_at_end(model, cfg, layout)
    in_backward = buffers.stage1_reduces_in_backward(model, cfg, layout)
    reduces = (cfg.zero_stage == 2 and not at_end) or in_backward  # in backward
    buckets = buffers.buckets_in_backward(model, cfg, layout)
    fixed = (
        (
            buffers.partition_grad_bytes(cfg) * buffers.partition_elements(model, cluster, cfg),
            buffers.reduce_bucket_bytes(model, cfg, layout),
        )
        if in_backward
        else (0, 0)
    )
    # stage 2, or stage 1 reducing in backward (overlap_comm), whose first reduction is not at the LM head: where in
    # the layers' backward it comes
    first = (
        (layout.reduce_bucket_size, buffers.reduce_bucket_bytes(model, cfg, layout))
        if (cfg.zero_stage == 2 or (in_backward and cfg.grad_accum == 1))
        and reduces
        and not cfg.offload_optimizer
        and not buffers.reduces_first_at_head(model, cfg, layout)
        else None
    )
    step_key = (
        code_trace.spec_key(model),
        model.num_layers,
        model.num_params,
        cluster.world_size,
        cluster.gpu.is_cpu,
        cfg.zero_stage,
        cfg.offload_optimizer,
        cfg.optimizer,
        cfg.method,
        cfg.lora_rank,
        cfg.lora_targets,
        cfg.bf16_master_weights_and_grads,
        layout.zero3_largest_group,
    )
    if step_key not in _STEPS:  # the update depends on none of the activation inputs
        _STEPS[step_key] = _trace_step(model, cluster, cfg, layout)
    step = _STEPS[step_key]
    phases, raw = {}, {}
    for phase, names in PHASE_POINTS.items():
        present = [p for p in names if p in points]
        if not present:
            continue
        raw[phase] = max((points[p] for p in present), key=lambda c: sum(c.values()))
        # the stage changes which point is highest (stage 3 holds no growing gradients): chosen after
        options = [
            _stage_terms(
                phase,
                p,
                points,
                fits[p],
                analytic,
                cfg,
                full,
                held,
                reduces,
                model.uniform_blocks,
                buckets,
                fixed,
                first,
                buffers.late_freed_gradient(model, cfg, layout),
            )
            for p in present
        ]
        phases[phase] = max(options, key=lambda t: sum(t.values()))
    layer_points = [p for p in PHASE_POINTS["forward"] if p in points and p != "fwd.head"]
    if "forward (prefetch)" in analytic and layer_points:
        # ZeRO-3's head bucket is live through the layers before the head: their highest point + the bucket
        before_head = max(
            (
                _stage_terms("forward", p, points, fits[p], analytic, cfg, full, held, reduces, model.uniform_blocks)
                for p in layer_points
            ),
            key=lambda t: sum(t.values()),
        )
        before_head = {**before_head, "prefetch_bucket": analytic["forward (prefetch)"]["prefetch_bucket"]}
        phases = {"forward": phases.pop("forward"), "forward (prefetch)": before_head, **phases}
    if (reduces or at_end) and "backward (head)" in analytic:
        phases = _with_head_phase(
            phases,
            analytic["backward (head)"],
            points["fwd.end"],
            fits["fwd.end"],
            ckpt,
            full,
            points.get("fwd.layers"),
            model.uniform_blocks,
            points.get("bwd.reduce")
            if cfg.zero_stage == 2 and not cfg.offload_optimizer and buffers.reduces_first_at_head(model, cfg, layout)
            else None,
        )
    if first is not None and "backward (head)" in analytic:
        at = _first_reduction(points, fits, first[0], cfg)
        if at is not None:
            phases["backward (first reduction)"] = _first_reduction_terms(
                points, at, analytic["backward (head)"], buffers.reduced_partition_bytes(model, cluster, cfg)
            )
    step_bytes = step[0] if step else analytic["optimizer"].get("optimizer_temporaries", 0)
    phases["optimizer"] = {**phases["optimizer"], "optimizer_temporaries": step_bytes}
    phases["optimizer"] = {k: v for k, v in phases["optimizer"].items() if v}
    c, a, b = fits["fwd.end"]["activations"]
    return TracedEstimate(
        model=model.name,
        config=cfg,
        phases=phases,
        raw_phases=raw,
        analytic_phases=analytic,
        points=points,
        layer_bytes={"full_layer": b, "checkpointed_layer": a, "head": c},
        optimizer_step=step[1] if step else "not traced (CPU Adam / bitsandbytes): the analytic term",
        traced_layers=tuple(traces),
        trace_s=time.perf_counter() - t0,
    )


class Row(NamedTuple):
    phase: str
    term: str
    analytic: int | None
    traced: int | None

    @property
    def diff_pct(self) -> float | None:
        """(traced - analytic) / analytic in percent; None where either side has no such term."""
        if not self.analytic or self.traced is None:
            return None
        return 100.0 * (self.traced - self.analytic) / self.analytic


@dataclass(frozen=True)
class Comparison:
    rows: tuple[Row, ...]
    peak_phases: tuple[str, str]
    """Where the peak is: (analytic, traced)."""

    def __str__(self) -> str:
        def cell(v):
            return "-" if v is None else fmt_bytes(v)

        lines = [f"{'phase':<21} {'term':<24} {'analytic':>12} {'traced':>12} {'diff %':>8}"]
        for r in self.rows:
            pct = "" if r.diff_pct is None else f"{r.diff_pct:+.2f}"
            lines.append(f"{r.phase:<21} {r.term:<24} {cell(r.analytic):>12} {cell(r.traced):>12} {pct:>8}")
        return "\n".join(lines + [f"peak phase: {self.peak_phases[0]} (analytic), {self.peak_phases[1]} (traced)"])


def compare(est: MemoryEstimate, traced: TracedEstimate) -> Comparison:
    """Term by term and phase by phase, analytic against traced, then the two peaks. `est` is the
    analytic estimate for the builtin model; for other code (hf, factory) estimate() is the trace
    itself, and the analytic column is the stand-in's terms for the same shape."""
    analytic = {n: sum(t.values()) for n, t in traced.analytic_phases.items()}
    if est.phases not in (analytic, traced.totals):
        raise ValueError("the estimate and the trace are for different model/cluster/config inputs")
    rows = []
    for phase in list(analytic) + [p for p in traced.phases if p not in analytic]:
        a_terms, t_terms = traced.analytic_phases.get(phase, {}), traced.phases.get(phase, {})
        for term in list(a_terms) + [t for t in t_terms if t not in a_terms]:
            rows.append(Row(phase, term, a_terms.get(term), t_terms.get(term)))
        rows.append(Row(phase, "total", analytic.get(phase), traced.totals.get(phase)))
    a_phase = max(analytic, key=analytic.get)
    rows.append(Row("peak", "tensor peak", analytic[a_phase], traced.tensor_peak_bytes))
    return Comparison(tuple(rows), (a_phase, traced.phase))
