"""The typed records of a trial, from the request to the result, owned here and nowhere else.

    TrialRequest  -> what to run (executors and the launcher take it)
    RankReport    -> what one rank measured (the worker writes it as rank<R>.json)
    NodeOutcome   -> what the launcher saw of one node's ranks (exit codes, time, the reports)
    TrialResult   -> the trial, all ranks and nodes together (what the search records)

Every figure in a TrialResult says where it came from in `source`: "measured" (a real run) or
"simulated" (the cost model). `autotune.search.study` is the one place that maps a TrialResult to and from
Optuna's user attributes.
"""

from __future__ import annotations

import dataclasses
import shlex
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from autotune.hardware import Cluster
from autotune.models import ModelSpec
from autotune.train_config import TrainConfig

Status = Literal["ok", "oom", "diverged", "timeout", "crashed", "pruned", "dry-run"]
"""How a trial ended. `pruned`: decided without a run (memory model, dominance, implied oom). `dry-run`: placed and
its ranks started with their environment, stopped before the first CUDA call (`autotune search --dry-run`): nothing
was measured."""
DRY_RUN = "dry-run"
FAILED: tuple[str, ...] = ("oom", "diverged", "timeout", "crashed")
"""Statuses of a run that did not produce a throughput."""
RUN: tuple[str, ...] = ("ok", *FAILED)
"""Statuses of a trial that ran (or was simulated)."""
Source = Literal["measured", "simulated", "dry-run"]
assert set(typing.get_args(Status)) == {*RUN, "pruned", DRY_RUN}


class _Json:
    """asdict / from a dict that may hold keys of an older or newer version (ignored)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True, kw_only=True)
class ScriptSpec:
    """The user's own training script as the trial (`autotune search --script`, docs/trials.md "Your own script"):
    every candidate runs `python PATH ARGS CONFIG_FLAG JSON` on the placed ranks (autotune/trial/script_rank.py), where
    JSON is the candidate's DeepSpeed JSON (autotune.trial.script.script_config). A study keeps it as an input."""

    path: str
    """The script, an absolute path (on a cluster of several nodes: the same path on every node)."""
    args: tuple[str, ...] = ()
    """Its own arguments, before autotune's."""
    config_flag: str = "--deepspeed"
    """The argument that takes the JSON's path: the Trainer's `--deepspeed`, or e.g. `--deepspeed_config`."""
    template: dict | None = None
    """The user's own DeepSpeed JSON (`--script-config`): kept, only the keys autotune tunes changed. None: the JSON
    in the Trainer's style ("auto" wherever the Trainer fills a value in)."""
    template_path: str = ""
    trainer_args: bool = True
    """Also pass the Trainer's arguments for what autotune tunes and the Trainer fills in
    (--per_device_train_batch_size, --gradient_accumulation_steps, --bf16 / --fp16), as DeepSpeed's autotuner maps
    them for the Hugging Face Trainer (its `arg_mappings`)."""
    cwd: str = "."
    """Where the script runs (the directory `autotune search` ran in: its relative paths mean what they meant there)."""
    as_given: bool = False
    """The template is the whole JSON, only the stop hook added (`autotune export --verify`: the exported file)."""

    @property
    def name(self) -> str:
        return Path(self.path).name

    def label(self) -> str:
        """`train.py --model_config tiny.json`: what the record and the report say after "script: "."""
        return shlex.join([self.name, *self.args])

    def to_attrs(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "args": list(self.args)}

    @classmethod
    def from_attrs(cls, d: dict[str, Any]) -> "ScriptSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{**{k: v for k, v in d.items() if k in names}, "args": tuple(d.get("args") or ())})

    def same_inputs(self, other: "ScriptSpec") -> bool:
        """Whether two specs run the same thing (where they run from aside)."""
        a, b = self.to_attrs(), other.to_attrs()
        a.pop("cwd"), b.pop("cwd")
        return a == b


@dataclass(frozen=True, kw_only=True)
class TrialRequest:
    model: ModelSpec
    cluster: Cluster
    config: TrainConfig
    out_dir: Path
    """This trial's own folder: config, log, memory summary, trace."""
    steps: int = 6
    """Measured optimizer steps (after warm-up)."""
    warmup_steps: int = 2
    timeout_s: float = 300.0
    """Wall-clock limit for the whole process group; past it every rank is killed."""
    profile: bool = False
    """Also write a profiler trace (chrome://tracing / Perfetto) into out_dir."""
    trial_id: int | None = None
    fault: str | None = None
    """Test hook, injected into the worker: 'nan' (non-finite loss), 'hang', 'crash', 'exit', 'cuda-oom' (an
    out-of-memory error raised outside the caching allocator, as NCCL and cuBLAS raise it). None in use."""
    optimizer_impl: str | None = None
    """Which optimizer code runs (autotune.deepspeed_config.OPTIMIZER_IMPLS); None: the launcher decides on the node
    it runs on (autotune.trial.ops.optimizer_impl), the Ray executor decides once for every node."""
    dry_run: bool = False
    """Place the trial and start its ranks with their environment, then stop before the first CUDA call: each rank
    reports what it would run with (RankReport.plan) and measures nothing."""
    script: ScriptSpec | None = None
    """Run the user's script instead of autotune's own loop (autotune/trial/script_rank.py); None: the worker."""


@dataclass(kw_only=True)
class RankReport(_Json):
    """One rank's measurements of one config (`<out_dir>/rank<R>.json`). Peaks are tensor bytes
    relative to `baseline_bytes`, the live bytes before the model was built."""

    status: Status
    reason: str = ""
    index: int = 0
    """The config's position in the process group's list of requests."""
    time: float | None = None
    """Wall time of a failure (the first failing rank is the one to blame)."""
    traceback: str = ""
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    init_peak_bytes: int | None = None
    peak_bytes: int | None = None
    step_peak_bytes: list[int] = field(default_factory=list)
    step_end_bytes: list[int] = field(default_factory=list)
    phase_peak_bytes: dict[str, int] = field(default_factory=dict)
    baseline_bytes: int | None = None
    reserved_bytes: int | None = None
    param_bytes: int | None = None
    loss_scale: float | None = None
    overflow_count: int | None = None
    step_skipped: list[bool] = field(default_factory=list)
    """fp16, per optimizer step (warm-up steps first): DeepSpeed skipped its update for an overflow."""
    step_loss_scales: list[float] = field(default_factory=list)
    """fp16, per optimizer step (warm-up steps first): the loss scale after it."""
    plan: dict[str, Any] = field(default_factory=dict)
    """A dry run's rank plan: the environment and choices this rank would train with (TrialRequest.dry_run)."""
    timings: dict[str, float] = field(default_factory=dict)
    """Where the rank's time went: setup_s, build_s, init_s, train_s, profiler_stop_s, analysis_s,
    teardown_s (cumulative from the config's start where the name says so; see launch._timings)."""
    engine: dict[str, Any] = field(default_factory=dict)
    """A script trial: what the script's DeepSpeed engine ran, read from it (train_batch_size, micro batch, grad
    accum, ZeRO stage, precision), the tokens of each measured step (its forward's input_ids), and on rank 0
    DeepSpeed's own autotuning metric (autotune/trial/script_rank.py)."""


@dataclass(kw_only=True)
class NodeOutcome:
    """What the launcher saw of one node's ranks for one config."""

    ranks: dict[int, RankReport] = field(default_factory=dict)
    status: str = ""
    """Empty when the ranks decided (their reports say); else the launcher's verdict (timeout, a
    crash without a report, oom by the resident-memory guard)."""
    reason: str = ""
    log_tail: str = ""
    wall_s: float = 0.0
    timings_s: dict[str, float] = field(default_factory=dict)
    node_id: str = ""
    """Ray node id (empty for a local run)."""
    task_start: float | None = None
    task_end: float | None = None
    """Wall-clock bounds of the Ray task that ran this node (None for a local run)."""


@dataclass(kw_only=True)
class TrialResult(_Json):
    status: Status
    reason: str = ""
    source: Source = "measured"
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    """Median seconds per optimizer step (grad_accum micro batches)."""
    step_time_spread_s: float | None = None
    """Max minus min step time over the measured steps."""
    tflops: float | None = None
    """Model TFLOPS per device (6N + attention, no recompute counted)."""
    mfu: float | None = None
    """tflops / the device's peak for the precision; None where the peak is unknown (CPU)."""
    peak_bytes: int | None = None
    """Measured peak tensor bytes in the measured steps, max over ranks."""
    peak_bytes_per_rank: list[int] = field(default_factory=list)
    init_peak_bytes: int | None = None
    """Peak tensor bytes during model build and deepspeed.initialize (max over ranks)."""
    reserved_bytes: int | None = None
    """GPU only: torch.cuda.max_memory_reserved (the caching allocator's high-water mark)."""
    phase_peak_bytes: dict[str, int] = field(default_factory=dict)
    """Peak per phase of the last measured step: forward, backward, optimizer (rank 0)."""
    step_peak_bytes: list[int] = field(default_factory=list)
    """Peak per measured step (rank 0): growth across steps is a leak."""
    leak: bool = False
    losses: list[float] = field(default_factory=list)
    loss_scale: float | None = None
    overflow_count: int | None = None
    """fp16: measured steps whose update DeepSpeed skipped for an overflow; they are left out of step_time_s."""
    warmup_overflow_count: int | None = None
    """fp16: warm-up steps skipped for an overflow (the first ones usually are: the scale starts at 2^16)."""
    skipped_steps: list[int] = field(default_factory=list)
    """fp16: the measured steps (0 = the first measured one) whose update was skipped."""
    step_loss_scales: list[float] = field(default_factory=list)
    """fp16: the loss scale after each optimizer step, warm-up steps first (rank 0)."""
    optimizer_impl: str = ""
    """The optimizer code that ran (autotune.deepspeed_config.OPTIMIZER_IMPLS): it changes the step time, and
    `autotune export` writes the JSON for the same one."""
    rank_plans: dict[str, dict[str, Any]] = field(default_factory=dict)
    """A dry run's plan per global rank (RankReport.plan), plus the node's and the executor's under "node<i>"."""
    wall_s: float | None = None
    """Whole trial, spawn to teardown."""
    overhead_s: float | None = None
    """wall_s minus the measured steps' time: spawn, init, warm-up, teardown, placement."""
    log_tail: str = ""
    out_dir: str | None = None
    param_bytes_per_rank: list[int] = field(default_factory=list)
    """Parameter bytes each rank holds after deepspeed.initialize (its ZeRO-3 partition, or all)."""
    baseline_bytes: int | None = None
    """Live tensor bytes before the model was built (rank 0); every peak above is relative to it."""
    step_end_bytes: list[int] = field(default_factory=list)
    """Live bytes at the end of each measured step (rank 0): growth across steps is a leak."""
    nodes: list[str] = field(default_factory=list)
    """Where each node's ranks ran (Ray node ids, node 0 first); empty for a local run."""
    implementation: str = ""
    """The model code measured or priced (ModelSpec.code_name): hf:<architecture>, builtin, factory:<fn>."""
    timings_s: dict[str, float] = field(default_factory=dict)
    """Where wall_s went: spawn_s, setup_s, build_s, initialize_s, warmup_s, measured_s,
    profiler_stop_s, analysis_s, teardown_s, exit_s, and under Ray placement_s and ray_s."""
    script: str = ""
    """A script trial: the script and its own arguments (ScriptSpec.label), empty for autotune's own loop."""
    engine: dict[str, Any] = field(default_factory=dict)
    """A script trial: what its engine ran (rank 0's RankReport.engine) and DeepSpeed's autotuning metric."""
