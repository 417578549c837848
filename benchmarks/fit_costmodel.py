"""Fit the cost model's one free constant to the published points, and print the error on each.

    python benchmarks/fit_costmodel.py

`Constants.elementwise_passes` is chosen on a grid of whole passes to minimise the sum of squared
log errors, simulated / measured, over every point in autotune/data/calibration.yaml. Nothing is
fitted per point. The printed value is what autotune/costmodel.py's default holds.
"""

from __future__ import annotations

import math

from autotune.costmodel import Constants, calibration_errors, calibration_points


def loss(passes: float) -> float:
    return sum(math.log1p(e) ** 2 for e in calibration_errors(Constants(elementwise_passes=passes)).values())


def fit(lo: int = 0, hi: int = 1000) -> float:
    return float(min(range(lo, hi + 1), key=loss))


def main() -> None:
    best = fit()
    print(f"elementwise_passes = {best:.0f}  (default in costmodel.py: {Constants().elementwise_passes:.0f})")
    errors = calibration_errors(Constants(elementwise_passes=best))
    for p in calibration_points():
        print(f"  {p.name:24s} {p.metric:22s} measured {p.measured:10.1f}  error {errors[p.name]:+.1%}")


if __name__ == "__main__":
    main()
