"""What `autotune search` does, as a library: `open_search(...)` resolves the inputs once, opens a new
study or continues one (which must agree with what is given again, and keeps its own settings), chooses and
starts the executor, and returns a `SearchSession` whose `run()` searches. The CLI parses, calls this and prints.

    with open_search(model="13b", gpus="4xA100") as s:
        summary = s.run(n_trials=20)
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
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
from autotune.trial.record import ScriptSpec
from autotune.units import fmt_bytes


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
    settings: st.Settings = field(default_factory=st.Settings)
    """How it searches: the study's settings, with those given replacing them (open_search)."""
    notes: list[str] = field(default_factory=list)
    """Lines to show before it runs: a study continued, and with which settings (open_search)."""
    dry_run: bool = False
    """A dry run (open_search(dry_run=True)): its study lives in memory only; `run` stops after one trial per slot
    unless n_trials says otherwise."""

    def run(self, *, n_trials: int | None = None, timeout_s: float | None = None, progress: bool = True) -> Summary:
        """Search until the stopping rule (or every feasible group, exhaustive), the study's n_trials (`n_trials`
        replaces it, and the study keeps the new one) or `timeout_s` of this call ends it."""
        if n_trials is not None and n_trials != self.settings.n_trials:
            _check_positive(n_trials=n_trials)
            self.settings = dataclasses.replace(self.settings, n_trials=n_trials)
            st.store_settings(self.study, self.settings)
        limit = self.settings.n_trials
        if self.dry_run and limit is None:
            limit = max(1, self.executor.slots())
        ended = False
        try:
            summary = self.search.run(n_trials=limit, timeout_s=timeout_s, progress=progress)
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


_SOURCE_KIND = {"measured": "ray", "simulated": "simulated"}
"""A study's results (its ATTR's source) -> the executor that makes them: a study keeps its executor, as measured
and simulated numbers do not mix."""


def _as_stored(model: ModelSpec) -> dict:
    """A ModelSpec as a study stores it (JSON: tuples become lists), to compare with the stored one."""
    return json.loads(json.dumps(dataclasses.asdict(model), default=str))


def _conflicts(
    study: optuna.Study, inputs: Inputs, objective: str, source: str, script: ScriptSpec | None = None
) -> list[str]:
    """What a new search of `inputs` would do differently from existing `study`, one phrase per input."""
    a = study.user_attrs[st.ATTR]
    stored = ModelSpec(**a["model"])
    out = []
    if inputs.model.name != stored.name:
        out.append(f"--model {inputs.model.name} (the study: {stored.name})")
    elif inputs.model.implementation != stored.implementation:
        out.append(f"--impl {inputs.model.implementation} (the study: {stored.implementation})")
    elif _as_stored(inputs.model) != a["model"]:
        out.append(f"--model {inputs.model.name}: its config is not the one the study was searched with")
    if inputs.cluster.text != a["gpus"]:
        out.append(f"--gpus {inputs.cluster.text} (the study: {a['gpus']})")
    elif inputs.cluster.capacity_bytes != a["capacity_bytes"]:
        out.append(
            f"--gpus {inputs.cluster.text}: {fmt_bytes(inputs.cluster.capacity_bytes)} per device now, "
            f"{fmt_bytes(a['capacity_bytes'])} when the study was searched"
        )
    if inputs.seq_len != a["seq_len"]:
        out.append(f"--seq-len {inputs.seq_len} (the study: {a['seq_len']})")
    if inputs.global_batch != a["global_batch"]:
        out.append(f"--global-batch {inputs.global_batch or 'none'} (the study: {a['global_batch'] or 'none'})")
    if inputs.space.text != a["space_text"]:
        out.append(f"--space {inputs.space.path} (the study: {a['space_path']}, another text)")
    if objective != a.get("objective", "samples"):
        out.append(f"--objective {objective} (the study: {a.get('objective', 'samples')})")
    if source != a["source"]:
        out.append(f"results {source} here (the study's: {a['source']})")
    out += _script_conflict(study, script)
    return out


def _script_conflict(study: optuna.Study, script: ScriptSpec | None) -> list[str]:
    """What differs between the script given (None: autotune's own loop) and the one the study's trials ran."""
    kept = st.script_of(study)
    if kept is None and script is None:
        return []
    if kept is None:
        return [f"--script {script.label()} (the study's trials ran autotune's own loop)"]
    if script is None:
        return [f"autotune's own loop (the study's trials ran the script {kept.label()}: give --script again)"]
    if not script.same_inputs(kept):
        return [f"--script {script.label()} and its options (the study's: {kept.label()}, {_script_options(kept)})"]
    return []


def _script_options(s: ScriptSpec) -> str:
    config = f"--script-config {s.template_path}" if s.template is not None else "the Trainer-style JSON"
    return f"{config}, {s.config_flag}, " + ("with" if s.trainer_args else "without") + " --script-trainer-args"


def _flag_text(name: str, value) -> str:
    """A setting as the flag that gives it: --exhaustive / --no-exhaustive, --tolerance 2%, --n-trials 20."""
    if name == "exhaustive":
        return "--exhaustive" if value else "--no-exhaustive"
    if name == "tolerance":
        return f"--tolerance {100 * value:.4g}%"
    flag = "--" + name.replace("_", "-")
    return f"{flag} none" if value is None else f"{flag} {value}"


def _settings(study: optuna.Study, given: dict, source: str) -> tuple[st.Settings, list[str]]:
    """The settings a continued study searches with: the study's, each given one replacing its own (and said so);
    and the lines that say which. Refused: other concurrent trials on a measured study (samples/s measured while
    other trials shared the cores would rank against ones measured alone)."""
    kept = st.settings_of(study)
    base = kept or st.Settings()
    changed = {k: v for k, v in given.items() if getattr(base, k) != v}
    if "concurrent_trials" in changed and source == "measured":
        raise SpecError(
            f"study {study.study_name!r} measured its trials {base.concurrent_trials} at a time; "
            f"--concurrent-trials {changed['concurrent_trials']} would rank samples/s measured under other sharing "
            f"of the cores against them. Drop --concurrent-trials or start another --study"
        )
    settings = dataclasses.replace(base, **given)
    if kept is None:  # a study from before studies kept their settings: what was given, or the defaults
        return settings, [f"settings: {settings.describe()} (the study did not record its own; now it does)"]
    lines = [f"settings: {settings.describe()}" + ("" if changed else " (the study's own)")]
    lines += [
        f"  {_flag_text(k, v)} replaces the study's {_flag_text(k, getattr(base, k))}" for k, v in changed.items()
    ]
    return settings, lines


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
    concurrent_trials: int | None = None,
    objective: str | None = None,
    exhaustive: bool | None = None,
    tolerance: float | None = None,
    n_trials: int | None = None,
    dry_run: bool = False,
    script: ScriptSpec | None = None,
) -> SearchSession:
    """Open a new search, or continue an existing study; bad input raises SpecError before anything starts.

    A study keeps its inputs (model, `impl`, GPUs, sequence length, global batch, space, objective, executor)
    and its settings (`exhaustive`, `tolerance`, `n_trials`, `concurrent_trials`: st.Settings).
    `resume`: continue study `study` (default: the model's and GPUs'); an input not given is the study's, one given
    must be the study's. Without `resume`, a study of that name that exists is continued when every input (as
    given, or its default) is the study's, and refused otherwise, naming each that differs. A setting given (not
    None) replaces the study's from then on, and `SearchSession.notes` says so; None keeps the study's (a new
    study: the defaults). `exhaustive`: run every feasible group; else stop when no unrun candidate can beat the
    best by more than `tolerance` (a fraction; autotune/search/stopping.py). `n_trials` counts runs over the
    whole study. `dry_run`: the Ray executor places the trials and starts their ranks, which stop before the first
    CUDA call (autotune/executors/ray_executor.py); the study is kept in memory, never in the storage, and the rank
    plans go to trials/NAME/dry-run/, so a real study of that name is not touched. `script`: every trial runs the
    user's script (autotune/trial/script.py) instead of autotune's loop; the study keeps it as an input (its default
    name ends in the script's stem), and a continued study runs its own script when none is given."""
    if dry_run and resume:
        raise SpecError(
            "--dry-run reads and writes no study: drop --resume (a dry run of the same model and GPUs shows "
            "the trials a search would start)"
        )
    _check_positive(seq_len=seq_len, global_batch=global_batch, concurrent_trials=concurrent_trials, n_trials=n_trials)
    asked = executor
    if tolerance is not None and not 0 <= tolerance < 1:
        raise SpecError(f"tolerance must be at least 0 and below 1 (a fraction: 0.02 = 2%), got {tolerance}")
    spec = resolve_model(model, implementation=impl or "hf", factory=model_factory) if model else None
    cluster = parse_gpus(gpus) if gpus else None
    given_settings = {
        k: v
        for k, v in dict(
            exhaustive=exhaustive, tolerance=tolerance, n_trials=n_trials, concurrent_trials=concurrent_trials
        ).items()
        if v is not None
    }
    notes: list[str] = []
    if resume:
        name = study or (st.default_name(spec, cluster, script) if spec and cluster else None)
        opened = st.load_study(name, storage)
        if script is not None and (differ := _script_conflict(opened, script)):
            raise SpecError(
                f"--resume: study {opened.study_name!r} was searched with another script: {differ[0]}; drop --script "
                f"or start another --study"
            )
        script = st.script_of(opened)
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
        source = opened.user_attrs[st.ATTR]["source"]
        if executor not in ("auto", _SOURCE_KIND[source]):
            raise SpecError(
                f"--resume: study {opened.study_name!r} holds {source} results; --executor {executor} would mix "
                f"measured and simulated numbers. Drop --executor or start another --study"
            )
    else:
        if spec is None or cluster is None:
            raise SpecError("--model and --gpus are needed to start a search (only --resume can omit them)")
        inputs = Inputs(spec, cluster, seq_len or default_seq_len(spec), global_batch, load_space(space))
        name = study or st.default_name(spec, inputs.cluster, script)
        kind_here, _ = executors.choose(executor, inputs.cluster, ray_address, dry_run)  # starts nothing
        if script is not None and kind_here != "ray":
            raise SpecError(
                f"--script {script.name}: a script is measured by running it, and --executor {executor} chose the "
                f"simulated executor (--gpus {inputs.cluster.text}: those devices are not here). Run it where the "
                f"devices are, or with --ray-address"
            )
        if dry_run:  # it reads no study
            st.check_name(name)
            opened = None
        else:  # before starting Ray: a bad name, folder or storage fails fast
            opened = st.existing_study(name, storage)
        if opened is not None:
            differ = _conflicts(
                opened, inputs, objective or "samples", "measured" if kind_here == "ray" else "simulated", script
            )
            if differ:
                raise SpecError(
                    f"study {name!r} already exists, searched with other inputs: {'; '.join(differ)}. Continue it "
                    f"as it was searched with `autotune search --resume --study {name}`, or choose another --study "
                    f"name (nothing was changed)"
                )
            inputs = _resumed_inputs(opened, {})  # the same; the cluster's capacity as the study has it
            notes.append(
                f"study {name!r} exists with the same model, GPUs, sequence length, global batch, space and "
                f"objective: continuing it (no completed trial runs again; `--study NAME` starts another)"
            )
    if opened is not None:
        a = opened.user_attrs[st.ATTR]
        objective = a.get("objective", "samples")  # studies before --objective
        executor = _SOURCE_KIND[a["source"]]  # a study keeps its executor: measured and simulated numbers do not mix
        settings, said = _settings(opened, given_settings, a["source"])
        notes += said
    else:
        settings = st.Settings(**given_settings)
    kind, how = executors.choose(executor, inputs.cluster, ray_address, dry_run)  # starts nothing, creates nothing
    if opened is not None and kind == "simulated" and asked == "auto":
        auto, said = executors.choose("auto", inputs.cluster, ray_address)
        how = said if auto == kind else how  # a continued study's line as its first search's (SIMULATED, ...)
    ex = executors.make(kind, inputs.cluster, ray_address, settings.concurrent_trials, dry_run=dry_run)
    try:
        if getattr(ex, "cluster", inputs.cluster) != inputs.cluster:  # the capacity the cluster's devices report
            inputs = dataclasses.replace(inputs, cluster=ex.cluster)
        attrs = st.study_attrs(
            inputs.model,
            inputs.cluster,
            seq_len=inputs.seq_len,
            global_batch=inputs.global_batch,
            space_text=inputs.space.text,
            space_path=inputs.space.path,
            source=ex.source,
            objective=objective or "samples",
            settings=settings,
            script=script,
        )
        if dry_run:
            opened = optuna.create_study(
                study_name=name, storage=optuna.storages.InMemoryStorage(), direction="maximize"
            )
            opened.set_user_attr(st.ATTR, attrs)
        elif opened is None:
            opened = st.create_study(name, storage, attrs, sampler=None)
        else:
            st.store_settings(opened, settings)
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
            exhaustive=settings.exhaustive,
            tolerance=settings.tolerance,
            out_root=st.study_dir(name) / "dry-run" if dry_run else None,
            script=script,
        )
    except BaseException:
        ex.close()
        raise
    return SearchSession(opened, inputs, ex, how, search, correction, settings, notes, dry_run)
