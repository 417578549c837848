"""What `autotune search` does, as a library: `open_search(...)` resolves the inputs once, opens a new
study or resumes one (which must agree with what is given again), chooses and starts the executor,
and returns a `SearchSession` whose `run()` searches. The CLI parses, calls this and prints.

    with open_search(model="13b", gpus="4xA100") as s:
        summary = s.run(n_trials=20)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import optuna

from autotune import executors
from autotune.errors import SpecError
from autotune.hardware import Cluster, parse_gpus
from autotune.memory.correction import Correction
from autotune.models import ModelSpec, default_seq_len, resolve_model
from autotune.search import study as st
from autotune.search.loop import Search, Summary
from autotune.search.prior import default_prior
from autotune.search.space import SearchSpace, load_space, parse_space


@dataclass(frozen=True)
class Inputs:
    """Model, cluster, sequence length, global batch and space of one study."""

    model: ModelSpec
    cluster: Cluster
    seq_len: int
    global_batch: int | None
    space: SearchSpace


@dataclass
class SearchSession:
    """An open study with its executor; close it (or use `with`) to stop the executor."""

    study: optuna.Study
    inputs: Inputs
    executor: object
    how: str
    """Which executor and why, in one sentence."""
    search: Search
    correction: Correction
    dry_run: bool = False
    """A dry run (open_search(dry_run=True)): its study lives in memory only; `run` stops after one trial per slot
    unless n_trials says otherwise."""

    def run(self, *, n_trials: int | None = None, timeout_s: float | None = None, progress: bool = True) -> Summary:
        if self.dry_run and n_trials is None:
            n_trials = max(1, self.executor.slots())
        ended = False
        try:
            summary = self.search.run(n_trials=n_trials, timeout_s=timeout_s, progress=progress)
            ended = True
            return summary
        finally:
            self.study.set_user_attr("memory_correction", self.correction.summary())
            # What the report shows beyond each trial's attrs (autotune/report/), so that it reads the study and
            # recomputes nothing; one study attr: per ZeRO stage the memory-pruned candidate closest to fitting, with
            # its terms, and, when the search ended by itself (not on Ctrl-C), the best run's next micro batch.
            plan, closest = self.search.plan, {}
            for c in plan.by_key.values():
                if plan.closed.get(c.cfg.key()) == "pruned" and c.est.host_fits and not plan.fits(c):
                    z, total = str(c.cfg.zero_stage), int(self.correction(c.est, c.cfg))
                    if z not in closest or total < closest[z][0]:
                        closest[z] = (total, c)
            shown = dict(self.study.user_attrs.get("report") or {})
            shown["closest_pruned"] = {
                z: {"config": c.cfg.to_dict(), "total_bytes": t, "detail": st.jsonable(c.est.to_json())}
                for z, (t, c) in sorted(closest.items())
            }
            if ended and self.search.summary.best_trial is not None:
                import dataclasses

                from autotune.memory import estimate

                best = self.study.best_trial
                cfg = st.record_of(best).config
                nxt = shown["next_micro_batch"] = {"trial": best.number, "micro_batch": cfg.micro_batch + 1}
                try:
                    e = estimate(
                        self.inputs.model, self.inputs.cluster, dataclasses.replace(cfg, micro_batch=nxt["micro_batch"])
                    )
                    nxt.update(total_bytes=int(e.total_bytes), fits=bool(e.fits))
                except (SpecError, ValueError) as err:  # a config the settings refuse has no estimate
                    nxt["invalid"] = str(err)
            self.study.set_user_attr("report", shown)

    def close(self) -> None:
        self.executor.close()

    def __enter__(self) -> "SearchSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_positive(**values: int | None) -> None:
    for name, v in values.items():
        if v is not None and v < 1:
            raise SpecError(f"--{name.replace('_', '-')} must be at least 1, got {v}")


def _resumed_inputs(study: optuna.Study, given: dict) -> Inputs:
    """A resumed study's inputs; anything given again must be what the study was searched with."""
    model, cluster, a = st.specs_of(study)
    stored = {
        "--model": model.name,
        "--impl": model.implementation,
        "--gpus": a["gpus"],
        "--seq-len": a["seq_len"],
        "--global-batch": a["global_batch"],
        "--space": a["space_text"],
        "--objective": a.get("objective", "samples"),
    }
    for flag, v in given.items():
        if v is not None and v != stored[flag]:
            shown = "a different file" if flag == "--space" else repr(v)
            raise SpecError(
                f"--resume: study {study.study_name!r} was searched with {flag} "
                f"{stored[flag] if flag != '--space' else a['space_path']!r}, not {shown}; "
                f"drop {flag} or start another --study"
            )
    return Inputs(model, cluster, a["seq_len"], a["global_batch"], parse_space(a["space_text"], a["space_path"]))


def open_search(
    *,
    model: str | None = None,
    impl: str | None = None,
    model_factory: str | None = None,
    gpus: str | None = None,
    seq_len: int | None = None,
    global_batch: int | None = None,
    space: str | Path | None = None,
    study: str | None = None,
    storage: str | None = None,
    executor: str = "auto",
    resume: bool = False,
    ray_address: str | None = None,
    concurrent_trials: int = 1,
    objective: str | None = None,
    exhaustive: bool = False,
    tolerance: float = 0.02,
    dry_run: bool = False,
) -> SearchSession:
    """Open (or with `resume`, continue) a search; bad input raises SpecError before anything starts.
    `impl`: the model code (hf when not given); on resume, only an explicit one is checked.
    `exhaustive`: run every feasible group; else stop when no unrun candidate can beat the best by more
    than `tolerance` (a fraction; autotune/search/stopping.py). Neither is kept by the study: a resume chooses again.
    `dry_run`: the Ray executor places the trials and starts their ranks, which stop before the first CUDA call
    (autotune/executors/ray_executor.py); the study is kept in memory, never in the storage, and the rank plans go to
    trials/NAME/dry-run/, so a real study of that name, new or resumed, is not touched."""
    if dry_run and resume:
        raise SpecError(
            "--dry-run reads and writes no study: drop --resume (a dry run of the same model and GPUs shows "
            "the trials a search would start)"
        )
    _check_positive(seq_len=seq_len, global_batch=global_batch, concurrent_trials=concurrent_trials)
    spec = resolve_model(model, implementation=impl or "hf", factory=model_factory) if model else None
    cluster = parse_gpus(gpus) if gpus else None
    if resume:
        name = study or (st.default_name(spec, cluster) if spec and cluster else None)
        opened = st.load_study(name, storage)
        given = {
            "--model": spec and spec.name,
            "--impl": impl,
            "--gpus": gpus,
            "--seq-len": seq_len,
            "--global-batch": global_batch,
            "--space": space and load_space(space).text,
            "--objective": objective,
        }
        inputs = _resumed_inputs(opened, given)
        objective = opened.user_attrs[st.ATTR].get("objective", "samples")  # studies before --objective
        # a study keeps its executor: measured and simulated numbers do not mix
        executor = {"measured": "ray", "simulated": "simulated"}[opened.user_attrs[st.ATTR]["source"]]
    else:
        if spec is None or cluster is None:
            raise SpecError("--model and --gpus are needed to start a search (only --resume can omit them)")
        inputs = Inputs(spec, cluster, seq_len or default_seq_len(spec), global_batch, load_space(space))
        opened, name = None, study or st.default_name(spec, inputs.cluster)
    kind, how = executors.choose(executor, inputs.cluster, ray_address, dry_run)  # starts nothing, creates nothing
    if opened is None and not dry_run:
        st.assert_new(name, storage)  # before starting Ray: a taken name or a bad storage fails fast
    ex = executors.make(kind, inputs.cluster, ray_address, concurrent_trials, dry_run=dry_run)
    try:
        if getattr(ex, "cluster", inputs.cluster) != inputs.cluster:  # the capacity the cluster's devices report
            inputs = dataclasses.replace(inputs, cluster=ex.cluster)
        if dry_run:
            st.check_name(name)
            opened = optuna.create_study(
                study_name=name, storage=optuna.storages.InMemoryStorage(), direction="maximize"
            )
            opened.set_user_attr(
                st.ATTR,
                st.study_attrs(
                    inputs.model,
                    inputs.cluster,
                    seq_len=inputs.seq_len,
                    global_batch=inputs.global_batch,
                    space_text=inputs.space.text,
                    space_path=inputs.space.path,
                    source=ex.source,
                    objective=objective or "samples",
                ),
            )
        if opened is None:
            attrs = st.study_attrs(
                inputs.model,
                inputs.cluster,
                seq_len=inputs.seq_len,
                global_batch=inputs.global_batch,
                space_text=inputs.space.text,
                space_path=inputs.space.path,
                source=ex.source,
                objective=objective or "samples",
            )
            opened = st.create_study(name, storage, attrs, sampler=None)
        correction = Correction()  # replayed from a resumed study's trials by Search
        prior = default_prior(inputs.model, inputs.cluster)  # the cost model on GPUs, the CPU prior on CPU ranks
        search = Search(
            opened,
            inputs.model,
            inputs.cluster,
            inputs.space,
            ex,
            seq_len=inputs.seq_len,
            global_batch=inputs.global_batch,
            corrector=correction,
            prior=prior,
            objective=objective or "samples",
            exhaustive=exhaustive,
            tolerance=tolerance,
            out_root=st.study_dir(name) / "dry-run" if dry_run else None,
        )
    except BaseException:
        ex.close()
        raise
    return SearchSession(opened, inputs, ex, how, search, correction, dry_run)
