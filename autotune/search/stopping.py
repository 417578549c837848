"""When a search may stop: a bound on what every unrun candidate could still reach.

The prior misses a candidate by r = log(true / prior), and close candidates miss alike, so r is a Gaussian
process scaled by one unknown sigma: a shared offset, a factor per ZeRO stage, a part smooth over the other
settings, a trend and a bend (their weights the Prior's), and a part of the candidate's own; a reading misses r
by its own noise. sigma is the error the prior has shown in this study, pooled with Prior.nu0 pseudo-readings at
Prior.known_error. A candidate's bound is prior x exp(posterior mean + t(QUANTILE, dof) x sigma x posterior sd);
the search picks the largest and stops when none beats the best reading by more than the tolerance.
docs/search.md, "When the search stops", says why; docs/measurements/search.md how each weight was measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import numpy as np

from autotune.train_config import TrainConfig, searched_fields

if TYPE_CHECKING:
    from autotune.search.prior import Prior

_ORDERED = ("zero_stage", "micro_batch", "ckpt_layers", "grad_accum", "seq_len")

# sigma^2 split, the shared offset apart: per stage (the cost model's ZeRO-1 and -2 V100 points miss 12% apart,
# docs/costmodel.md), smooth over the other settings, a candidate's own (0.7% at 7%); checked with
# `python benchmarks/search_efficiency.py` (docs/measurements/search.md, "The residual model's shape")
W_STAGE, W_SMOOTH, NUGGET = 0.5, 0.49, 0.01
# one doubling apart correlates 0.96; 13B on 4 x A100 stops after 1 trial at 3.5, not at 3 (runner-up +2.02%):
# `python benchmarks/search_efficiency.py --landscape sim13b`
LENGTH = 3.5
# a 10% prior gap counts as one doubling, another setting as 0.2: LoRA ranks 0.4% apart share their error whole
PRIOR_GAP, OTHER_MIN = 0.1, 0.2
FLAT = 100.0  # the shared offset's variance that stands for "any level" (Prior.shared)
QUANTILE = 0.95  # one-sided: a candidate reaches its bound with 5% odds at most


def _ordered_coords(c: TrainConfig, layers: int) -> tuple[float, ...]:
    """Doublings of micro batch, accumulation and sequence length; quarters of the layers checkpointed."""
    return (math.log2(c.micro_batch), 4 * c.ckpt_layers / max(layers, 1), math.log2(c.grad_accum), math.log2(c.seq_len))


def error_distance(a: TrainConfig, b: TrainConfig, layers: int, prior_gap: float = 0.0) -> float:
    """Squared distance, in LENGTH units, between two candidates' smooth parts: the ordered coordinates,
    `prior_gap` (their log priors' difference) in PRIOR_GAP units, OTHER_MIN per other setting that differs.
    Euclidean plus a count, so exp(-d^2 / 2) is a Gaussian times a Hamming kernel, positive definite (a floor on
    the prior's gap was not: lora.yaml's exhaustive plan met a negative y' K^-1 y). The stage is error_kernel's."""
    ordered = sum((x - y) ** 2 for x, y in zip(_ordered_coords(a, layers), _ordered_coords(b, layers)))
    other = sum(getattr(a, f.name) != getattr(b, f.name) for f in searched_fields() if f.name not in _ORDERED)
    return (ordered + (prior_gap / PRIOR_GAP) ** 2 + OTHER_MIN**2 * other) / LENGTH**2


def error_kernel(
    a: TrainConfig,
    b: TrainConfig,
    layers: int,
    prior_gap: float = 0.0,
    trend: float = 0.0,
    curve: float = 0.0,
    center: Sequence[float] = (0.0, 0.0, 0.0, 0.0),
) -> float:
    """Covariance of two residuals in sigma^2, less the shared offset and the own part: stage factor, smooth part,
    trend and bend about `center` (linear kernels over the coordinates and their centred squares: PSD)."""
    xa, xb = _ordered_coords(a, layers), _ordered_coords(b, layers)
    slope = sum(x * y for x, y in zip(xa, xb)) if trend else 0.0
    bend = sum((x - c) ** 2 * (y - c) ** 2 for x, y, c in zip(xa, xb, center)) if curve else 0.0
    return (
        W_STAGE * (a.zero_stage == b.zero_stage)
        + W_SMOOTH * math.exp(-error_distance(a, b, layers, prior_gap) / 2)
        + trend * slope
        + curve * bend
    )


def ordered_center(cfgs: Sequence[TrainConfig], layers: int) -> tuple[float, ...]:
    """The middle of the range each ordered coordinate spans over `cfgs`: the bend's centre (Prior.curve)."""
    cols = list(zip(*(_ordered_coords(c, layers) for c in cfgs)))
    return tuple((min(col) + max(col)) / 2 for col in cols) if cols else (0.0, 0.0, 0.0, 0.0)


def t_quantile(q: float, dof: float) -> float:
    """Student's t quantile, by the Cornish-Fisher expansion in 1/dof (Abramowitz & Stegun 26.7.5:
    within 0.5% for dof >= 2, exact at 1; numpy has no t distribution and scipy is not a dependency)."""
    if dof <= 1:
        return math.tan(math.pi * (q - 0.5))  # Cauchy: exact at 1
    z = NormalDist().inv_cdf(q)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / dof + g2 / dof**2 + g3 / dof**3 + g4 / dof**4


class ResidualModel:
    """The Gaussian process over log(measured / prior) of the module docstring."""

    def __init__(
        self,
        kernel: Callable[[TrainConfig, TrainConfig], float],
        known_error: float,
        nugget: float | None = None,
        nu0: float = 1.0,
        shared: float = FLAT,
        noise: float = 0.0,
    ):
        self.kernel, self.known = kernel, known_error
        self.nugget = NUGGET if nugget is None else nugget
        self.noise = noise  # a reading's own noise (Prior.noise): in the fit, not in a prediction
        self.nu0, self.shared = nu0, shared
        self.flat = shared >= FLAT
        self.xs: list[TrainConfig] = []
        self.ys: list[float] = []
        self._rows: dict[tuple, list[float]] = {}  # candidate key -> its kernel with xs[0], xs[1], ...
        self._diag: dict[tuple, float] = {}  # candidate key -> its kernel with itself
        self._fit: tuple[np.ndarray, np.ndarray, float] | None = None

    def observe(self, cfg: TrainConfig, residual: float) -> None:
        self.xs.append(cfg)
        self.ys.append(residual)
        self._fit = None

    def _row(self, cfg: TrainConfig) -> list[float]:
        # kept per candidate and extended by each new measurement: a search of hundreds of groups
        # otherwise recomputes every distance at every pick
        row = self._rows.setdefault(cfg.key(), [])
        for x in self.xs[len(row) :]:
            row.append(self.shared + self.kernel(cfg, x))
        return row

    def fit(self) -> tuple[np.ndarray, np.ndarray, float]:
        """(K^-1, K^-1 y, sigma^2), K over the measured candidates in units of sigma^2."""
        if self._fit is None:
            n = len(self.xs)
            k = np.array([self._row(x) for x in self.xs]).reshape(n, n)
            kinv = np.linalg.inv(k + (self.nugget + self.noise) * np.eye(n))
            y = np.array(self.ys)
            alpha = kinv @ y
            # y' K^-1 y: the squared, standardised errors of predicting each measurement from the earlier
            # ones (chain rule); n - 1 of them carry information where the shared offset is flat (the first only
            # fixes it), all n where it has a prior of its own (Prior.shared)
            sigma2 = (self.nu0 * self.known**2 + max(float(y @ alpha), 0.0)) / (self.nu0 + max(n - self.flat, 0))
            self._fit = (kinv, alpha, sigma2)
        return self._fit

    @property
    def sigma(self) -> float:
        return math.sqrt(self.fit()[2])

    @property
    def dof(self) -> float:
        return self.nu0 + max(len(self.xs) - self.flat, 0)

    def predict(self, cfgs: Sequence[TrainConfig]) -> tuple[np.ndarray, np.ndarray]:
        """Posterior means and standard deviations of the residual at `cfgs` (log units)."""
        kinv, alpha, sigma2 = self.fit()
        kc = np.array([self._row(c) for c in cfgs]).reshape(len(cfgs), len(self.xs))
        for c in cfgs:
            if c.key() not in self._diag:
                self._diag[c.key()] = self.kernel(c, c)
        own = np.array([self._diag[c.key()] for c in cfgs])
        var = self.shared + own + self.nugget - np.einsum("ij,jk,ik->i", kc, kinv, kc)
        return kc @ alpha, np.sqrt(np.maximum(var, 0.0) * sigma2)


@dataclass(frozen=True)
class Verdict:
    """Where the stopping rule stands: the largest bound of an unrun candidate against the best measured."""

    stop: bool
    tolerance: float
    best_value: float
    best_trial: int | None
    largest: float  # (largest bound / best measured) - 1; -1 when no candidate is left
    candidate: str  # the candidate with the largest bound, `TrainConfig.short()`
    sigma: float  # the prior's error used: the study's pooled with the known one
    known: float
    prior: str
    measured: int
    groups_run: int
    groups: int

    def line(self) -> str:
        """`no unrun candidate can beat trial 12 by more than 2% (largest bound +1.4%: z2 ...); 6 of 40 groups run`."""
        tol = f"{100 * self.tolerance:g}%"
        big = f"largest bound {100 * self.largest:+.1f}%: {self.candidate}" if self.candidate else "none left"
        head = (
            f"no unrun candidate can beat trial {self.best_trial} by more than {tol}"
            if self.stop
            else f"an unrun candidate may still beat trial {self.best_trial} by more than {tol}"
        )
        return (
            f"{head} ({big}; the prior's error {100 * self.sigma:.1f}% after {self.measured} measured, "
            f"the {self.prior}'s known {100 * self.known:.0f}%); {self.groups_run} of {self.groups} groups run"
        )

    def attrs(self) -> dict:
        return {
            "rule": "bound",
            "stop": self.stop,
            "tolerance": self.tolerance,
            "best_trial": self.best_trial,
            "best_value": self.best_value,
            "largest_bound": self.largest,
            "candidate": self.candidate,
            "sigma": self.sigma,
            "known_error": self.known,
            "prior": self.prior,
            "measured": self.measured,
            "groups_run": self.groups_run,
            "groups": self.groups,
            "line": self.line(),
        }


class Strategy(Protocol):
    """What Search asks of its strategy, as Optuna of a sampler and a pruner: told every reading (in the search's
    objective), it picks the next candidate (search.Candidate) and says whether the search may stop."""

    def observe(self, cfg: TrainConfig, value: float) -> None: ...

    def pick(self, cands: Sequence) -> object | None: ...

    def verdict(
        self, cands: Sequence, best_value: float, best_trial: int | None, tolerance: float, groups_run: int
    ) -> Verdict: ...


class Bounded:
    """The default Strategy, built from a Prior (its error model): the largest bound next, stop when none beats the
    best by more than the tolerance. `candidates` centre the bend; without them there is none (a bend about an
    arbitrary centre would be a slope of any size)."""

    def __init__(self, prior: Prior, layers: int, candidates: Sequence[TrainConfig] = ()):
        self.prior = prior
        trend, curve = prior.trend, prior.curve if len(candidates) else 0.0
        center = ordered_center(candidates, layers) if curve else (0.0, 0.0, 0.0, 0.0)

        def kernel(a: TrainConfig, b: TrainConfig) -> float:
            return error_kernel(a, b, layers, self.log_prior(a) - self.log_prior(b), trend, curve, center)

        self.model = ResidualModel(kernel, prior.known_error, nu0=prior.nu0, shared=prior.shared, noise=prior.noise)
        self._cache: dict[tuple, float] = {}

    def log_prior(self, cfg: TrainConfig) -> float:
        key = cfg.key()
        if key not in self._cache:  # the cost model prices a candidate once, not once per pick
            self._cache[key] = math.log(self.prior(cfg))
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
        if not self.model.xs:
            return max(cands, key=lambda c: self.log_prior(c.cfg))
        return cands[int(np.argmax(self.bounds([c.cfg for c in cands])))]

    def verdict(
        self, cands: Sequence, best_value: float, best_trial: int | None, tolerance: float, groups_run: int
    ) -> Verdict:
        """Whether no candidate of `cands` (search.Candidate) can beat `best_value` by more than `tolerance`."""
        bounds = self.bounds([c.cfg for c in cands])
        i = int(np.argmax(bounds)) if len(cands) else None
        largest = math.exp(bounds[i] - math.log(best_value)) - 1 if i is not None else -1.0
        return Verdict(
            stop=largest <= tolerance,
            tolerance=tolerance,
            best_value=best_value,
            best_trial=best_trial,
            largest=largest,
            candidate=cands[i].cfg.short() if i is not None else "",
            sigma=self.model.sigma,
            known=self.model.known,
            prior=self.prior.name,
            measured=len(self.model.xs),
            groups_run=groups_run,
            groups=groups_run + len(cands),
        )
