"""The report's pictures from real study databases (issue 17): a simulated 13B x 4xA100 search and,
slow, the measured CPU search of conftest.killed_and_resumed. Content is checked on the data each picture draws."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from autotune import memory as mem
from autotune import report
from autotune.report import pictures as rp
from autotune.search import study as st
from autotune.search.session import open_search
from autotune.trial.record import FAILED
from autotune.units import GiB

PICTURES = ("memory_terms.png", "frontier.png", "step_time.png")


def _search(root: Path, monkeypatch, n_trials: int, **kw):
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(root))
    with open_search(**kw) as s:
        s.run(n_trials=n_trials, progress=False)
        name = s.study.study_name
    return st.load_study(name)  # read back from the database, as `autotune report` does


@pytest.fixture(scope="module")
def sim_root(tmp_path_factory):
    """A simulated 13B x 4xA100 search of every feasible group (about 30 s), searched once per module: the
    pictures of several runs are under test, and the stopping rule ends this search after one."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("sim")
    try:
        _search(root, mp, 20, model="13b", gpus="4xA100", executor="simulated", exhaustive=True)
    finally:
        mp.undo()
    return root


@pytest.fixture
def sim_study(sim_root, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(sim_root))
    return st.load_study(None)  # the most recent (the only) study under the root


def check_content(study) -> rp.Pictures:
    """What every study's pictures must hold: terms summing to the estimate, every decided trial once."""
    model, cluster, _ = st.specs_of(study)
    p = rp.pictures(study)
    recs = {r.number: r for r in st.records(study)}
    for b in p.memory:
        e = mem.estimate(model, cluster, recs[b.trial].config)
        assert sum(b.groups.values()) == b.total_bytes == e.total_bytes
        assert b.tensor_peak_bytes == e.tensor_peak_bytes and b.phase == e.phase
        if b.status == "ok":  # a run's bar is its recorded estimate: the memory model's, before the online
            # correction (a measured peak off the estimate moves total_bytes; seen once on a loaded machine)
            assert b.total_bytes == recs[b.trial].estimate["model_total_bytes"]
    decided = {n for n, r in recs.items() if r.status in ("ok", "pruned", *FAILED)}
    numbers = [f.trial for f in p.frontier]
    assert sorted(numbers) == sorted(decided) and len(set(numbers)) == len(numbers)
    for f in p.frontier:
        r = recs[f.trial]
        assert f.status == r.status and f.peak_bytes == r.estimate["total_bytes"]
        if r.status == "pruned":
            assert f.why == r.pruned_by and f.throughput_source not in ("measured", "simulated")  # never a run's mark
        if r.status == "ok":
            assert f.throughput == r.result.samples_per_s and f.throughput_source == p.source
    ok = sorted((r for r in recs.values() if r.status == "ok"), key=lambda r: -r.result.samples_per_s)
    assert [f.trial for f in p.frontier if f.winner] == [ok[0].number]
    assert [t.trial for t in p.time] == [r.number for r in ok]
    for t in p.time:
        assert t.step_time_s == pytest.approx(recs[t.trial].result.step_time_s, rel=1e-6)
        assert sum(t.parts.values()) == pytest.approx(t.step_time_s)
    return p


def check_files(study, out: Path) -> None:
    paths = report.write_outputs(study, out)
    for name in PICTURES + ("report.md", "report.html"):
        assert out / name in paths and (out / name).stat().st_size > 1000
    md = (out / "report.md").read_text()
    assert md.index("## Why this configuration") < md.index("![memory_terms]") < md.index("## Ranked runs")
    assert "**Winner #" in md and "**Memory**" in md and "**Ruled out**" in md
    assert md.count("data:image/png;base64,") == 0 and (out / "report.html").read_text().count(
        "data:image/png;base64,"
    ) == md.count("![")


@pytest.mark.slow
def test_simulated_13b_pictures(sim_study, tmp_path):
    p = check_content(sim_study)
    assert p.source == "simulated" and len(p.time) >= 2
    pruned = [b for b in p.memory if b.status == "pruned"]
    assert {b.trial for b in pruned} and all(b.total_bytes > b.capacity_bytes for b in pruned)
    winner = p.memory[0]
    assert winner.status == "ok" and winner.total_bytes <= winner.capacity_bytes
    # the cost model's split: compute dominates a 13B step; communication is a named part
    assert {"compute", "recompute", "exposed communication", "optimizer"} <= set(p.time[0].parts)
    # pruned points are hollow "simulated (not run)", never the runs' mark
    assert {f.throughput_source for f in p.frontier if f.status == "pruned"} == {"simulated (not run)"}
    check_files(sim_study, tmp_path / "out")


@pytest.mark.slow
def test_measured_cpu_pictures_of_the_killed_and_resumed_search(killed_and_resumed, tmp_path, monkeypatch):
    """The study of a real CPU search through the CLI, killed and resumed (conftest.killed_and_resumed)."""
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(killed_and_resumed.trials))
    study = st.load_study("e2e")
    p = check_content(study)
    assert p.source == "measured"
    assert all(b.measured_peak_bytes for b in p.memory if b.status == "ok")
    assert all(t.source.startswith("measured") for t in p.time)
    check_files(study, tmp_path / "out")
    # the winner's margin is flagged exactly when its own steps spread by more than it
    from autotune.report import page as report_page

    ok = sorted((r for r in st.records(study) if r.status == "ok"), key=lambda r: -r.result.samples_per_s)
    assert len(ok) > 1
    why = report_page.why_lines(study, p)[0]
    margin = ok[0].result.samples_per_s / ok[1].result.samples_per_s - 1
    noisy = margin < ok[0].result.step_time_spread_s / ok[0].result.step_time_s
    assert ("spread of the winner's own measured steps" in why) == noisy


def test_a_margin_within_the_winners_step_spread_is_flagged():
    from autotune.report.page import within_noise
    from autotune.trial.record import TrialResult

    steps = TrialResult(status="ok", step_time_s=1.0, step_time_spread_s=0.15)  # steps 15% apart
    assert "within the 15% spread" in within_noise(0.053, steps)
    assert within_noise(0.20, steps) == ""
    assert within_noise(0.01, TrialResult(status="ok", step_time_s=1.0, step_time_spread_s=0.0)) == ""  # simulated
    assert within_noise(0.01, None) == ""


@pytest.mark.slow
def test_cli_open_without_a_browser(sim_study, monkeypatch, capsys):
    import webbrowser

    from autotune.cli import main

    def no_browser(*_a, **_k):
        raise webbrowser.Error("could not locate runnable browser")

    monkeypatch.setattr(webbrowser, "get", no_browser)
    assert main(["report", "--open", "--top", "1"]) == 0
    page = st.study_dir(sim_study.study_name) / "report.html"
    assert f"report page: {page} (no browser found to open it)" in capsys.readouterr().out and page.exists()


@pytest.mark.slow
def test_html_in_headless_chromium(sim_study, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on PATH (apt-get install chromium): the HTML page is not checked in a browser")
    out = tmp_path / "out"
    report.write_outputs(sim_study, out)
    shot = tmp_path / "shot.png"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--window-size=1200,2400",
            f"--screenshot={shot}",
            (out / "report.html").as_uri(),
        ],
        check=True,
        timeout=120,
        capture_output=True,
    )
    import matplotlib.image

    img = matplotlib.image.imread(shot)
    assert img.shape[0] >= 2000 and img.shape[1] >= 1000
    # a blank page is one colour; the embedded pictures make many
    assert img[..., :3].std() > 0.05
    assert len({tuple(px) for px in img[::7, ::7, :3].reshape(-1, 3).round(2).tolist()}) > 50


# ---- the table's plots (issue 32): axis from 0, no estimate-vs-run scatter for simulated runs -------
def _frame(source: str):
    import pandas as pd

    rows = [
        {
            "trial": i,
            "status": "ok",
            "source": source,
            "zero_stage": z,
            "precision": "bf16",
            "micro_batch": 2,
            "grad_accum": 1,
            "ckpt_layers": 0,
            "samples_per_s": s,
            "peak_bytes": 2**30 * (i + 1),
            "est_tensor_bytes": 2**30 * (i + 1.1),
        }
        for i, (z, s) in enumerate([(0, 3.0), (2, 5.5), (3, 4.25)])
    ]
    return pd.DataFrame(rows)


def test_throughput_axis_starts_at_zero():
    import matplotlib.pyplot as plt

    fig, ax = rp.draw_throughput(_frame("simulated"))
    try:
        assert ax.get_xlim()[0] == 0 and ax.get_xlim()[1] >= 5.5
        assert sorted(t.get_text() for t in ax.get_legend().get_texts()) == ["ZeRO 0", "ZeRO 2", "ZeRO 3"]
        assert "simulated" in ax.get_xlabel()
    finally:
        plt.close(fig)


def test_estimate_vs_run_only_for_measured_runs(tmp_path):
    assert rp.plot_memory(_frame("simulated"), tmp_path / "sim.png") is None
    assert rp.plot_memory(_frame("measured"), tmp_path / "meas.png").stat().st_size > 1000
    mixed = _frame("measured")
    mixed.loc[0, "source"] = "simulated"
    assert rp.plot_memory(mixed, tmp_path / "mixed.png") is not None


# ---- the report reads the study only (issue 48) ---------------------------------------------------------
SMALL_SPACE = "zero_stage: [0, 1, 2, 3]\nmicro_batch: [1, 2, 4]\nckpt_layers: [0, L]\n"
"""13B on 4 x A100: ZeRO 0 and 1 are pruned by memory at every micro batch, ZeRO 2 and 3 run some."""


def _refuse_the_models(monkeypatch) -> None:
    """memory.estimate and costmodel.simulate raise, wherever a module of autotune holds them by name."""
    import sys

    from autotune import costmodel, memory

    def refuse(*_a, **_k):
        raise AssertionError("the report estimated or simulated: it must read the study only")

    for name, fn in (("estimate", memory.estimate), ("simulate", costmodel.simulate)):
        for mod in [m for n, m in sys.modules.items() if n.startswith("autotune") and m is not None]:
            if getattr(mod, name, None) is fn:
                monkeypatch.setattr(mod, name, refuse)


def test_the_report_reads_the_study_only(tmp_path, monkeypatch):
    """Every file and format of the report from what the search stored, with the memory model and the cost
    model made to raise: a simulated search's study draws the stored figures (the same the models give), and
    a study from before the search stored them (test_report_export.make_study: no terms, no throughput of a
    pruned candidate, no next micro batch) still gives a report, saying what was not recorded."""
    from test_report_export import make_study

    from autotune.costmodel import simulate

    study = _search(
        tmp_path / "sim",
        monkeypatch,
        20,
        model="13b",
        impl="builtin",
        gpus="4xA100",
        executor="simulated",
        space=_space_file(tmp_path),
        exhaustive=True,
    )
    model, cluster, _ = st.specs_of(study)
    with monkeypatch.context() as m:
        _refuse_the_models(m)
        p = rp.pictures(study)
        for fmt in ("table", "csv", "json", "markdown"):
            assert report.render(study, fmt)
        check_files(study, tmp_path / "out")
        md = (tmp_path / "out" / "report.md").read_text()
    assert "not recorded" not in md and "would need" in md and "ZeRO 0 needs at least" in md
    recs = {r.number: r for r in st.records(study)}
    pruned = [b for b in p.memory if b.status == "pruned"]
    assert sorted(recs[b.trial].config.zero_stage for b in pruned) == [0, 1, 2, 3]
    for b in pruned:  # the stored terms are the memory model's, and the closest of their stage to fitting
        e = mem.estimate(model, cluster, recs[b.trial].config)
        assert b.terms == e.terms and b.total_bytes == e.total_bytes > b.capacity_bytes
        z = recs[b.trial].config.zero_stage
        stage = [r for r in recs.values() if r.pruned_by == "memory" and r.config.zero_stage == z]
        assert b.trial == min(stage, key=lambda r: r.estimate["total_bytes"]).number
    for f in p.frontier:
        if f.status == "pruned":
            assert f.throughput_source == "simulated (not run)"
            assert f.throughput == simulate(model, cluster, recs[f.trial].config).samples_per_s
    for t in p.time:
        assert t.source == "simulated (cost model)" and t.step_time_s == pytest.approx(recs[t.trial].result.step_time_s)

    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "old"))
    old = make_study("old")
    with monkeypatch.context() as m:
        _refuse_the_models(m)
        p = rp.pictures(old)
        for fmt in ("table", "csv", "json", "markdown"):
            assert report.render(old, fmt)
        paths = report.write_outputs(old, tmp_path / "old-out")
    assert {"memory_terms.png", "frontier.png", "step_time.png", "report.md", "report.html"} <= {x.name for x in paths}
    assert [b.source for b in p.memory] == ["estimated (terms not recorded)"] * 3  # the three runs, no pruned bar
    assert all(b.total_bytes == recs_total for b, recs_total in zip(p.memory, (72 * GiB, 58 * GiB, 49 * GiB)))
    assert {f.throughput_source for f in p.frontier if f.status == "pruned"} == {"not run: throughput not recorded"}
    md = (tmp_path / "old-out" / "report.md").read_text()
    assert "micro batch 5: not recorded" in md and "**Ruled out**: not recorded" in md


def _space_file(tmp_path: Path) -> Path:
    path = tmp_path / "small.yaml"
    path.write_text(SMALL_SPACE)
    return path
