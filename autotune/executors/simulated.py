"""An executor that runs nothing: each trial is priced by the cost model (autotune.costmodel) and
checked against the memory model (autotune.memory). What `--executor simulated` uses, and what
`auto` picks when the requested GPUs are not on this machine.

Every TrialResult it returns says source="simulated", and its reason and log_tail say so too.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

from autotune.costmodel import simulate
from autotune.errors import SpecError
from autotune.executors.base import Executor
from autotune.memory import estimate
from autotune.train_config import check_config
from autotune.trial.record import TrialRequest, TrialResult
from autotune.units import fmt_bytes

OOM_REASON = "simulated: estimate exceeds capacity"

# The trial runner's test hook (TrialRequest.fault), answered the way a real trial ends with it.
_FAULTS = {
    "nan": ("diverged", "simulated fault: non-finite loss"),
    "hang": ("timeout", "simulated fault: hang, killed at the timeout"),
    "crash": ("crashed", "simulated fault: a rank crashed"),
}


def simulated_result(request: TrialRequest) -> TrialResult:
    """_simulated's result, naming the model code the models priced."""
    res = _simulated(request)
    res.implementation = request.model.code_name
    return res


def _simulated(request: TrialRequest) -> TrialResult:
    """What the trial would report, from the models: oom if the memory estimate exceeds the
    device, else the cost model's throughput. Invalid configs come back crashed, with why.
    peak_bytes is the estimate's tensor bytes: what a measured trial's peak_bytes counts."""
    cfg, cluster = request.config, request.cluster
    if request.fault in _FAULTS:
        status, reason = _FAULTS[request.fault]
        return TrialResult(status=status, reason=reason, source="simulated", log_tail=reason)
    try:
        check_config(cfg, request.model, cluster)
        est = estimate(request.model, request.cluster, request.config)
        if not est.fits:
            log = (
                f"simulated: memory model estimates {fmt_bytes(est.total_bytes)} per device, capacity "
                f"{fmt_bytes(est.capacity_bytes)}; no process was run"
            )
            return TrialResult(
                status="oom", reason=OOM_REASON, source="simulated", peak_bytes=est.tensor_peak_bytes, log_tail=log
            )
        step = simulate(request.model, cluster, cfg)
    except SpecError as e:
        return TrialResult(status="crashed", reason=f"simulated: {e}", source="simulated", log_tail=f"simulated: {e}")
    log = (
        f"simulated: cost model (autotune.costmodel), no process was run; step {step.step_time_s:.4g} s, "
        f"{step.tokens_per_s_per_gpu:.4g} tokens/s per GPU, MFU {step.mfu:.1%}; memory estimate "
        f"{fmt_bytes(est.total_bytes)} of {fmt_bytes(est.capacity_bytes)}"
    )
    return TrialResult(
        status="ok",
        reason="simulated (cost model)",
        source="simulated",
        samples_per_s=step.samples_per_s,
        tokens_per_s=step.samples_per_s * cfg.seq_len,
        step_time_s=step.step_time_s,
        step_time_spread_s=0.0,
        tflops=step.tflops_per_gpu,
        mfu=step.mfu,
        peak_bytes=est.tensor_peak_bytes,
        log_tail=log,
    )


class SimulatedExecutor(Executor):
    """Prices every submitted trial at once; `wait_any` hands back all of them."""

    source = "simulated"

    def __init__(self, *, slots: int = 256, write_files: bool = True):
        """slots: how many trials a caller may keep in flight (pricing is instant, so many);
        write_files: write each trial's simulated.json into its out_dir, as a real trial writes its
        own record there."""
        self._slots, self._write = slots, write_files
        self._done: dict[str, TrialResult] = {}
        self._tickets = itertools.count()

    def slots(self) -> int:
        return self._slots

    def submit(self, request: TrialRequest) -> str:
        t0 = time.perf_counter()
        result = simulated_result(request)
        result.wall_s = time.perf_counter() - t0
        if self._write:
            result.out_dir = str(request.out_dir)
            _write_record(Path(request.out_dir), request, result)
        ticket = f"sim-{next(self._tickets)}"
        self._done[ticket] = result
        return ticket

    def wait_any(self, timeout_s: float | None = None) -> list[tuple[str, TrialResult]]:
        """Every submitted trial is finished already; with none submitted, an empty list at once."""
        done, self._done = list(self._done.items()), {}
        return done

    def close(self) -> None:
        self._done.clear()


def _write_record(out_dir: Path, request: TrialRequest, result: TrialResult) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    step = simulate(request.model, request.cluster, request.config).to_json() if result.status == "ok" else None
    record = {"source": "simulated", "config": request.config.to_dict(), "result": result.to_dict(), "cost_model": step}
    (out_dir / "simulated.json").write_text(json.dumps(record, indent=2, default=str))
