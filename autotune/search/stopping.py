"""When a search may stop: a bound on what every unrun candidate could still reach.

The prior (the cost model on GPUs, the CPU prior on CPU ranks) is wrong by some factor at every
candidate. Call r(c) = log(true / prior) its residual. The residuals of two candidates are not
independent: the same code on the same machine misses by much the same factor, and close settings
(one doubling of micro batch, LoRA ranks the prior prices alike) miss alike. So r is modelled as

    r(c) = shared offset + stage factor + smooth part + trend + bend + a part of its own
           (SHARED)        (W_STAGE,      (W_SMOOTH, kernel    (TREND:  (CURVE:  (NUGGET: no neighbour
                            one per ZeRO   exp(-d^2 / 2) over   a slope  a curve  predicts it)
                            stage)         `error_distance`,    in the   over the
                                           all stages alike)    settings) settings)

scaled by one unknown sigma, and a measurement misses r(c) by the trial's own noise (NOISE: on CPU ranks
of a shared machine, a repeat of the same trial moves by several percent). After each measured trial
the posterior of r at every unrun candidate gives a corrected prior (the posterior mean: the shared offset is learnt from the first measurement,
the smooth part from the neighbours) and its spread. sigma is the prior's error *in this study*:
the sum of squared errors the corrected prior made predicting each measured trial from the ones
measured before it (each divided by the spread it claimed: the Gaussian process' y' K^-1 y), pooled
with NU0 pseudo-measurements at the prior's known error (`KNOWN_ERROR`). So before the study has
shown anything the bound is as wide as the prior has been elsewhere, and it narrows or widens as
the study's own measurements agree with the prior or not. The bound of a candidate is

    prior x exp(posterior mean + t(QUANTILE, NU0 + n - 1) x sigma x posterior spread)

(Student's t, as sigma is itself estimated from n - 1 contrasts; n where the prior's level is itself a
prediction, as the CPU prior's: SHARED). The search stops when no unrun candidate's bound beats the best
measured by more than the tolerance; it picks the candidate with the largest bound, the one that keeps it
from stopping; the first pick, before any measurement, is the prior's best.
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
a quiet machine (autotune/search/cpu_prior.py), yet on a held-back live search it put the true best 10th with
the runner-up 13% slower (issue 29), and probed on a loaded machine (2026-12-03, load average 6 on 2
cores) the feasible groups' log residuals had sd 0.22-0.26 in two probings, most of it a trend in micro
batch that the study learns (`python benchmarks/search_efficiency.py --prior-error`): 0.10, and the
study's evidence decides. A prior given by the caller: 0.10."""
NU0 = {"cost model": 6.0, "cpu prior": 1.0, "given prior": 1.0}
"""Pseudo-measurements the known error counts for, against the study's own. The cost model's 7% is the
spread of its seven calibration numbers (docs/costmodel.md, "Calibration"): six contrasts once their
common offset is removed, so it counts as 6, and Student's t after the first measurement is 1.94, not
6.3. It is the spread between setups (other models, GPUs, frameworks), so inside one study it is an
upper bound. The CPU prior's figure moves with the shared machine's load (0.22-0.26 measured in two
probings of one day, KNOWN_ERROR), so it counts as 1: from the second measurement on the study's own
evidence outweighs it, and t is 2.9 after one measurement, 2.4 after two, 2.1 after three (its first
measurement counts too: SHARED); a given prior's 6.3 after one, 2.9 after two."""
W_STAGE, W_SMOOTH, NUGGET = 0.5, 0.49, 0.01
"""How the residual's variance (sigma^2, apart from the shared offset) splits:
- W_STAGE, a factor of each ZeRO stage's own, independent between stages: each stage runs other
  collectives and other DeepSpeed code, which the prior prices each its own way (the cost model's
  ZeRO-1 and -2 points on the V100s miss by 12% against each other, docs/costmodel.md);
- W_SMOOTH, a part that varies smoothly with micro batch, accumulation, sequence length, checkpointed
  layers and the other settings, shared by all stages (how busy the same kernels are, how much is
  recomputed: the CPU prior's error on the recorded landscapes is mostly such a trend in micro batch);
- NUGGET, a candidate's own (run-to-run noise, settings the distance does not see): an sd of
  sqrt(0.01) x 7% = 0.7% on GPUs; larger makes every near-tie by the prior cost a trial.
Judgements from where the priors' errors come from, checked with `python benchmarks/search_efficiency.py`
(docs/search.md, "When the search stops")."""
LENGTH = 3.5
"""The smooth part's length scale: residuals one doubling of micro batch (or a quarter of the layers
checkpointed) apart correlate exp(-1 / (2 x 3.5^2)) = 0.96 in that part, four doublings apart 0.52: a trend
over the space more than a wiggle per doubling. The cost model prices 13B on 4 x A100's runner-up (micro batch 2
with 15 checkpointed layers) 3.8% below micro batch 1 in the same stage; that candidate's bound after one trial is
+8.8% at a length of 1 (0.61 per doubling), +2.02% at 3 (the tolerance is 2%: a second trial), +1.3% at 3.5 (it
stops). The rule before 2026-12-04 put it at +71% and ran 3 of the 4 groups."""
PRIOR_GAP, OTHER_MIN = 0.1, 0.2
"""Candidates are also as far apart as the prior prices them apart: a 10% gap in the prior counts as a
doubling of micro batch. Settings other than the ordered ones (precision, method, LoRA rank and targets,
optimizer, bf16 states, ...) add 0.2 of a doubling each (a setting the prior does not price still differs a
little). So LoRA ranks 8 and 64, 0.4% apart by the cost model, share their error nearly whole (the error of a
priced difference is of the order of the difference), and LoRA against full training, 30% apart, shares
69% of the smooth part (most of their GEMMs are the same)."""
TREND = {"cost model": 0.0, "cpu prior": 0.2, "given prior": 0.0}
"""Weight of a linear trend of the residual, in sigma^2 per doubling of micro batch (of accumulation, of sequence
length; per quarter of the layers checkpointed), shared by all stages: a slope the study must measure, where the
smooth part at LENGTH lets one micro batch's miss stand for its neighbours'. The CPU prior's error on the three
recorded CPU landscapes is mostly such a slope, a different one on each: over micro batch 1 to 16 at ZeRO-0,
log(measured / prior) rises 0.47 on the Llama one and 0.35 on the GPT-2 one; on the Granite one it is flat to
micro batch 8 and falls 0.5 from 8 to 16 (its two ranks at 16 run at 0.52 of the prior's speed, at 8 at 0.85;
the probe, alone or as two processes at once, sees no such fall: it is in the trial, not in the model's
arithmetic). Replayed on the three landscapes with six CPU priors probed for each, the same six for every
weight (2026-12-05), SHARED as below:
  - 0: the Granite one reached within 2% of the best in 1 of 6 (3 trials, all at micro batch 16, then it
    stopped 35% below); Llama 5 trials, GPT-2 5.
  - 0.2: Granite 6 of 6 at 6 trials (it measures a second micro batch); Llama 5, GPT-2 4, every run reached.
  - 0.15 and 0.3: the same, but Granite at 7 with 0.3.
  - The rule before (flat offset, no trend): Granite 0 of 6 (2 trials), Llama 5, GPT-2 5-6.
`python benchmarks/search_efficiency.py --replay-priors 6` prints these (`--cpu-trend W --cpu-shared S` for the
other rows; the rule before is `--cpu-trend 0 --cpu-shared 100`). A live search of
a held-out Phi-3 config (40 groups) stopped after 5 and 8 (docs/search.md). The cost model's and a given
prior's: 0 until GPU measurements show a slope; the perturbed landscapes' slope (up to +-15%) is within what
the smooth part allows there (docs/search.md)."""
FLAT = 100.0
SHARED = {"cost model": FLAT, "cpu prior": 4.0, "given prior": FLAT}
"""Variance of the shared offset, in units of sigma^2. FLAT is flat (any common factor between prior and truth is
possible; the first measurement fixes it and says nothing about the ranking): the cost model's level rests on
datasheet peaks and efficiencies a GPU may miss whole. The CPU prior times the model on this machine, so its
level is itself a prediction: measured/prior at its best candidate was 0.83-1.01 on the Llama landscape and
1.06-1.11 on the GPT-2 one in six probings each (2026-12-05), a median 0.85-0.88 over both landscapes
(autotune/search/cpu_prior.py): an offset of sd 2 sigma (0.2 at the known 10%). The Granite landscape's best-priced
candidate ran at 0.52 of its prior: a first measurement that far off widens the error the study has shown, and
counts as one more contrast (the offset is no longer fixed by it alone)."""
CURVE = {"cost model": 0.0, "cpu prior": 0.1, "given prior": 0.0}
"""Weight of a bend of the residual, in sigma^2 per doubling squared (a quadratic in each ordered setting, centred on
the middle of the range the space's candidates span), shared by all stages: the CPU prior's miss is not only a slope.
On the recorded NeoX landscape (cpu-neox) ZeRO-0 ran 66 samples/s at micro batch 4, 76 at 8 and 65 at 16, where every
probed CPU prior put 16 first; on the Granite one micro batch 8 ran 45% faster than 16. A slope measured at 4 and 16
then vouches for 8, and the search stopped 12-35% below the best. With a bend the micro batch between two measured
ones keeps a spread of sqrt(CURVE) sigma (0.32 sigma) until it is measured itself. Replayed with eight probed CPU
priors per landscape (`python benchmarks/search_efficiency.py --replay-priors 8 --noise 0.06`, 2026-12-06): 0.05 to
0.2 reach alike; 0.1 is the middle. The cost model's: 0 until GPU measurements show a bend."""
NOISE = {"cost model": 0.0, "cpu prior": 0.25, "given prior": 0.0}
"""Variance of a measurement's own noise, in sigma^2 (0.25: an sd of half the prior's error, 5-6% at the CPU prior's
10-12%): it widens what the study learns from one trial (K + NOISE in the fit), not the bound of an unrun candidate
(its true speed, not one noisy reading of it). On 2 CPU ranks of this shared machine the same configuration,
measured in three searches of one hour, ran 65.4, 68.4 and 63.7 samples/s (NeoX, ZeRO-0, micro batch 16), 59.4, 62.6
and 68.9 (ZeRO-1), 55.4 and 64.8 (ZeRO-2): an sd of about 6%, as large as the gaps between the stages the rule
otherwise took from one reading each. The cost model's simulated trials have none; real GPU trials repeat within 1-2%
(docs/platform.md), within NUGGET."""
QUANTILE = 0.95
"""One-sided: a candidate's bound is what it reaches with 5% odds at most."""


def _ordered_coords(c: TrainConfig, layers: int) -> tuple[float, ...]:
    """The ordered settings as the smooth part and the trend count them: doublings of micro batch, accumulation
    and sequence length, quarters of the layers checkpointed."""
    return (math.log2(c.micro_batch), 4 * c.ckpt_layers / max(layers, 1), math.log2(c.grad_accum), math.log2(c.seq_len))


def error_distance(a: TrainConfig, b: TrainConfig, layers: int, prior_gap: float = 0.0) -> float:
    """Squared distance, in LENGTH units, between two candidates' smooth parts: doublings of micro batch,
    accumulation and sequence length, quarters of the layers checkpointed, `prior_gap` (the difference of
    their log priors) in PRIOR_GAP units, and OTHER_MIN for each other setting that differs. A Euclidean
    distance over those coordinates plus a count of differing settings, so that exp(-d^2 / 2) is a product
    of a Gaussian and a Hamming kernel, both positive definite (a floor or a condition on the prior's gap
    would not be: the exhaustive plan of lora.yaml met a negative y' K^-1 y). The ZeRO stage is not in it:
    it is a factor of its own (error_kernel)."""
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
    """Covariance of two candidates' residuals in sigma^2 units, less the shared offset and the own part:
    the stage factor where they share a stage, the smooth part, a linear trend of weight `trend` and a bend of
    weight `curve` about `center` (W_STAGE, W_SMOOTH, TREND, CURVE: linear kernels over the coordinates and their
    centred squares, positive semi-definite; where the trend starts does not matter, as the shared offset takes any
    constant)."""
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
    """The middle of the range each ordered coordinate spans over `cfgs` (the bend's centre, CURVE)."""
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
    """The Gaussian process over log(measured / prior) described at the top of this module."""

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
        self.noise = noise  # a measurement's own noise (NOISE): in the fit, not in a prediction
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
            # fixes it), all n where it has a prior of its own (SHARED)
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


class Bounded:
    """The search strategy (search.Search.strategy): picks the unrun candidate with the largest bound
    and says when none can beat the best measured by more than the tolerance."""

    def __init__(
        self,
        prior: Callable[[TrainConfig], float],
        layers: int,
        prior_name: str,
        candidates: Sequence[TrainConfig] = (),
    ):
        """`candidates`: the configurations the search may run; the bend (CURVE) is centred on their range, and
        without them there is none (a bend about an arbitrary centre would be a slope of any size)."""
        self._prior, self.prior_name = prior, prior_name
        trend, curve = TREND[prior_name], CURVE[prior_name] if len(candidates) else 0.0
        center = ordered_center(candidates, layers) if curve else (0.0, 0.0, 0.0, 0.0)

        def kernel(a: TrainConfig, b: TrainConfig) -> float:
            return error_kernel(a, b, layers, self.log_prior(a) - self.log_prior(b), trend, curve, center)

        self.model = ResidualModel(
            kernel, KNOWN_ERROR[prior_name], nu0=NU0[prior_name], shared=SHARED[prior_name], noise=NOISE[prior_name]
        )
        self._cache: dict[tuple, float] = {}

    def log_prior(self, cfg: TrainConfig) -> float:
        key = cfg.key()
        if key not in self._cache:  # the cost model prices a candidate once, not once per pick
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
            prior=self.prior_name,
            measured=len(self.model.xs),
            groups_run=groups_run,
            groups=groups_run + len(cands),
        )
