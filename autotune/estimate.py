"""`autotune estimate` as a library: one configuration priced per GPU, term by term (the memory model), with
the cost model's step time (simulated) and, when asked, the largest sequence length or micro batch that fits.

    model, cluster, cfg = resolve("13b", "4xA100", zero_stage=3)
    b = breakdown(model, cluster, cfg, largest=("seq_len",))
    print(b.render())                   # what `autotune estimate` prints; b.to_json() is its --json

The CLI (autotune/cli/estimate.py) parses, calls these and prints.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from autotune.hardware import Cluster, parse_gpus
from autotune.models import ModelSpec, default_seq_len, resolve_model
from autotune.models.hf_config import default_attention
from autotune.train_config import TrainConfig, check_config

LARGEST = ("seq_len", "micro_batch")
"""What `largest` may ask for, in the order answered (`--max-seq-len`, `--max-micro-batch`)."""


def resolve(
    model: str, gpus: str, *, impl: str | None = None, model_factory: str | None = None, **config: Any
) -> tuple[ModelSpec, Cluster, TrainConfig]:
    """The specs of one estimate from what a user types: `model` a preset, alias, config.json or cached hub id;
    `gpus` the --gpus grammar; `config` TrainConfig fields (the rest at their defaults). seq_len None or left out:
    the model's default; attention None or left out: what transformers picks for the model's class."""
    spec = resolve_model(model, implementation=impl or "hf", factory=model_factory)
    cluster = parse_gpus(gpus)
    values = {f.name: f.default for f in dataclasses.fields(TrainConfig)} | {"seq_len": None, "attention": None}
    values |= config
    if values["seq_len"] is None:
        values["seq_len"] = default_seq_len(spec)
    pick = values["attention"] is None  # what transformers picks for the class, once the rest is valid
    # fast: looks up no class for eager; Ulysses refuses eager (autotune/parallel.py), so sdpa stands in there
    stand_in = "sdpa" if values["sequence_parallel_size"] > 1 else "eager"
    cfg = TrainConfig(**{**values, "attention": stand_in if pick else values["attention"]})
    check_config(cfg, spec, cluster)
    if pick:
        cfg = dataclasses.replace(cfg, attention=default_attention(spec))
        check_config(cfg, spec, cluster)
    return spec, cluster, cfg


@dataclass(frozen=True)
class Breakdown:
    """One configuration's estimate and what `autotune estimate` shows with it."""

    model: ModelSpec
    cluster: Cluster
    cfg: TrainConfig
    est: Any
    """memory.MemoryEstimate (estimated)."""
    simulated: Any
    """costmodel.simulate's result (simulated); None on CPU ranks, which have no datasheet to price them by."""
    largest: dict[str, int]
    """max_seq_len / max_micro_batch -> the largest value that fits (0: not even 1), for those asked."""
    risks: list[str]
    memory_note: str
    traced: Any = None
    """memory.traced.trace's result (`trace=True`): the trial model's step on fake tensors."""

    def to_json(self) -> dict:
        """`autotune estimate --json`'s object."""
        model, cluster, cfg = self.model, self.cluster, self.cfg
        out = {
            "implementation": model.code_name,
            **self.est.to_json(),
            "model": model.name,
            "gpus": cluster.text,
            "config": cfg.to_dict(),
        }
        out["simulated"] = None if self.simulated is None else self.simulated.to_json()
        out.update(self.largest)
        out["risks"] = self.risks
        if self.memory_note:
            out["memory_note"] = self.memory_note
        if cluster.note:
            out["note"] = cluster.note
        if self.traced is not None:
            out["traced"] = self.traced.to_json()
        return out

    def render(self) -> str:
        """`autotune estimate`'s text: the terms at the peak, phases, verdict, the simulated step, warnings."""
        from autotune.units import GiB, fmt_bytes

        model, cluster, cfg, est = self.model, self.cluster, self.cfg, self.est
        lines = [
            model.describe(),
            f"on {cluster.describe()}" + (f"  [{cluster.note}]" if cluster.note else ""),
            f"config: {cfg.short()} seq {cfg.seq_len} attention {cfg.attention}\n",
            f"{'term (estimated)':<26} {'bytes':>16} {'GiB':>9} {'share':>6}  phase",
        ]
        for name, b in sorted(est.terms.items(), key=lambda kv: -kv[1]):
            lines.append(f"{name:<26} {b:>16,} {b / GiB:>9.3f} {100 * b / est.tensor_peak_bytes:>5.1f}%  {est.phase}")
        lines.append(f"{'tensor peak':<26} {est.tensor_peak_bytes:>16,} {est.tensor_peak_bytes / GiB:>9.3f}")
        for name, b in est.overhead.items():
            lines.append(f"{'+ ' + name:<26} {b:>16,} {b / GiB:>9.3f}         framework overhead (allowance)")
        lines.append(f"{'total per GPU':<26} {est.total_bytes:>16,} {est.total_bytes / GiB:>9.3f}")
        lines.append("\npeak by phase: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in est.phases.items()))
        if est.host_bytes:
            cap = f" of {fmt_bytes(est.host_capacity_bytes)}" if est.host_capacity_bytes else " (node RAM unknown)"
            lines.append(f"host RAM per node (estimated): {fmt_bytes(est.host_bytes)}{cap}")
        lines.append(f"verdict: {est.verdict()}")
        s = self.simulated
        if s is not None:  # the cost model's step time, per term (simulated: plan and rank with it, then measure)
            lines.append(
                f"\nsimulated step {s.step_time_s:.4f} s: {s.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
                f"{s.samples_per_s:,.1f} samples/s, MFU {100 * s.mfu:.1f}%"
            )
            lines.append(f"{'term (simulated)':<26} {'seconds':>10} {'share':>6}")
            lines += [f"{name:<26} {t:>10.4f} {100 * t / s.step_time_s:>5.1f}%" for name, t in s.terms().items()]
        lines += [f"WARNING: {text}" for text in [*self.risks, self.memory_note] if text]
        lines += [self._largest_line(k, v) for k, v in self.largest.items()]
        if self.traced is not None:
            from autotune.memory.traced import compare

            lines.append(
                f"\ntraced (the trial model's step on fake tensors, {self.traced.trace_s:.1f} s) vs estimated:"
            )
            lines.append(str(compare(est, self.traced)))
        return "\n".join(lines)

    def _largest_line(self, k: str, v: int) -> str:
        model, cfg = self.model, self.cfg
        other = f"micro batch {cfg.micro_batch}" if k == "max_seq_len" else f"seq len {cfg.seq_len}"
        what = k.removeprefix("max_").replace("_", " ")
        bound = (
            " = the model's max_seq_len: its code runs no longer sequences (position table or ALiBi)"
            if k == "max_seq_len" and v == model.max_seq_len and model.position != "rotary"
            else ""
        )
        if k == "max_seq_len" and v > model.max_seq_len and model.position == "rotary":
            # not capped: rotary code runs any length, and long context (sequence parallelism) is the point of going
            # past it; what the model was trained for is the config's max_position_embeddings
            bound = (
                f" (memory's answer: past the model's max_position_embeddings {model.max_seq_len}, which it was "
                "trained for, it needs RoPE scaling, e.g. rope_scaling in its config, to model such lengths well)"
            )
        return f"largest {what} that fits (with {other}): {v}{bound}" if v else f"no {what} fits (with {other})"


def breakdown(
    model: ModelSpec, cluster: Cluster, cfg: TrainConfig, largest: tuple[str, ...] = (), trace: bool = False
) -> Breakdown:
    """The estimate of `cfg`, the cost model's step (GPUs only), the largest value of each of `largest`
    ("seq_len", "micro_batch") that fits, and with `trace` the step traced on fake tensors (seconds, no GPU)."""
    from autotune.memory import estimate
    from autotune.memory.limits import largest_fitting, traced_once
    from autotune.memory.traced import mixed_blocks_note
    from autotune.train_config import risks

    unknown = set(largest) - set(LARGEST)
    if unknown:
        raise ValueError(f"largest: {sorted(unknown)} not in {LARGEST}")
    family = next((n for n in LARGEST if n in largest), None)
    # asked for the largest sequence length, the configuration's own estimate comes from the same build
    with traced_once(model, cfg, family):
        trace_ahead(model, cluster, cfg)
        est = estimate(model, cluster, cfg)
        simulated = None
        if not cluster.gpu.is_cpu:
            from autotune.costmodel import simulate

            simulated = simulate(model, cluster, cfg)
        found = {f"max_{n}": largest_fitting(model, cluster, cfg, n) for n in LARGEST if n in largest}
        traced = None
        if trace:
            from autotune.memory.traced import trace as trace_step

            traced = trace_step(model, cluster, cfg)
        return Breakdown(model, cluster, cfg, est, simulated, found, risks(cfg), mixed_blocks_note(model), traced)


def trace_ahead(model: ModelSpec, cluster: Cluster, cfg: TrainConfig) -> None:
    """A first estimate of transformers' code traces two programs and, on GPUs, the cost model's op profile:
    here the last program in a forked process, which stores it in the trace cache (autotune/trace_cache.py), the
    rest in this one, so two cores share them; a later run finds them cached and forks nothing. Measured by
    `python benchmarks/estimate_speed.py` (docs/search.md)."""
    from autotune.memory.code_trace import kept_on_disk
    from autotune.memory.traced import trace_jobs
    from autotune.trace_cache import in_parallel

    jobs = trace_jobs(model, cluster, cfg) if kept_on_disk(model) else []
    here, there = jobs[:-1], jobs[-1:]
    if not cluster.gpu.is_cpu:
        from autotune.costmodel import simulate

        here.append(lambda: simulate(model, cluster, cfg))
    if here and there:
        in_parallel(here, there)
