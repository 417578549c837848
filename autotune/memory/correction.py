"""Online correction of the memory model during a study (issue 5).

Every measured trial is a data point: its measured peak against the estimate's tensor peak for the
same configuration. The correction is one multiplicative factor on the tensor peak, the largest
ratio seen so far plus a margin, so that no configuration the study has measured would be
under-priced by the corrected model. It only tightens: a factor below 1 would prune less on the
strength of a few trials, and a wrongly admitted candidate costs a whole trial.

An out-of-memory trial whose estimate fitted is evidence that the true total exceeded capacity:
the factor rises at once so that this configuration's corrected total lands above capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autotune.memory import MemoryEstimate

MARGIN = 0.01
"""Head-room over the worst ratio observed: one percent, the spread of measured peaks between
ranks on CPU (tests/test_trial.py records per-rank peaks)."""


@dataclass
class Correction:
    factor: float = 1.0
    """Multiplier on the estimate's tensor peak; 1.0 until evidence says the model under-prices."""
    observations: list[dict] = field(default_factory=list)

    def __call__(self, est: MemoryEstimate, cfg=None) -> int:
        """The search's corrector protocol (autotune/search/loop.py, Corrector): corrected total bytes."""
        return self.total_bytes(est)

    def observe(self, est: MemoryEstimate, cfg, result) -> None:
        """The search's hook: every finished trial. Only measured peaks are evidence; a simulated
        result's peak is the estimate itself."""
        if getattr(result, "source", "measured") != "measured":
            return
        label = cfg.short() if cfg is not None else ""
        if result.status == "oom":
            self.observe_oom(est, label)
        elif result.status == "ok" and result.peak_bytes:
            self.observe_measured(est, result.peak_bytes, label)

    def observe_measured(self, est: MemoryEstimate, measured_peak_bytes: int, label: str = "") -> None:
        """A measured trial: record its ratio and tighten if the model under-priced it."""
        ratio = measured_peak_bytes / est.tensor_peak_bytes
        self.observations.append(
            {
                "label": label,
                "kind": "measured",
                "estimated": est.tensor_peak_bytes,
                "measured": measured_peak_bytes,
                "ratio": ratio,
            }
        )
        if ratio > 1.0:
            self.factor = max(self.factor, ratio * (1 + MARGIN))

    def observe_oom(self, est: MemoryEstimate, label: str = "") -> None:
        """A trial that ran out of memory: its true total exceeded capacity."""
        self.observations.append(
            {"label": label, "kind": "oom", "estimated": est.tensor_peak_bytes, "measured": None, "ratio": None}
        )
        if est.fits:
            needed = (est.capacity_bytes - est.overhead_bytes) / est.tensor_peak_bytes
            self.factor = max(self.factor, needed * (1 + MARGIN))

    def total_bytes(self, est: MemoryEstimate) -> int:
        """The corrected per-GPU total (tensor peak x factor, plus the overhead allowance)."""
        return int(est.tensor_peak_bytes * self.factor) + est.overhead_bytes

    def fits(self, est: MemoryEstimate) -> bool:
        return self.total_bytes(est) <= est.capacity_bytes

    def summary(self) -> dict:
        """The correction and the model's error before and after it, over the measured trials."""
        measured = [o for o in self.observations if o["kind"] == "measured"]
        before = [abs(o["ratio"] - 1) for o in measured]
        after = [abs(o["ratio"] / self.factor - 1) for o in measured]
        return {
            "factor": self.factor,
            "measured_trials": len(measured),
            "oom_trials": sum(o["kind"] == "oom" for o in self.observations),
            "median_abs_error_before": _median(before),
            "max_abs_error_before": max(before, default=None),
            "median_abs_error_after": _median(after),
            "max_abs_error_after": max(after, default=None),
        }


def _median(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2
