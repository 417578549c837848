"""A search stopped by SIGTERM (or Ctrl-C) at any moment: every trial it wrote has a status and a
reason, none is left RUNNING, the one it was running is `interrupted`, and --resume runs that one
again and no completed one. Real Optuna on SQLite, a real signal sent to this process; the executor
is a table (pure glue). The signal is sent at every database write and every executor call of a
whole search in turn, so it lands between trials, inside a trial's own writes, and during a trial."""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from autotune import interrupts
from autotune.executors.base import Executor
from autotune.hardware import parse_gpus
from autotune.models import from_hf_config
from autotune.report import render
from autotune.search import study as st
from autotune.search.loop import Search
from autotune.search.space import parse_space
from autotune.trial.record import TrialResult

TINY = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 256,
}
SPACE = "zero_stage: [0, 1]\nprecision: [fp32]\nmicro_batch: [1, 2]\nckpt_layers: [0]\n"
WRITES = ("_create_new_trial", "set_trial_user_attr", "set_trial_state_values")


class Table(Executor):
    """samples/s = micro batch x (1.1 at ZeRO-1); `trip()` before each call. Pure glue."""

    def __init__(self, trip):
        self.trip, self.pending, self.seen = trip, {}, []

    def slots(self) -> int:
        return 1

    def submit(self, request) -> str:
        self.trip()
        c = request.config
        self.seen.append(c.key())
        self.pending[str(len(self.seen))] = TrialResult(
            status="ok", peak_bytes=1, samples_per_s=c.micro_batch * (1.1 if c.zero_stage else 1.0)
        )
        return str(len(self.seen))

    def wait_any(self, timeout_s=None):
        self.trip()  # a signal here lands while the trial runs
        ticket = next(iter(self.pending))
        return [(ticket, self.pending.pop(ticket))]


class Tripwire:
    """Counts events (database writes, executor calls); at event number `at` sends SIGTERM to this process."""

    def __init__(self, at: int | None):
        self.at, self.n, self.where, self.seen = at, 0, None, []

    def __call__(self, where: str = "executor") -> None:
        self.n += 1
        self.seen.append(where)
        if self.n == self.at:
            self.where = where
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    cfg = tmp_path / "tiny" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(TINY))
    model = dataclasses.replace(from_hf_config(cfg), implementation="builtin")
    previous = signal.signal(signal.SIGTERM, interrupts.raise_interrupted)  # as `autotune search` does
    yield model, monkeypatch
    signal.signal(signal.SIGTERM, previous)


def _search(model, name, trip, resume=False):
    space, cluster = parse_space(SPACE), parse_gpus("2xcpu@64GiB")
    if resume:
        study = st.load_study(name)
    else:
        attrs = st.study_attrs(
            model, cluster, seq_len=64, global_batch=None, space_text=space.text, space_path="test", source="measured"
        )
        study = st.create_study(name, None, attrs, sampler=None)
    ex = Table(trip)
    return Search(study, model, cluster, space, ex, seq_len=64, prior=lambda c: 1.0, exhaustive=True), ex


def _watch_writes(monkeypatch) -> dict:
    """Every database write of the study calls the current tripwire first."""
    current = {"wire": Tripwire(None)}
    for name in WRITES:
        real = getattr(RDBStorage, name)

        def wrapped(self, *a, _real=real, _name=name, **kw):
            current["wire"](_name)
            return _real(self, *a, **kw)

        monkeypatch.setattr(RDBStorage, name, wrapped)
    return current


def _keys(study, status: str) -> set:
    return {st.record_of(t).config.key() for t in study.trials if t.user_attrs["status"] == status}


@pytest.mark.slow  # signals at every moment of a search (~5 s); quick loop: test_newcomer's resume tests
def test_a_signal_at_any_moment_leaves_every_trial_recorded_and_resume_finishes(setup):
    model, monkeypatch = setup
    current = _watch_writes(monkeypatch)
    count = current["wire"]
    s, ex = _search(model, "count", count)
    s.run(progress=False)
    groups = set(ex.seen)
    assert len(groups) == 4 and count.n > 4 * 4  # every group ran; each trial is several writes and calls
    # Every event of one trial's whole cycle, and the moment between two trials: from the first
    # trial's creation to the second's submit (the third executor call). Every later trial repeats it.
    events = [i for i, w in enumerate(count.seen, 1) if w == "executor"][2]
    landed = set()
    for at in range(1, events + 1):
        wire = current["wire"] = Tripwire(at)
        name = f"s{at}"
        s, ex = _search(model, name, wire)
        with pytest.raises(KeyboardInterrupt) as err:
            s.run(progress=False)
        assert isinstance(err.value, interrupts.Interrupted) and err.value.why == "SIGTERM"
        landed.add(wire.where)
        current["wire"] = Tripwire(None)
        study = st.load_study(name)
        assert all(t.state != TrialState.RUNNING for t in study.trials), at
        assert all(t.user_attrs.get("status") and "config" in t.user_attrs for t in study.trials), at
        stopped = [t for t in study.trials if t.user_attrs["status"] == "interrupted"]
        assert all(t.state == TrialState.FAIL and "stopped by SIGTERM" in t.user_attrs["reason"] for t in stopped), at
        done, cut = _keys(study, "ok"), _keys(study, "interrupted")
        assert done | cut == set(ex.seen) and not done & cut, at  # what started finished or is marked
        # --resume: the interrupted trial runs again, nothing completed does, and the study ends whole
        s2, ex2 = _search(model, name, Tripwire(None), resume=True)
        assert s2.summary.interrupted == len(stopped) and s2.summary.ok == len(done), at
        s2.run(progress=False)
        rerun = set(ex2.seen)
        assert len(rerun) == len(ex2.seen) and not rerun & done and cut <= rerun, at
        assert done | rerun == groups, at
    # the signal landed in a trial's creation, in its attrs, at its end, in a submit and in a wait
    assert set(WRITES) | {"executor"} <= landed


def test_the_report_shows_interrupted_trials_apart_with_their_reason(setup):
    model, monkeypatch = setup
    calls = {"n": 0}

    def trip():
        calls["n"] += 1
        if calls["n"] == 4:  # the second trial's wait: it is running
            os.kill(os.getpid(), signal.SIGTERM)

    s, _ = _search(model, "rep", trip)
    with pytest.raises(KeyboardInterrupt):
        s.run(progress=False)
    study = st.load_study("rep")
    text = render(study, "table")
    assert "interrupted: 1" in text
    # what became of it, in words that stay true (the study, made without open_search, keeps no settings: the
    # stopping rule by default); the reason the search wrote ("it runs again on --resume") is not repeated
    pending = "the search was stopped by SIGTERM while it ran; not run again yet: a --resume runs it unless the "
    pending += "stopping rule ends the search first"
    assert pending in text and "it runs again on --resume" not in text
    assert "failed: 0" in text
    assert json.loads(render(study, "json"))["interrupted"] == {pending: 1}
