"""When a search may stop: a bound on what every unrun candidate could still reach.

The prior (the cost model on GPUs, the CPU prior on CPU ranks) is wrong by some factor at every
candidate. Call r(c) = log(true / prior) its residual. The residuals of two candidates are not
independent: the same code on the same machine misses by much the same factor, and close settings
(one ZeRO stage, one doubling of micro batch apart) miss alike. So r is modelled as

    r(c) = shared offset + smooth part + a part of its own
           (flat)           Gaussian process, kernel exp(-d^2 / 2) over `error_distance`
                                              (NUGGET of its variance: no neighbour predicts it)

scaled by one unknown sigma. After each measured trial the posterior of r at every unrun candidate
gives a corrected prior (the posterior mean: the shared offset is learnt from the first measurement,
the smooth part from the neighbours) and its spread. sigma is the prior's error *in this study*:
the sum of squared errors the corrected prior made predicting each measured trial from the ones
measured before it (each divided by the spread it claimed: the Gaussian process' y' K^-1 y), pooled
with NU0 pseudo-measurements at the prior's known error (`KNOWN_ERROR`). So before the study has
shown anything the bound is as wide as the prior has been elsewhere, and it narrows or widens as
the study's own measurements agree with the prior or not. The bound of a candidate is

    prior x exp(posterior mean + t(QUANTILE, NU0 + n - 1) x sigma x posterior spread)

(Student's t, as sigma is itself estimated from n - 1 contrasts). The search stops when no unrun
candidate's bound beats the best measured by more than the tolerance; it picks the candidate with
the largest bound, the one that keeps it from stopping (so the first pick is the prior's best).
docs/search.md, "When the search stops", says why this design and what it measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Callable, Sequence

import numpy as np

from autotune.train_config import TrainConfig, searched_fields

_ORDERED = ("zero_stage", "micro_batch", "ckpt_layers", "grad_accum", "seq_len")

KNOWN_ERROR = {"cost model": 0.07, "cpu prior": 0.10, "given prior": 0.10}
"""The prior's error between candidates (sd of log(true / prior) once the shared offset is removed) before
a study has measured anything; pooled with the study's own error as NU0 says. Cost model: its
calibration points miss by -7.3% to +7.1% (docs/costmodel.md,
`python benchmarks/costmodel_accuracy.py`), and two of them (ZeRO-1 and -2 on the V100s) are 12% apart where it
puts them 2% apart: 0.07. CPU prior: its rank correlation with the recorded landscapes is 0.95-0.985 on
a quiet machine (autotune/cpu_prior.py), yet on a held-back live search it put the true best 10th with
the runner-up 13% slower (issue 29), and probed on a loaded machine (2026-12-03, load average 6 on 2
cores) the feasible groups' log residuals had sd 0.22-0.26 in two probings, most of it a trend in micro
batch that the study learns (`python benchmarks/search_efficiency.py --prior-error`): 0.10, and the
study's evidence decides. A prior given by the caller: 0.10."""
NU0 = 1.0
"""Pseudo-measurements the known error counts for, against the study's own. The known error is a
figure from other models and machines; from the second contrast on, the study's evidence outweighs
it. Early stops are guarded by Student's t instead: with 1 + (n - 1) degrees of freedom the 95%
quantile is 6.3 after one measurement, 2.9 after two, 2.4 after three. Chosen with the benchmark
(`python benchmarks/search_efficiency.py`): at 3, perturbed lora.yaml ran a median 10 trials and
the recorded CPU landscapes reached the best as at 1; at 1, 8."""
STAGE, SMOOTH, OTHER = 1.0, 1.0, 1.0
"""`error_distance`'s units: per ZeRO stage apart; per doubling of micro batch, accumulation or sequence
length and per quarter of the layers checkpointed; per other setting that differs. Residuals one
stage apart, one doubling of micro batch apart, or a different precision, optimizer or LoRA rank,
correlate exp(-1/2) = 0.61. Why: each stage runs other collectives, which the prior prices each its own way
(the cost model's ZeRO-1 and -2 points on the V100s miss by 12% against each other, docs/costmodel.md),
and micro batch and checkpointing change how busy the same kernels are. Not closer: with micro batch
correlated 0.94 per doubling, the held-out GPT-2 landscape (benchmarks/data/cpu_landscape_gpt2.csv)
stopped at 96% of its best, its best micro batches (4 and 8) interpolated from the measured 2 and 16.
Categorical settings at 1.5 (0.32) ran a median 10 trials on perturbed lora.yaml, at 1.0 8
(`python benchmarks/search_efficiency.py`). Judgements, checked on those landscapes."""
NUGGET = 0.05
"""The share of the residual's variance that is a candidate's own (no neighbour predicts it):
run-to-run noise and settings the distance does not see. A judgement: larger makes every near-tie
by the prior cost a trial, smaller lets a neighbour vouch for a candidate entirely."""
SHARED = 100.0
"""Variance of the shared offset, in units of sigma^2: a flat prior (any common factor between prior
and truth is possible; the first measurement fixes it and says nothing about the ranking)."""
QUANTILE = 0.95
"""One-sided: a candidate's bound is what it reaches with 5% odds at most."""


def error_distance(a: TrainConfig, b: TrainConfig, layers: int) -> float:
    """Squared distance between two candidates for how alike the prior misses them (STAGE, SMOOTH, OTHER)."""
    smooth = (math.log2(a.micro_batch / b.micro_batch) ** 2
              + (4 * (a.ckpt_layers - b.ckpt_layers) / max(layers, 1)) ** 2
              + math.log2(a.grad_accum / b.grad_accum) ** 2 + math.log2(a.seq_len / b.seq_len) ** 2)
    other = sum(getattr(a, f.name) != getattr(b, f.name) for f in searched_fields() if f.name not in _ORDERED)
    return (STAGE * (a.zero_stage - b.zero_stage)) ** 2 + SMOOTH ** 2 * smooth + OTHER ** 2 * other


def t_quantile(q: float, dof: float) -> float:
    """Student's t quantile, by the Cornish-Fisher expansion in 1/dof (Abramowitz & Stegun 26.7.5:
    within 0.5% for dof >= 2, exact at 1; numpy has no t distribution and scipy is not a dependency)."""
    if dof <= 1:
        return math.tan(math.pi * (q - 0.5))        # Cauchy: exact at 1
    z = NormalDist().inv_cdf(q)
    g1 = (z ** 3 + z) / 4
    g2 = (5 * z ** 5 + 16 * z ** 3 + 3 * z) / 96
    g3 = (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / 384
    g4 = (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / 92160
    return z + g1 / dof + g2 / dof ** 2 + g3 / dof ** 3 + g4 / dof ** 4


class ResidualModel:
    """The Gaussian process over log(measured / prior) described at the top of this module."""

    def __init__(self, dist2: Callable[[TrainConfig, TrainConfig], float], known_error: float,
                 nugget: float | None = None, nu0: float | None = None):
        self.dist2, self.known = dist2, known_error
        self.nugget = NUGGET if nugget is None else nugget
        self.nu0 = NU0 if nu0 is None else nu0
        self.xs: list[TrainConfig] = []
        self.ys: list[float] = []
        self._rows: dict[tuple, list[float]] = {}     # candidate key -> its kernel with xs[0], xs[1], ...
        self._fit: tuple[np.ndarray, np.ndarray, float] | None = None

    def observe(self, cfg: TrainConfig, residual: float) -> None:
        self.xs.append(cfg)
        self.ys.append(residual)
        self._fit = None

    def _row(self, cfg: TrainConfig) -> list[float]:
        # kept per candidate and extended by each new measurement: a search of hundreds of groups
        # otherwise recomputes every distance at every pick
        row = self._rows.setdefault(cfg.key(), [])
        for x in self.xs[len(row):]:
            row.append(SHARED + math.exp(-self.dist2(cfg, x) / 2))
        return row

    def fit(self) -> tuple[np.ndarray, np.ndarray, float]:
        """(K^-1, K^-1 y, sigma^2), K over the measured candidates in units of sigma^2."""
        if self._fit is None:
            n = len(self.xs)
            k = np.array([self._row(x) for x in self.xs]).reshape(n, n)
            kinv = np.linalg.inv(k + self.nugget * np.eye(n))
            y = np.array(self.ys)
            alpha = kinv @ y
            # y' K^-1 y: the squared, standardised errors of predicting each measurement from the earlier
            # ones (chain rule); n - 1 of them carry information (the first only fixes the shared offset)
            sigma2 = (self.nu0 * self.known ** 2 + float(y @ alpha)) / (self.nu0 + max(n - 1, 0))
            self._fit = (kinv, alpha, sigma2)
        return self._fit

    @property
    def sigma(self) -> float:
        return math.sqrt(self.fit()[2])

    @property
    def dof(self) -> float:
        return self.nu0 + max(len(self.xs) - 1, 0)

    def predict(self, cfgs: Sequence[TrainConfig]) -> tuple[np.ndarray, np.ndarray]:
        """Posterior means and standard deviations of the residual at `cfgs` (log units)."""
        kinv, alpha, sigma2 = self.fit()
        kc = np.array([self._row(c) for c in cfgs]).reshape(len(cfgs), len(self.xs))
        var = SHARED + 1 + self.nugget - np.einsum("ij,jk,ik->i", kc, kinv, kc)
        return kc @ alpha, np.sqrt(np.maximum(var, 0.0) * sigma2)


@dataclass(frozen=True)
class Verdict:
    """Where the stopping rule stands: the largest bound of an unrun candidate against the best measured."""

    stop: bool
    tolerance: float
    best_value: float
    best_trial: int | None
    largest: float
    """(largest bound / best measured) - 1; -1 when no candidate is left."""
    candidate: str
    """The candidate with the largest bound, `TrainConfig.short()`."""
    sigma: float
    """The prior's error used (sd of the log residual), the study's pooled with the known one."""
    known: float
    prior: str
    measured: int
    groups_run: int
    groups: int

    def line(self) -> str:
        """`no unrun candidate can beat trial 12 by more than 2% (largest bound +1.4%: z2 ...); 6 of 40 groups run`."""
        tol = f"{100 * self.tolerance:g}%"
        big = f"largest bound {100 * self.largest:+.1f}%: {self.candidate}" if self.candidate else "none left"
        head = (f"no unrun candidate can beat trial {self.best_trial} by more than {tol}" if self.stop else
                f"an unrun candidate may still beat trial {self.best_trial} by more than {tol}")
        return (f"{head} ({big}; the prior's error {100 * self.sigma:.1f}% after {self.measured} measured, "
                f"the {self.prior}'s known {100 * self.known:.0f}%); {self.groups_run} of {self.groups} groups run")

    def attrs(self) -> dict:
        return {"rule": "bound", "stop": self.stop, "tolerance": self.tolerance, "best_trial": self.best_trial,
                "best_value": self.best_value, "largest_bound": self.largest, "candidate": self.candidate,
                "sigma": self.sigma, "known_error": self.known, "prior": self.prior, "measured": self.measured,
                "groups_run": self.groups_run, "groups": self.groups, "line": self.line()}


class Bounded:
    """The search strategy (search.Search.strategy): picks the unrun candidate with the largest bound
    and says when none can beat the best measured by more than the tolerance."""

    def __init__(self, prior: Callable[[TrainConfig], float], dist2: Callable[[TrainConfig, TrainConfig], float],
                 known_error: float, prior_name: str):
        self._prior, self.prior_name = prior, prior_name
        self.model = ResidualModel(dist2, known_error)
        self._cache: dict[tuple, float] = {}

    def log_prior(self, cfg: TrainConfig) -> float:
        key = cfg.key()
        if key not in self._cache:     # the cost model prices a candidate once, not once per pick
            self._cache[key] = math.log(self._prior(cfg))
        return self._cache[key]

    def observe(self, cfg: TrainConfig, value: float) -> None:
        if value and value > 0:
            self.model.observe(cfg, math.log(value) - self.log_prior(cfg))

    def bounds(self, cfgs: Sequence[TrainConfig]) -> np.ndarray:
        """log of each candidate's bound (module docstring)."""
        mean, sd = self.model.predict(cfgs)
        prior = np.array([self.log_prior(c) for c in cfgs])
        return prior + mean + t_quantile(QUANTILE, self.model.dof) * sd

    def pick(self, cands: Sequence) -> object | None:
        """The candidate (search.Candidate) with the largest bound; ties go to the earlier of the space's order."""
        if not cands:
            return None
        return cands[int(np.argmax(self.bounds([c.cfg for c in cands])))]

    def verdict(self, cands: Sequence, best_value: float, best_trial: int | None, tolerance: float,
                groups_run: int) -> Verdict:
        """Whether no candidate of `cands` (search.Candidate) can beat `best_value` by more than `tolerance`."""
        bounds = self.bounds([c.cfg for c in cands])
        i = int(np.argmax(bounds)) if len(cands) else None
        largest = math.exp(bounds[i] - math.log(best_value)) - 1 if i is not None else -1.0
        return Verdict(stop=largest <= tolerance, tolerance=tolerance, best_value=best_value, best_trial=best_trial,
                       largest=largest, candidate=cands[i].cfg.short() if i is not None else "",
                       sigma=self.model.sigma, known=self.model.known, prior=self.prior_name,
                       measured=len(self.model.xs), groups_run=groups_run, groups=groups_run + len(cands))
