"""Fit the cost model's sustained share per GPU generation to the published points, and print the error on each.

    python benchmarks/fit_costmodel.py

`Constants.sustained` (the share of a kernel benchmark's efficiency that compute-bound kernels keep
inside a training step) is chosen per GPU generation (costmodel.generation: Ampere = A100, Hopper =
H100/H200, other = the rest) on a grid of 0.005, minimising the worst absolute error, simulated /
measured - 1, over that generation's points in autotune/data/calibration.yaml: the two A100 and the
two H100 llm-foundry rows (issue 6's two points and issue 32's pair of each), the three GPT-2 large
V100 figures for "other". Each point is priced in its own scope (end to end, or DeepSpeed's engine
timers for the autotuner's figures). Nothing is fitted per point and no other published table is used:
those judge the model (benchmarks/costmodel_accuracy.py). The printed values are what
autotune/costmodel.py's SUSTAINED_FIT holds.
"""

from __future__ import annotations

from autotune.costmodel import Constants, calibration_errors, calibration_points, generation


def points_of(gen: str) -> list[str]:
    return [p.name for p in calibration_points() if generation(p.cluster.gpu.name) == gen]


def loss(gen: str, share: float) -> float:
    errors = calibration_errors(Constants().with_share(gen, share))
    return max(abs(errors[n]) for n in points_of(gen))


def fit(gen: str, lo: float = 0.40, hi: float = 1.00) -> float:
    grid = [round(lo + 0.005 * i, 3) for i in range(round((hi - lo) / 0.005) + 1)]
    return min(grid, key=lambda s: loss(gen, s))


def main() -> None:
    best = {gen: fit(gen) for gen in dict(Constants().sustained)}
    print(f"sustained = {best}  (default in costmodel.py: {dict(Constants().sustained)})")
    c = Constants()
    for gen, share in best.items():
        c = c.with_share(gen, share)
    errors = calibration_errors(c)
    for p in calibration_points():
        print(
            f"  {p.name:24s} {generation(p.cluster.gpu.name):7s} {p.metric:22s} {p.scope:14s} "
            f"measured {p.measured:10.1f}  error {errors[p.name]:+.1%}"
        )


if __name__ == "__main__":
    main()
