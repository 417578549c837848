"""The search's prior: what it expects of a candidate before measuring it, and how far that has been off.
`default_prior` is the one place that chooses it for a cluster. Each error constant's source is on its line;
how it was measured: docs/measurements/search.md, "The priors' error".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from typing import Callable, Sequence

from autotune.errors import SpecError
from autotune.hardware import Cluster
from autotune.models import ModelSpec
from autotune.search.stopping import FLAT
from autotune.train_config import TrainConfig


def _nothing(configs: Sequence[TrainConfig]) -> None:
    return None


@dataclass(frozen=True)
class Prior:
    """A prior and its error model, passed to Search as Optuna takes a sampler. `samples(cfg)`: expected samples/s,
    > 0 and the same for a config throughout a search; `ahead(configs)`: told the candidates that fit before the
    first pick (the CPU prior probes their shapes then). r = log(true / prior) in stopping.py's terms: sd
    `known_error` before any reading, counted as `nu0` readings; in sigma^2, the shared offset's variance
    (`shared`; FLAT: any level), a trend's per doubling, a bend's per doubling squared, a reading's noise."""

    name: str  # in the stopping line: "the cost model's known 7%"
    samples: Callable[[TrainConfig], float]
    known_error: float
    nu0: float
    shared: float = FLAT
    trend: float = 0.0
    curve: float = 0.0
    noise: float = 0.0
    ahead: Callable[[Sequence[TrainConfig]], None] = _nothing

    def __call__(self, cfg: TrainConfig) -> float:
        return self.samples(cfg)

    def in_tokens(self) -> Prior:
        """The same prior in tokens/s (`--objective tokens`): a sequence is seq_len tokens."""
        samples = self.samples
        return dataclasses.replace(self, samples=lambda cfg: samples(cfg) * cfg.seq_len)

    @classmethod
    def cost_model(cls, samples: Callable[[TrainConfig], float]) -> Prior:
        """The cost model's error, on GPUs; `samples`: `simulated(model, cluster)` or a table of its figures. Its
        level is free (datasheet peaks a GPU may miss whole); no trend, bend or noise until GPU readings show one
        (simulated trials have no noise; GPU repeats move 1-2%, docs/platform.md)."""
        return cls(
            "cost model",
            samples,
            known_error=0.07,  # calibration misses -7.3% to +7.1%: `python benchmarks/costmodel_accuracy.py`
            nu0=6.0,  # seven calibration points, six contrasts once their offset is removed (docs/costmodel.md)
        )

    @classmethod
    def cpu(cls, samples: Callable[[TrainConfig], float], ahead: Callable | None = None) -> Prior:
        """The CPU prior's error (cpu_prior.py), from the recorded CPU landscapes (benchmarks/data/)."""
        return cls(
            "cpu prior",
            samples,
            known_error=0.10,  # log residual sd 0.22-0.26 loaded, mostly a slope: `search_efficiency.py --prior-error`
            nu0=1.0,  # its error moves with the machine's load: the study's own outweighs it from the 2nd reading
            shared=4.0,  # measured / prior at its best 0.83-1.11 over the Llama and GPT-2 landscapes: sd 2 sigma
            trend=0.2,  # a slope in micro batch, another per landscape: `search_efficiency.py --replay-priors 6`
            curve=0.1,  # NeoX's mb 8 beat 4 and 16 by 14%; 0.05-0.2 alike: `--replay-priors 8 --noise 0.06`
            noise=0.25,  # a repeat on 2 CPU ranks here moves ~6%, half the prior's error: 0.5^2
            ahead=ahead or _nothing,
        )

    @classmethod
    def given(cls, samples: Callable[[TrainConfig], float]) -> Prior:
        """A caller's own prior: nothing is known of its error, so 10% counted once, and its level free."""
        return cls("given prior", samples, known_error=0.10, nu0=1.0)


def simulated(model: ModelSpec, cluster: Cluster) -> Callable[[TrainConfig], float]:
    """The cost model's samples/s. A GPU it cannot price for a precision (no datasheet peak) gets 1.0 for
    every candidate there: no preference, the space's order."""
    from autotune.costmodel import simulate

    @cache  # the search asks a candidate's prior again at every pick
    def prior(cfg: TrainConfig) -> float:
        try:
            return simulate(model, cluster, cfg).samples_per_s
        except SpecError:
            return 1.0

    return prior


def default_prior(model: ModelSpec, cluster: Cluster, configs: Sequence[TrainConfig] = ()) -> Prior:
    """The prior for a cluster: on CPU ranks the model's own step timed here (cpu_prior.py), on GPUs the cost
    model. Never the CPU probe for a GPU: it would build the model in host memory, and a host is no stand-in
    for the GPU's speed. `configs`: those it will rank, told to it now (`Prior.ahead`)."""
    if cluster.gpu.is_cpu:
        from autotune.search.cpu_prior import CpuPrior

        timed = CpuPrior(model, cluster)
        prior = Prior.cpu(timed, ahead=timed.probe)
    else:
        prior = Prior.cost_model(simulated(model, cluster))
    if configs:
        prior.ahead(configs)
    return prior
