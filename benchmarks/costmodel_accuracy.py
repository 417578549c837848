"""How far the throughput cost model is from what was measured: per calibration point, median, worst.

    PYTHONPATH=. python benchmarks/costmodel_accuracy.py

Prints, for every point in autotune/data/calibration.yaml, the simulated and measured figure in
the scope it was published in (end to end, or DeepSpeed's engine timers for its autotuner's
figures) and simulated / measured - 1, then the per-term breakdown of each simulated step; then one
check that is not fitted: the end-to-end HF Trainer figure published beside the GPT-2 large timer
figures. Other published throughput tables are deliberately not read here: they judge the model.
CPU runs of our own are not priced: the cost model prices GPUs (see docs/costmodel.md, "What is
not measured").
"""

from __future__ import annotations

import statistics

from autotune.costmodel import calibration_points, simulate
from autotune.train_config import TrainConfig

E2E_CHECK = {"point": "gpt2-large-16xv100-z1", "samples_per_s": 69.061,
             "source": "microsoft/DeepSpeedExamples autotuning/hf/gpt2-large/README.md, 'HF + DS autotuning "
                       "(fast-mode)': 69.061 samples/s (z = 1, mbs = 3), the Trainer's end-to-end figure for the "
                       "configuration whose engine-timer figure is 87.3"}
"""Not fitted: how far the end-to-end price is from the end-to-end figure of the same setup."""


def main() -> None:
    errors = []
    print(f"{'point':<24} {'metric':<22} {'scope':<14} {'measured':>10} {'simulated':>10} {'error':>7}")
    rows = []
    for p in calibration_points():
        s = simulate(p.model, p.cluster, p.config, runtime=p.runtime, scope=p.scope)
        sim = getattr(s, p.metric)
        err = sim / p.measured - 1
        errors.append(err)
        rows.append((p, s))
        print(f"{p.name:<24} {p.metric:<22} {p.scope:<14} {p.measured:>10.1f} {sim:>10.1f} {err:>+7.1%}")
    abs_err = [abs(e) for e in errors]
    print(f"\nmedian |error| {statistics.median(abs_err):.1%}, worst |error| {max(abs_err):.1%} "
          f"over {len(errors)} calibration figures")

    print("\nper-term breakdown of each simulated step (seconds, share of the step):")
    for p, s in rows:
        terms = s.terms()
        print(f"  {p.name:<24} step {s.step_time_s:.4f} s, MFU {100 * s.mfu:.1f}%: " + ", ".join(
            f"{k} {v:.4f} ({100 * v / s.step_time_s:.0f}%)" for k, v in terms.items() if v))

    point = next(p for p in calibration_points() if p.name == E2E_CHECK["point"])
    cfg: TrainConfig = point.config
    e2e = simulate(point.model, point.cluster, cfg, runtime=point.runtime, scope="end_to_end").samples_per_s
    measured = E2E_CHECK["samples_per_s"]
    print(f"\nnot fitted, end to end: {point.name} simulated {e2e:.1f} vs HF Trainer end-to-end {measured} "
          f"samples/s: {e2e / measured - 1:+.1%}\n  ({E2E_CHECK['source']})")


if __name__ == "__main__":
    main()
