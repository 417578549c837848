"""The search loop on a real Optuna study in a real SQLite database, with the real memory model.

The executor here is a table (`Landscape`): these tests check the loop's bookkeeping (pruning,
dominance, de-duplication, failures, interrupts and resume), not throughput. The end-to-end test
with real Ray + DeepSpeed trials is at the bottom.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import optuna
import pytest
from cases import TINY_LLAMA as TINY
from conftest import finished_runs

from autotune.cli import main
from autotune.executors.base import Executor
from autotune.hardware import parse_gpus
from autotune.memory import estimate
from autotune.models import SpecError, from_hf_config
from autotune.search import study as st
from autotune.search.loop import Search
from autotune.search.space import expand, parse_space
from autotune.train_config import TrainConfig
from autotune.trial.record import TrialResult
from autotune.units import MiB

ROOT = Path(__file__).resolve().parent.parent
SPACE = "zero_stage: [0, 1, 3]\nprecision: [fp32]\nmicro_batch: [1, 2, 4, 8]\nckpt_layers: all\n"
SEQ = 64


class Landscape(Executor):
    """Answers from a formula: samples/s = micro batch / (1 + k/8) * (1.2 at ZeRO-1). Pure glue."""

    def __init__(self, slots: int = 1, status=lambda cfg: "ok", stop_after: int | None = None):
        self._slots, self.status, self.stop_after = slots, status, stop_after
        self.seen: list[TrainConfig] = []
        self.pending: dict[str, TrialResult] = {}

    def slots(self) -> int:
        return self._slots

    def submit(self, request) -> str:
        c = request.config
        self.seen.append(c)
        status = self.status(c)
        sps = c.micro_batch / (1 + c.ckpt_layers / 8) * (1.2 if c.zero_stage == 1 else 1.0)
        ticket = str(len(self.seen))
        self.pending[ticket] = TrialResult(
            status=status,
            samples_per_s=sps if status == "ok" else None,
            reason="" if status == "ok" else f"{status} by the table",
            log_tail=f"log of {c.short()}",
            peak_bytes=1 << 20,
        )
        return ticket

    def wait_any(self, timeout_s=None):
        if self.stop_after is not None and len(self.seen) > self.stop_after:
            raise KeyboardInterrupt
        ticket = next(iter(self.pending))
        return [(ticket, self.pending.pop(ticket))]


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    cfg = tmp_path / "tiny" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(TINY))
    # the loop's bookkeeping is under test, not the memory model: the stand-in's analytic terms price it
    model = dataclasses.replace(from_hf_config(cfg), implementation="builtin")
    space = parse_space(SPACE)
    # A cap between the smallest and the largest estimate, so the memory model prunes some and keeps some.
    totals = sorted(
        estimate(model, parse_gpus("2xcpu@64GiB"), c).total_bytes
        for c in expand(space, model, parse_gpus("2xcpu@64GiB"), seq_len=SEQ).candidates
    )
    cap_mib = totals[len(totals) // 2] // MiB
    return {
        "model": model,
        "cluster": parse_gpus(f"2xcpu@{cap_mib}MiB"),
        "space": space,
        "cfg_path": cfg,
        "cap_mib": cap_mib,
        "tmp": tmp_path,
    }


def _search(env, executor, name="s", resume=False, **kw) -> Search:
    if resume:
        study = st.load_study(name)
    else:
        attrs = st.study_attrs(
            env["model"],
            env["cluster"],
            seq_len=SEQ,
            global_batch=kw.get("global_batch"),
            space_text=env["space"].text,
            space_path="test",
            source="measured",
        )
        study = st.create_study(name, None, attrs, sampler=None)
    return Search(study, env["model"], env["cluster"], env["space"], executor, seq_len=SEQ, **kw)


def _by_status(study) -> Counter:
    return Counter(t.user_attrs.get("pruned_by") or t.user_attrs["status"] for t in study.trials)


@pytest.mark.slow  # a whole space estimated (~6 s); quick loop: the stopping and order tests
def test_memory_model_prunes_and_dominance_keeps_smallest_k(env):
    ex = Landscape()
    s = _search(env, ex, exhaustive=True)  # every group runs: the bookkeeping of all of them is under test
    summary = s.run(progress=False)
    trials = s.study.trials
    assert summary.stop == "exhausted"
    keys = [st.record_of(t).config.key() for t in trials]
    assert len(keys) == len(set(keys)) == summary.candidates  # every candidate decided exactly once
    assert len(ex.seen) == len({c.key() for c in ex.seen}) == summary.ok  # nothing ran twice
    for t in trials:
        a, e = t.user_attrs, t.user_attrs["estimate"]
        fits = e["total_bytes"] <= e["capacity_bytes"]
        if a.get("pruned_by") == "memory":
            assert t.state == optuna.trial.TrialState.PRUNED and not fits
            assert e["dominant_term"] in a["reason"] and "capacity" in a["reason"]
        elif t.state != optuna.trial.TrialState.PRUNED:
            assert e["detail"]["terms"] and e["detail"]["source"] == "estimated"
        else:
            assert fits
    # per group (all but k), the one run is the smallest k that fits; larger k are dominated
    ran = {(c.zero_stage, c.micro_batch): c.ckpt_layers for c in ex.seen}
    for t in trials:
        c = st.record_of(t).config
        if t.user_attrs.get("pruned_by") == "dominated":
            assert c.ckpt_layers > ran[(c.zero_stage, c.micro_batch)]
            assert "trial " in t.user_attrs["reason"] and "fewer checkpointed layers" in t.user_attrs["reason"]
        if t.user_attrs.get("pruned_by") == "memory" and (c.zero_stage, c.micro_batch) in ran:
            assert c.ckpt_layers < ran[(c.zero_stage, c.micro_batch)]
    counts = _by_status(s.study)
    assert counts["memory"] > 0 and counts["dominated"] > 0 and counts["ok"] == len(ran)
    best = max(t.value for t in trials if t.value is not None)
    assert summary.best_value == best and s.study.best_value == best


def test_oom_skips_larger_micro_batches_and_failures_keep_status_reason_log(env):
    # A cap that lets ZeRO-3 run micro batches 1 and 2 without checkpointing; micro batch 1 then runs
    # out of memory in the table, so micro batch 2 (and any larger one fitting at k = 0) must not run.
    need = estimate(
        env["model"], parse_gpus("2xcpu@64GiB"), TrainConfig(zero_stage=3, precision="fp32", micro_batch=2, seq_len=SEQ)
    ).total_bytes
    env = {**env, "cluster": parse_gpus(f"2xcpu@{-(-need // MiB)}MiB")}
    cands = expand(env["space"], env["model"], env["cluster"], seq_len=SEQ).candidates
    fit0 = [c for c in cands if c.ckpt_layers == 0 and estimate(env["model"], env["cluster"], c).fits]
    zero = 3
    mbs = sorted(c.micro_batch for c in fit0 if c.zero_stage == zero)
    assert mbs[:2] == [1, 2]
    ex = Landscape(
        status=lambda c: (
            "oom"
            if (c.zero_stage, c.micro_batch, c.ckpt_layers) == (zero, mbs[0], 0)
            else "crashed"
            if c.zero_stage != zero and c.micro_batch == 1
            else "ok"
        )
    )
    s = _search(env, ex, prior=lambda c: 1.0 / c.micro_batch)  # small micro batches first
    s.run(progress=False)
    trials = s.study.trials
    oom = [t for t in trials if t.user_attrs["status"] == "oom"]
    assert len(oom) == 1 and oom[0].state == optuna.trial.TrialState.FAIL
    implied = {
        (st.record_of(t).config.zero_stage, st.record_of(t).config.micro_batch, st.record_of(t).config.ckpt_layers): t
        for t in trials
        if t.user_attrs.get("pruned_by") == "oom-implied"
    }
    assert set(implied) == {(zero, mb, 0) for mb in mbs[1:]}
    for t in implied.values():
        assert f"trial {oom[0].number} ran out of memory at micro batch {mbs[0]}" in t.user_attrs["reason"]
    assert not {k for k in implied} & {(c.zero_stage, c.micro_batch, c.ckpt_layers) for c in ex.seen}
    # the group that ran out of memory moves on to its next k
    assert any(c.zero_stage == zero and c.micro_batch == mbs[0] and c.ckpt_layers == 1 for c in ex.seen)
    crashed = [t for t in trials if t.user_attrs["status"] == "crashed"]
    assert crashed and all(t.state == optuna.trial.TrialState.FAIL for t in crashed)
    assert crashed[0].user_attrs["reason"] == "crashed by the table"
    assert crashed[0].user_attrs["result"]["log_tail"].startswith("log of z")


@pytest.mark.slow  # a search interrupted and resumed (~6 s); quick loop: test_newcomer's resume refusals
def test_interrupt_keeps_completed_and_resume_redoes_none(env):
    ex = Landscape(slots=2, stop_after=3)
    with pytest.raises(KeyboardInterrupt):
        _search(env, ex, exhaustive=True).run(progress=False)  # not stopped by the bound before the interrupt
    study = st.load_study("s")
    done = {st.record_of(t).config.key() for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE}
    interrupted = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    assert len(done) >= 1 and len(interrupted) == len(ex.seen) - len(done) >= 1
    ex2 = Landscape(slots=2)
    s2 = _search(env, ex2, resume=True, exhaustive=True)
    assert s2.summary.ok == len(done) and s2.summary.interrupted == len(interrupted)
    s2.run(progress=False)
    rerun = {c.key() for c in ex2.seen}
    assert not rerun & done  # no completed config again
    assert {st.record_of(t).config.key() for t in interrupted} <= rerun  # interrupted ones do run
    complete = [st.record_of(t).config.key() for t in s2.study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == len(set(complete))


def test_stale_running_trial_of_a_killed_process_is_rerun(env):
    # one prior for both searches: the CPU prior is timed anew in each, and on a loaded machine two timings
    # can rank two candidates apart differently, so the pick after one run would not be the same
    prior = lambda c: c.micro_batch / (1 + c.ckpt_layers / 8)  # noqa: E731
    s = _search(env, Landscape(), prior=prior)
    s.run(n_trials=1, progress=False)
    first = s.strategy.pick(s.plan.available(set()))
    s.sampler.chosen = st.params_of(first.cfg, s.dists)
    t = s.study.ask(s.dists)  # what a process killed with SIGKILL leaves: RUNNING
    for k, v in {"config": first.cfg.to_dict(), "status": "running", "owner": "nohost:1"}.items():
        t.set_user_attr(k, v)
    ex = Landscape()
    s2 = _search(env, ex, resume=True, prior=prior)
    assert s2.study.trials[t.number].state == optuna.trial.TrialState.FAIL
    s2.run(n_trials=2, progress=False)
    assert [c.key() for c in ex.seen] == [first.cfg.key()]  # budget 2 = the old run + this one


def test_budget_counts_runs_across_resume(env):
    _search(env, Landscape()).run(n_trials=2, progress=False)
    ex = Landscape()
    summary = _search(env, ex, resume=True).run(n_trials=3, progress=False)
    assert len(ex.seen) == 1 and summary.ran == 3 and summary.stop == "n-trials"


def test_timeout_stops_starting_trials(env):
    ex = Landscape()
    summary = _search(env, ex).run(timeout_s=0, progress=False)
    assert summary.stop == "timeout" and not ex.seen and summary.pruned > 0


def test_resume_refuses_contradicting_flags_and_ray_refuses_absent_gpus(env, capsys):
    _search(env, Landscape(), name="r").run(n_trials=1, progress=False)
    assert _cli(env, "--resume", "--study", "r", "--seq-len", "128") == 2
    assert "was searched with --seq-len 64, not 128" in capsys.readouterr().err
    assert main(["search", "--model", "13b", "--gpus", "4xA100", "--executor", "ray", "--study", "g"]) == 2
    assert "--executor ray" in capsys.readouterr().err and not (env["tmp"] / "trials" / "g").exists()


def test_corrector_hook_tightens_pruning_and_sees_results(env):
    seen = []

    class Stricter:
        def __call__(self, est, cfg):
            return est.total_bytes * (2 if seen else 1)  # after the first result: estimates x2

        def observe(self, est, cfg, result):
            seen.append((cfg, result.status))

    plain = Landscape()
    _search(env, plain, name="plain").run(progress=False)
    strict = Landscape()
    s = _search(env, strict, name="strict", corrector=Stricter())
    s.run(progress=False)
    assert len(seen) == len(strict.seen) and len(strict.seen) < len(plain.seen)
    reasons = [t.user_attrs["reason"] for t in s.study.trials if t.user_attrs.get("pruned_by") == "memory"]
    assert any("after online correction" in r for r in reasons)


def test_global_batch_sets_grad_accum(env):
    ex = Landscape()
    _search(env, ex, global_batch=8).run(progress=False)
    assert ex.seen and all(c.micro_batch * c.grad_accum * 2 == 8 for c in ex.seen)
    assert {c.micro_batch for c in ex.seen} <= {1, 2, 4}  # 8 x 2 ranks does not divide 8


def _cli(env, *args) -> int:
    return main(["search", "--model", str(env["cfg_path"]), "--gpus", f"2xcpu@{env['cap_mib']}MiB", *args])


def _dump(db: Path) -> list[str]:
    import sqlite3

    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return list(con.iterdump())


def test_existing_study_corrupt_database_and_unknown_study_exit_2_untouched(env, capsys):
    _search(env, Landscape(), name="taken").run(n_trials=1, progress=False)
    db = env["tmp"] / "trials" / "taken" / "study.db"
    before = _dump(db)  # the content, not the bytes: SQLite may checkpoint its WAL file at any close
    assert _cli(env, "--study", "taken") == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--resume" in err and _dump(db) == before
    bad = env["tmp"] / "trials" / "broken" / "study.db"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not a database" * 10)
    for argv in (
        ["search", "--model", str(env["cfg_path"]), "--gpus", "2xcpu", "--study", "broken"],
        ["report", "--study", "broken"],
        ["export", "--study", "broken", "--out", "x.json"],
    ):
        assert main(argv) == 2
        assert "not a SQLite database" in capsys.readouterr().err
    assert bad.read_bytes() == b"not a database" * 10
    assert main(["report", "--study", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no study database" in err and "taken" in err
    assert _cli(env, "--resume", "--study", "nope") == 2
    with pytest.raises(SpecError, match="not an Optuna study"):
        other = env["tmp"] / "other.db"
        import sqlite3

        with sqlite3.connect(other) as con:
            con.execute("create table t (x)")
        st.load_study("x", f"sqlite:///{other}")


@pytest.mark.slow
def test_main_command_without_the_gpus_is_simulated_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    # --exhaustive: two runs, where the stopping rule ends this search after one
    assert (
        main(["search", "--model", "13b", "--gpus", "4xA100", "--n-trials", "2", "--exhaustive", "--no-progress"]) == 0
    )
    out = capsys.readouterr().out
    assert "executor: simulated" in out and "SIMULATED by the cost model, not measured" in out
    assert "samples/s (simulated)" in out and "samples/s (measured)" not in out
    study = st.load_study("llama-2-13b_4xA100")
    runs = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(runs) == 2 and all(t.user_attrs["source"] == "simulated" for t in runs)
    assert sum(t.user_attrs.get("pruned_by") == "memory" for t in study.trials) > 0


@pytest.mark.slow
def test_end_to_end_real_trials_killed_and_resumed(killed_and_resumed):
    """Real Ray + DeepSpeed trials on two CPU ranks under a memory cap; killed with SIGTERM after the
    first completed trial, then resumed: no completed configuration runs again; then report and export
    (the runs: conftest.killed_and_resumed)."""
    run = killed_and_resumed
    first, out1, second, db, env, tmp_path = run.first, run.out1, run.second, run.db, run.env, run.root
    assert first.returncode == 130, out1[-3000:]
    assert "interrupted: every completed trial is kept" in out1
    done_before = run.done_before
    assert len(done_before) >= 1
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "executor: ray" in second.stdout and "samples/s (measured)" in second.stdout
    runs = [r for r in finished_runs(db) if r["state"] in ("COMPLETE", "FAIL")]
    study = optuna.load_study(study_name="e2e", storage=f"sqlite:///{db}")
    real = [t for t in study.trials if t.user_attrs["status"] in ("ok", "oom", "timeout", "crashed", "diverged")]
    keys = [json.dumps(t.user_attrs["config"], sort_keys=True) for t in real]
    assert len(real) == 3 and len(keys) == len(set(keys))  # budget of 3 runs, none twice
    assert done_before <= set(keys) and len(runs) >= 3
    assert all(t.user_attrs["source"] == "measured" for t in real)
    ok = [t for t in real if t.user_attrs["status"] == "ok"]
    assert ok and all(t.value > 0 and t.user_attrs["result"]["peak_bytes"] > 0 for t in ok)
    assert any(t.user_attrs.get("pruned_by") == "memory" for t in study.trials)  # the cap pruned some
    rep = subprocess.run(
        [sys.executable, "-m", "autotune", "report", "--study", "e2e", "--format", "json"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    ranked = json.loads(rep.stdout)["ranked"]
    values = [r["samples/s (measured)"] for r in ranked]
    assert values == sorted(values, reverse=True) and values[0] == pytest.approx(max(t.value for t in ok))
    exp = subprocess.run(
        # --concrete: DeepSpeed itself reads it below (it resolves no "auto")
        [sys.executable, "-m", "autotune", "export", "--study", "e2e", "--out", "ds.json", "--concrete"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert exp.returncode == 0 and "deepspeed --num_gpus 2" in exp.stdout
    from test_report_export import VALIDATE

    check = subprocess.run(
        [sys.executable, "-c", VALIDATE, str(tmp_path / "ds.json"), "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert check.returncode == 0, check.stderr[-2000:]
    assert json.loads(check.stdout.strip().splitlines()[-1])["world"] == 2


def test_bulk_pruned_records_read_back_as_add_trials_writes_them(tmp_path, monkeypatch):
    """st.add_finished writes Optuna's rows itself (one transaction instead of one per trial): what it
    wrote reads back through Optuna exactly as `Study.add_trials` writes it, numbered after a running
    trial, and the study goes on (ask, tell) as usual."""
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    cfgs = [
        TrainConfig(zero_stage=z, micro_batch=b, precision=p)
        for z in (0, 3)
        for b in (1, 2, 8)
        for p in ("fp32", "bf16")
    ]
    dists = st.distributions(cfgs)
    records = [
        st.pruned_record(c, dists, {"pruned_by": "memory", "reason": f"r{i}", "estimate": {"total_bytes": i}})
        for i, c in enumerate(cfgs)
    ]
    studies = {}
    for name, write in (("one", lambda s, r: s.add_trials(r)), ("bulk", st.add_finished)):
        study = st.create_study(name, None, {"x": 1}, sampler=optuna.samplers.RandomSampler(seed=0))
        running = study.ask(dists)
        write(study, records)
        study.tell(running, 1.5)
        study.tell(study.ask(dists), state=optuna.trial.TrialState.FAIL)
        studies[name] = st.load_study(name).trials
    one, bulk = studies["one"], studies["bulk"]
    assert len(bulk) == len(cfgs) + 2 and [t.number for t in bulk] == list(range(len(cfgs) + 2))

    def view(t):
        return (t.number, t.state, t.value, t.params, t.distributions, t.user_attrs, t.datetime_start is None)

    assert [view(t) for t in bulk] == [view(t) for t in one]
    assert [t.number for t in bulk if t.state.name == "PRUNED"] == list(range(1, len(cfgs) + 1))
    assert [st.record_of(t).config for t in bulk[1:-1]] == cfgs


def test_records_read_from_the_rows_equal_optunas_trials(tmp_path, monkeypatch):
    """st.records reads an RDB study's rows in three queries instead of through Study.get_trials: every
    kind of trial (pruned in bulk, complete with a result, failed, running, one left running by a dead
    process) reads back as record_of(FrozenTrial) reads it."""
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    monkeypatch.setattr(st, "_CONFIGS", {})  # no config text read by an earlier test
    cfgs = [TrainConfig(zero_stage=z, micro_batch=b) for z in (0, 2) for b in (1, 4)]
    dists = st.distributions(cfgs)
    study = st.create_study("rows", None, {"x": 1}, sampler=st.ChosenSampler())
    st.add_finished(
        study,
        [
            st.pruned_record(c, dists, {"pruned_by": "memory", "reason": "r", "estimate": {"total_bytes": 7}})
            for c in cfgs[:2]
        ],
    )
    ok = st.start_trial(study, cfgs[2], dists, st.running_attrs(cfgs[2], {"estimate": {"total_bytes": 9}}))
    for k, v in st.result_attrs(TrialResult(status="ok", samples_per_s=3.25, step_time_s=0.5)).items():
        ok.set_user_attr(k, v)
    study.tell(ok, 3.25)
    failed = st.start_trial(study, cfgs[3], dists, st.running_attrs(cfgs[3], {}))
    study.tell(failed, state=optuna.trial.TrialState.FAIL)
    st.start_trial(study, cfgs[1], dists, st.running_attrs(cfgs[1], {}))  # still running
    fresh = st.load_study("rows")
    slow = [st.record_of(t) for t in sorted(fresh.get_trials(deepcopy=False), key=lambda t: t.number)]
    fast = st.records(fresh)
    assert fast == slow and len(fast) == 5 and st.records(study) == fast
    # the pruned records' configs are those add_finished wrote, filed under the text it wrote: not parsed again
    assert fast[0].config is cfgs[0] and fast[1].config is cfgs[1]
    assert [r.status for r in fast][:3] == ["pruned", "pruned", "ok"] and fast[2].value == 3.25
    assert fast[2].result.samples_per_s == 3.25 and fast[4].state == optuna.trial.TrialState.RUNNING
