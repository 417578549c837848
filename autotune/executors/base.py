"""The executor contract: a TrialRequest goes in, a TrialResult comes back as a value.

Every figure in a TrialResult says where it came from in `source`: "measured" (a real run) or
"simulated" (the cost model). Reports print the source beside every number.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from autotune.hardware import Cluster
from autotune.models import ModelSpec
from autotune.space import TrainConfig

Status = Literal["ok", "oom", "diverged", "timeout", "crashed", "pruned"]
STATUSES = ("ok", "oom", "diverged", "timeout", "crashed", "pruned")


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
    """Test hook, injected into the worker: 'nan' (non-finite loss), 'hang', 'crash'. None in use."""


@dataclass(kw_only=True)
class TrialResult:
    status: Status
    reason: str = ""
    source: Literal["measured", "simulated"] = "measured"
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrialResult":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class Executor(abc.ABC):
    """Runs trials; several at once when it has room. Results come back as values."""

    source: Literal["measured", "simulated"] = "measured"

    @abc.abstractmethod
    def slots(self) -> int:
        """How many trials can run at the same time."""

    @abc.abstractmethod
    def submit(self, request: TrialRequest) -> str:
        """Start a trial; returns a ticket."""

    @abc.abstractmethod
    def wait_any(self, timeout_s: float | None = None) -> list[tuple[str, TrialResult]]:
        """Block until at least one submitted trial finishes (or timeout); return the finished ones."""

    def close(self) -> None:
        """Release workers; running trials are killed."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
