"""The search: Optuna ask/tell over a small discrete space, with the memory model deciding first.

    expand the space -> estimate every candidate -> prune what cannot fit (PRUNED, no trial cost)
    -> per group of equal settings keep only the first member that fits (order.py: larger k only add
    recomputation) -> pick the most promising candidate -> executor -> tell.

Why not a stock Optuna sampler: after memory pruning and dominance only one point per group is worth running,
a few dozen of a mixed, discrete space. TPE and GP need ~10 random start-up trials before they model anything
and re-propose seen points in tiny categorical spaces; grid and random ignore structure. What is known before
any run is structural (recomputation costs a forward per layer, larger micro batches amortise, higher stages
move more bytes), so the choice is deterministic: rank the feasible frontier by a prior (prior.py) and, after
each reading, pick the candidate whose bound on what it could still reach is largest, until none beats the
best by more than the tolerance (stopping.py). The prior and the strategy are passed in as Optuna takes a
sampler and a pruner. A pick is written to the study as a RUNNING trial with its params (`study.start_trial`)
and told its result: an ordinary trial.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import optuna
from optuna.trial import TrialState

from autotune import interrupts
from autotune.errors import SpecError
from autotune.executors.base import Executor
from autotune.hardware import Cluster
from autotune.models import ModelSpec
from autotune.search import study as st
from autotune.search.order import MEMORY_FOR_SPEED, memory_diff, same_but_k, speed_order
from autotune.search.prior import Prior, default_prior
from autotune.search.space import SearchSpace, expand
from autotune.search.stopping import Bounded, Strategy
from autotune.train_config import TrainConfig
from autotune.trial.record import RUN, ScriptSpec, TrialRequest, TrialResult
from autotune.units import fmt_bytes

OBJECTIVES = {"samples": "samples_per_s", "tokens": "tokens_per_s"}
"""What a search maximises (`--objective`): samples/s, or tokens/s, which differ once seq_len varies."""


class Corrector(Protocol):
    """Online correction of the memory model (issue 5): adjusted per-device bytes for a candidate.
    May also have `observe(est, cfg, result)`, called with every measured result."""

    def __call__(self, est: Any, cfg: TrainConfig) -> int: ...


@dataclass
class Candidate:
    cfg: TrainConfig
    est: Any
    """MemoryEstimate (autotune.memory.estimate)."""

    @property
    def group(self) -> tuple:
        # a key, not a TrainConfig: the defaults may not be a valid config with the rest
        # (bf16 master weights with fp32 states need offload_optimizer)
        return tuple(sorted({**self.cfg.to_dict(), **MEMORY_FOR_SPEED}.items()))


# ---- structure: groups, dominance, implied out-of-memory --------------------------------------------
class Plan:
    """Which candidates are still worth a run. A group is all candidates that differ only in the
    MEMORY_FOR_SPEED settings (k, offload, overlap, buckets), tried in `order` (default: by k)."""

    def __init__(
        self, cands: list[Candidate], fits: Callable[[Candidate], bool], order: Callable[[Candidate], Any] | None = None
    ):
        self.fits = fits
        self.by_key = {c.cfg.key(): c for c in cands}
        self.groups: dict[tuple, list[Candidate]] = {}
        for c in cands:
            self.groups.setdefault(c.group, []).append(c)
        for g in self.groups.values():
            g.sort(key=order or (lambda c: c.cfg.ckpt_layers))
        self.closed: dict[tuple, str] = {}
        self.settled: set[tuple] = set()

    def head(self, g: tuple) -> Candidate | None:
        """The smallest k of the group that is neither decided nor known not to fit."""
        if g in self.settled:
            return None
        return next((c for c in self.groups[g] if c.cfg.key() not in self.closed and self.fits(c)), None)

    def available(self, busy: set[tuple]) -> list[Candidate]:
        heads = (self.head(g) for g in self.groups)
        return [c for c in heads if c is not None and c.cfg.key() not in busy]

    def unfit(self) -> list[Candidate]:
        return [c for c in self.by_key.values() if c.cfg.key() not in self.closed and not self.fits(c)]

    def close(self, cfg: TrainConfig, status: str, number: int | None = None) -> list[tuple[Candidate, dict]]:
        """Record a decided candidate; return the candidates this decides too, with why."""
        key = cfg.key()
        self.closed[key] = status
        cand = self.by_key.get(key)
        if cand is None or status not in RUN:
            return []
        if status == "oom":
            return self._implied_oom(cand, number)
        self.settled.add(cand.group)
        out = []
        group = self.groups[cand.group]
        after = group[group.index(cand) + 1 :]
        for c in after:
            if c.cfg.key() not in self.closed and self.fits(c):
                if c.cfg.ckpt_layers > cfg.ckpt_layers and same_but_k(c.cfg, cfg):
                    why = (
                        f"dominated: trial {number} ({status}) has the same settings with fewer checkpointed "
                        f"layers ({cfg.ckpt_layers} < {c.cfg.ckpt_layers}); more recomputation only costs time"
                    )
                else:
                    why = (
                        f"dominated: trial {number} ({status}) has the same settings but "
                        f"{memory_diff(cfg, c.cfg)}, tried first (search_order.speed_order)"
                    )
                out.append((c, {"pruned_by": "dominated", "reason": why}))
        for c, _ in out:
            self.closed[c.cfg.key()] = "pruned"
        return out

    def _implied_oom(self, cand: Candidate, number: int | None) -> list[tuple[Candidate, dict]]:
        out = []
        for c in self.by_key.values():
            o = c.cfg
            if (
                c.cfg.key() not in self.closed
                and o.micro_batch > cand.cfg.micro_batch
                and o.ckpt_layers <= cand.cfg.ckpt_layers
                and dataclasses.replace(o, micro_batch=1, ckpt_layers=0, grad_accum=1)
                == dataclasses.replace(cand.cfg, micro_batch=1, ckpt_layers=0, grad_accum=1)
            ):
                why = (
                    f"implied out of memory: trial {number} ran out of memory at micro batch "
                    f"{cand.cfg.micro_batch} with {cand.cfg.ckpt_layers} checkpointed layers; micro batch "
                    f"{o.micro_batch} with {o.ckpt_layers} needs more"
                )
                out.append((c, {"pruned_by": "oom-implied", "reason": why}))
        for c, _ in out:
            self.closed[c.cfg.key()] = "pruned"
        return out


# ---- the loop ----------------------------------------------------------------------------------------
@dataclass
class Summary:
    """Counts over the whole study (earlier runs included), and why this run stopped."""

    candidates: int = 0
    excluded: dict[str, int] = field(default_factory=dict)
    ok: int = 0
    failed: int = 0
    pruned: int = 0
    interrupted: int = 0
    best_value: float | None = None
    best_trial: int | None = None
    stop: str = ""
    source: str = "measured"
    bound: dict = field(default_factory=dict)
    """The stopping rule's last verdict (stopping.Verdict.attrs()); empty before a measured run."""

    @property
    def ran(self) -> int:
        return self.ok + self.failed


class Search:
    """One invocation of `autotune search` on an open study (new or resumed)."""

    def __init__(
        self,
        study: optuna.Study,
        model: ModelSpec,
        cluster: Cluster,
        space: SearchSpace,
        executor: Executor,
        *,
        seq_len: int,
        global_batch: int | None = None,
        corrector: Corrector | None = None,
        prior: Prior | Callable[[TrainConfig], float] | None = None,
        strategy: Strategy | None = None,
        estimate_fn: Callable | None = None,
        out_root: Path | None = None,
        objective: str = "samples",
        exhaustive: bool = False,
        tolerance: float = 0.02,
        script: ScriptSpec | None = None,
    ):
        """`prior`: what to rank by before any measurement (default_prior when None; a bare callable of samples/s is
        a caller's own, Prior.given). `strategy`: what picks and stops (stopping.Bounded over the prior when None;
        one passed in works in the objective's units)."""
        if estimate_fn is None:
            from autotune.memory import estimate
            from autotune.search.reads_memo import ReadsMemo

            # most candidates of a large space differ only in settings the memory model does not read at
            # their stage: full.yaml's 48,996 for 13B on 4 x A100 are 14,436 estimates (autotune/search/reads_memo.py)
            estimate_fn = ReadsMemo(estimate)
        self.study, self.model, self.cluster, self.space, self.executor = study, model, cluster, space, executor
        self.script = script  # the user's script each trial runs (autotune/trial/script.py); None: autotune's loop
        self.corrector = corrector
        exp = expand(space, model, cluster, seq_len=seq_len, global_batch=global_batch)
        self.dists = st.distributions(exp.candidates)
        self.plan = Plan(
            [Candidate(c, estimate_fn(model, cluster, c)) for c in exp.candidates], self._fits, speed_order(model)
        )
        if objective not in OBJECTIVES:
            raise SpecError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
        self.objective = objective
        if not 0 <= tolerance < 1:
            raise SpecError(f"tolerance must be at least 0 and below 1 (a fraction: 0.02 = 2%), got {tolerance}")
        self.exhaustive, self.tolerance = exhaustive, tolerance
        if prior is not None and not isinstance(prior, Prior):
            prior = Prior.given(prior)
        self.prior = default_prior(model, cluster) if prior is None else prior
        fitting = [c.cfg for c in self.plan.by_key.values() if self._fits(c)]
        self.prior.ahead(fitting)  # the CPU prior probes these shapes now
        ranked = self.prior if objective == "samples" else self.prior.in_tokens()
        self.strategy = Bounded(ranked, model.num_layers, fitting) if strategy is None else strategy
        self.sampler = st.ChosenSampler()
        study.sampler = self.sampler
        self.out_root = out_root or st.study_dir(study.study_name)
        self.in_flight: dict[str, tuple[optuna.Trial, Candidate]] = {}
        self.summary = Summary(candidates=len(exp.candidates), excluded=exp.excluded, source=executor.source)
        if study.user_attrs.get("stopping"):
            study.set_user_attr("stopping", {})  # an earlier invocation's verdict; this one decides anew
        self._replay()
        self._prune_unfit()

    def value(self, result: TrialResult) -> float | None:
        """The number told to Optuna: the result's samples/s or tokens/s (`objective`)."""
        return getattr(result, OBJECTIVES[self.objective])

    def _total_bytes(self, c: Candidate) -> int:
        return int(self.corrector(c.est, c.cfg)) if self.corrector else int(c.est.total_bytes)

    def _fits(self, c: Candidate) -> bool:
        if self.corrector is None:
            return c.est.fits
        return self._total_bytes(c) <= c.est.capacity_bytes and c.est.host_fits

    def _est_attrs(self, c: Candidate, detail: bool = False) -> dict[str, Any]:
        # One attr, not one per number: each user attr is a row written per trial, and hundreds of
        # pruned ones are written; the full estimate (phases, overhead) only for trials that run.
        e = {
            "total_bytes": self._total_bytes(c),
            "model_total_bytes": int(c.est.total_bytes),
            "tensor_bytes": int(c.est.tensor_peak_bytes),
            "capacity_bytes": int(c.est.capacity_bytes),
            "dominant_term": c.est.dominant_term,
            "phase": c.est.phase,
        }
        # What the report draws besides the estimate (autotune/report/pictures.py), priced here so that it reads the
        # study and recomputes nothing: a pruned candidate's simulated samples/s (one number a row; the frontier), a
        # simulated run's split of its step (the step-time picture). The cost model prices GPUs only; ReadsMemo
        # prices full.yaml's 13B x 4xA100 candidates in ~2.4 s (docs/measurements/report.md).
        if not self.cluster.gpu.is_cpu and (not detail or self.executor.source == "simulated"):
            if not hasattr(self, "_simulate"):
                from autotune.costmodel import simulate
                from autotune.search.reads_memo import ReadsMemo

                self._simulate = ReadsMemo(simulate)
            try:
                sim = self._simulate(self.model, self.cluster, c.cfg)
            except SpecError:  # a GPU without a datasheet peak for the precision: nothing to draw
                sim = None
            if sim is not None and detail:
                e["simulated_breakdown_s"] = {k: float(v) for k, v in sim.breakdown_s.items()}
            elif sim is not None:
                e["simulated_samples_per_s"] = float(sim.samples_per_s)
        return {"estimate": {**e, "detail": st.jsonable(c.est.to_json())} if detail else e}

    def _count(self, status: str, value: float | None = None, number: int | None = None) -> None:
        s = self.summary
        if status == "ok" and value is not None and (s.best_value is None or value > s.best_value):
            s.best_value, s.best_trial = value, number
        name = status if status in ("ok", "pruned", "interrupted") else "failed"
        setattr(s, name, getattr(s, name) + 1)

    def _observe(self, c: Candidate, result: TrialResult) -> None:
        if result.status == "ok":
            self.strategy.observe(c.cfg, self.value(result))
        if self.corrector is not None and hasattr(self.corrector, "observe"):
            self.corrector.observe(c.est, c.cfg, result)

    def _replay(self) -> None:
        """Rebuild the plan from a resumed study's trials: nothing decided is decided or run again."""
        recorded: set[tuple] = set()
        derived: list[tuple[Candidate, dict]] = []
        for r in st.records(self.study):
            if r.config is None:
                continue
            if r.state == TrialState.RUNNING:
                if st.owner_alive(r.owner):
                    raise SpecError(
                        f"study {self.study.study_name!r} is being searched right now by process "
                        f"{r.owner} (trial {r.number} running); stop it first"
                    )
                st.mark_interrupted(
                    self.study,
                    r.number,
                    f"the search process that ran it ({r.owner or 'unknown'}) "
                    "ended without recording it, killed; it runs again on --resume",
                )
            if r.status in ("running", "interrupted"):
                self._count("interrupted")
                continue
            cfg = r.config
            recorded.add(cfg.key())
            self._count(r.status, r.value, r.number)
            derived += self.plan.close(cfg, r.status, r.number)
            cand = self.plan.by_key.get(cfg.key())
            if cand is not None and r.status in RUN:
                self._observe(cand, r.result or TrialResult(status=r.status))
        self._record([(c, a) for c, a in derived if c.cfg.key() not in recorded])

    def _record(self, decided: list[tuple[Candidate, dict]]) -> None:
        """Store candidates decided without a run as PRUNED trials, in one batch."""
        if decided:
            st.add_finished(
                self.study, [st.pruned_record(c.cfg, self.dists, {**self._est_attrs(c), **a}) for c, a in decided]
            )
            for _ in decided:
                self._count("pruned")

    def _prune_unfit(self) -> None:
        out = []
        for c in self.plan.unfit():
            if not c.est.host_fits:
                why = (
                    f"host memory: estimated {fmt_bytes(c.est.host_bytes)} of host RAM per node (offloaded "
                    f"states) > {fmt_bytes(c.est.host_capacity_bytes)} the node has"
                )
                out.append((c, {"pruned_by": "host-memory", "reason": why}))
                self.plan.closed[c.cfg.key()] = "pruned"
                continue
            total, cap = self._total_bytes(c), c.est.capacity_bytes
            corrected = "" if total == int(c.est.total_bytes) else " (after online correction)"
            allowance = (
                f", with the framework allowance {fmt_bytes(c.est.overhead_bytes)}" if c.est.overhead_bytes else ""
            )
            dom = c.est.dominant_term
            why = (
                f"memory: estimated {fmt_bytes(total)} per device{corrected}{allowance} > capacity {fmt_bytes(cap)}; "
                f"largest term {dom} = {fmt_bytes(c.est.terms.get(dom, 0))}"
            )
            out.append((c, {"pruned_by": "memory", "reason": why}))
            self.plan.closed[c.cfg.key()] = "pruned"
        self._record(out)

    def _dispatch(self, c: Candidate) -> None:
        with interrupts.held():  # the trial's rows are written whole, whenever a signal lands
            trial = st.start_trial(
                self.study, c.cfg, self.dists, st.running_attrs(c.cfg, self._est_attrs(c, detail=True))
            )
            t = self.space.trial
            req = TrialRequest(
                model=self.model,
                cluster=self.cluster,
                config=c.cfg,
                out_dir=self.out_root / f"trial-{trial.number:04d}",
                steps=t.steps,
                warmup_steps=t.warmup_steps,
                timeout_s=t.timeout_s,
                trial_id=trial.number,
                script=self.script,
            )
            try:
                ticket = self.executor.submit(req)
            except BaseException as e:
                self._interrupted(trial, f"it could not start: {interrupts.why(e)}")
                raise
            self.in_flight[ticket] = (trial, c)

    def _finish(self, ticket: str, result: TrialResult) -> None:
        with interrupts.held():
            trial, c = self.in_flight.pop(ticket)
            if result.status == "ok" and not self.value(result):
                result = dataclasses.replace(
                    result, status="crashed", reason=f"no throughput reported; {result.reason}"
                )
            for k, v in st.result_attrs(result).items():
                trial.set_user_attr(k, v)
            if result.status == "ok":
                self.study.tell(trial, self.value(result))
            else:
                self.study.tell(trial, state=TrialState.PRUNED if result.status == "pruned" else TrialState.FAIL)
            self._count(result.status, self.value(result), trial.number)
            self._record(self.plan.close(c.cfg, result.status, trial.number))
            self._observe(c, result)

    def _interrupted(self, trial: optuna.Trial, why: str) -> None:
        """A trial the search could not finish: FAIL, status `interrupted` and why; --resume runs it again."""
        trial.set_user_attr("status", "interrupted")
        trial.set_user_attr("reason", f"{why}; it runs again on --resume")
        self.study.tell(trial, state=TrialState.FAIL)
        self._count("interrupted")

    def _abandon(self, exc: BaseException | None) -> None:
        """When the search ends with trials still running (Ctrl-C, SIGTERM, an error): each is recorded
        as interrupted, with what stopped it; the executor's close kills their ranks."""
        with interrupts.held():
            for trial, _ in self.in_flight.values():
                self._interrupted(
                    trial,
                    f"the search was stopped by {interrupts.why(exc)} while it ran"
                    if exc is not None
                    else "the search ended while it ran",
                )
            self.in_flight.clear()

    def _next(self, n_trials: int | None, deadline: float | None) -> Candidate | str:
        """The next candidate to run, or why none may start now."""
        if n_trials is not None and self.summary.ran + len(self.in_flight) >= n_trials:
            return "n-trials"
        if deadline is not None and time.monotonic() >= deadline:
            return "timeout"
        self._prune_unfit()
        busy = {c.cfg.key() for _, c in self.in_flight.values()}
        cands = self.plan.available(busy)
        if self._bound_says_stop(cands):
            return "bound"
        return self.strategy.pick(cands) or "exhausted"

    def _bound_says_stop(self, cands: list[Candidate]) -> bool:
        """The stopping rule (autotune/search/stopping.py), once a run has a value; its verdict is kept in the
        summary and, when it stops the search, in the study's user attr `stopping` (the report shows it)."""
        s = self.summary
        if s.best_value is None or not cands:
            return False
        v = self.strategy.verdict(cands, s.best_value, s.best_trial, self.tolerance, len(self.plan.settled))
        s.bound = v.attrs()
        if v.stop and not self.exhaustive:
            self.study.set_user_attr("stopping", s.bound)
            return True
        return False

    def run(self, *, n_trials: int | None = None, timeout_s: float | None = None, progress: bool = True) -> Summary:
        """Run until the frontier is exhausted or the budget ends. n_trials counts runs over the whole
        study (so a resumed search continues the same budget); timeout_s this invocation's time to
        start trials; as in Optuna's optimize(timeout=), running trials are let finish."""
        from tqdm import tqdm

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        bar = tqdm(
            total=n_trials,
            initial=self.summary.ran,
            unit="trial",
            file=sys.stderr,
            disable=not progress,
            desc="search" + (" (simulated)" if self.executor.source == "simulated" else ""),
        )
        self._progress(bar)
        stopped_by: BaseException | None = None
        try:
            while True:
                while len(self.in_flight) < max(1, self.executor.slots()):
                    nxt = self._next(n_trials, deadline)
                    if isinstance(nxt, str):
                        self.summary.stop = nxt
                        break
                    self._dispatch(nxt)
                if not self.in_flight:
                    break
                for ticket, result in self.executor.wait_any():
                    self._finish(ticket, result)
                    bar.update(1)
                    self._progress(bar)
        except BaseException as e:
            stopped_by = e
            raise
        finally:
            self._abandon(stopped_by)
            bar.close()
        return self.summary

    def _progress(self, bar) -> None:
        s = self.summary
        best = "-" if s.best_value is None else f"{s.best_value:.3g}"
        sim = " simulated" if self.executor.source == "simulated" else ""
        bar.set_postfix_str(f"done {s.ok}, pruned {s.pruned}, failed {s.failed}, best {best} {self.objective}/s{sim}")
