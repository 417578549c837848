"""What a new user trips on (issue 49, items 1-7): tracebacks on bad file arguments and storage URLs, exit 0 when
nothing ran, a mislabelled export, a resume that forgot how its study was started, the README's main command run
twice, unlabelled peaks, and small ones. Real studies on real SQLite, searched with the simulated executor (the
cost model) of 13B on 4 x A100, as the README's main command does here: seconds each with the shipped traces."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from autotune import report
from autotune.cli import main
from autotune.errors import SpecError
from autotune.search import open_search
from autotune.search import study as st

pytestmark = pytest.mark.usefixtures("shipped_traces_module")  # decisions on preset estimates, not their tracing
ROOT = Path(__file__).resolve().parent.parent
MAIN = ["search", "--model", "13b", "--gpus", "4xA100", "--no-progress"]  # the README's main command
ONE = "zero_stage: [3]\nmicro_batch: [1]\nckpt_layers: [0]\n"  # one candidate: one simulated trial
NO_RESULT = 3
"""The exit code of a search that ended without a successful run (docs/search.md, "Exit codes")."""


@pytest.fixture
def trials(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "trials"


def _run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def _bad(argv, capsys, *said: str) -> str:
    code, _, err = _run(argv, capsys)
    assert code == 2 and "Traceback" not in err and err.startswith("error: "), err
    for s in said:
        assert s in err, err
    return err


def _completed(name: str) -> int:
    return sum(t.state == optuna.trial.TrialState.COMPLETE for t in st.load_study(name).trials)


# ---- 1. tracebacks -------------------------------------------------------------------------------
def test_storage_without_its_driver_is_a_clear_error(trials, capsys):
    err = _bad(MAIN + ["--study", "pg", "--storage", "postgresql://me:secret@localhost/db"], capsys, "driver")
    assert "secret" not in err  # the URL's password is not printed
    assert not (trials / "pg").exists()


def test_a_directory_where_a_file_is_expected_is_a_clear_error(trials, tmp_path, capsys):
    folder = tmp_path / "folder"
    folder.mkdir()
    _bad(MAIN + ["--study", "sd", "--space", str(folder)], capsys, "is a directory")
    _bad(MAIN + ["--study", "sq", "--storage", f"sqlite:///{folder}"], capsys, "is a directory")
    plain = tmp_path / "plain"
    plain.write_text("x")
    _bad(["trial", "--model", "tiny-llama", "--gpus", "2xcpu", "--out", str(plain)], capsys, "is a file")
    # a file argument of another command (plan's --prices) that no check of its own catches
    _bad(["plan", "--model", "13b", "--tokens", "1e9", "--gpus", "4xA100", "--prices", str(folder)], capsys)


def test_export_writes_all_its_outputs_or_none(trials, tmp_path, capsys):
    space = tmp_path / "lora.yaml"
    space.write_text(ONE + "method: [lora]\n")
    assert main(MAIN + ["--study", "l", "--space", str(space)]) == 0
    folder = tmp_path / "folder"
    folder.mkdir()
    plain = tmp_path / "plain"
    plain.write_text("x")
    ds = tmp_path / "out" / "ds.json"
    for argv, said in (
        (["--out", str(folder)], "is a directory"),
        (["--out", str(ds), "--accelerate-config", str(folder)], "is a directory"),  # after the JSON and .lora.json
        (["--out", str(plain / "ds.json")], "is a file"),
        (["--out", str(ds), "--accelerate-config", str(ds)], "the same file"),
    ):
        capsys.readouterr()
        _bad(["export", "--study", "l", *argv], capsys, said, "wrote nothing")
        assert sorted(p.name for p in tmp_path.rglob("*") if "trials" not in p.parts) == sorted(
            ["lora.yaml", "folder", "plain"]
        ), argv  # nothing written, no folder made, no temporary left
    assert main(["export", "--study", "l", "--out", str(ds), "--accelerate-config", str(tmp_path / "acc.yaml")]) == 0
    assert {p.name for p in ds.parent.iterdir()} == {"ds.json", "ds.lora.json"} and (tmp_path / "acc.yaml").exists()


# ---- 2. exit 0 when nothing ran ------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv,why",
    [
        (["--gpus", "4xA100@1GiB", "--space", "one.yaml"], "nothing fits"),  # 13B on 1 GiB devices: all pruned
        (["--timeout", "0", "--space", "one.yaml"], "--timeout"),  # the budget ends before the first trial
    ],
)
def test_a_search_without_a_successful_run_exits_3_without_an_export_hint(trials, tmp_path, capsys, argv, why):
    (tmp_path / "one.yaml").write_text(ONE)
    code, out, _ = _run(["search", "--model", "13b", "--gpus", "4xA100", "--no-progress", *argv], capsys)
    assert code == NO_RESULT
    assert "export the winner" not in out and "autotune export" not in out
    assert "nothing to export" in out and why in out


def test_exit_codes_are_documented(capsys):
    with pytest.raises(SystemExit):
        main(["search", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"{NO_RESULT} the search ended and the study has no successful run" in text
    from autotune.cli import search

    assert search.NO_RESULT == NO_RESULT
    assert "130 interrupted" in text and "2 bad input" in text
    docs = " ".join((ROOT / "docs" / "search.md").read_text().split())
    assert f"| {NO_RESULT} |" in docs and "130" in docs


# ---- 3. export labels the objective --------------------------------------------------------------
def test_export_labels_the_value_by_the_studys_objective(trials, tmp_path, capsys):
    space = tmp_path / "one.yaml"
    space.write_text(ONE)
    assert main(MAIN + ["--study", "tok", "--space", str(space), "--objective", "tokens"]) == 0
    capsys.readouterr()
    assert main(["export", "--study", "tok", "--out", str(tmp_path / "ds.json")]) == 0
    out = capsys.readouterr().out
    res = st.record_of(st.load_study("tok").best_trial).result
    assert res.tokens_per_s >= 1000 and res.samples_per_s < 1000  # written 7,802 and 3.81
    said = f"{res.tokens_per_s:,.0f} tokens/s and {res.samples_per_s:.4g} samples/s (ranked by tokens/s)"
    assert said in out.splitlines()[0]


# ---- 4. a resume keeps the study's settings, and the report's words stay true ---------------------
def _interrupted_after(session, results: int) -> None:
    """Run `session` and press Ctrl-C while its trial number `results` runs (a KeyboardInterrupt in the wait, as
    SIGINT raises it there): the executor is the real simulated one, only its wait is wrapped."""
    wait, seen = session.executor.wait_any, []

    def wait_any(timeout_s=None):
        seen.append(1)
        if len(seen) == results:
            raise KeyboardInterrupt
        return wait(timeout_s)

    session.executor.wait_any = wait_any
    with session, pytest.raises(KeyboardInterrupt):
        session.run(progress=False)


@pytest.mark.slow  # an exhaustive 13B search interrupted and resumed (~4 s)
def test_resume_keeps_exhaustive_and_the_report_says_what_became_of_the_interrupted(trials):
    with open_search(model="13b", gpus="4xA100", study="count") as s:
        fitting = len(s.search.plan.available(set()))  # the feasible groups, one run each
    _interrupted_after(open_search(model="13b", gpus="4xA100", study="ex", exhaustive=True), results=2)
    study = st.load_study("ex")
    cut = [r for r in st.records(study) if r.status == "interrupted"]
    assert len(cut) == 1 and fitting > 2
    before = report.render(study)

    with open_search(study="ex", resume=True) as s:  # no flags: the study's own settings
        summary = s.run(progress=False)
    assert summary.stop == "exhausted" and summary.ok == fitting  # every feasible group, not the stopping rule's few
    assert s.settings.exhaustive and any("the study's own" in n for n in s.notes)  # and it said so
    # the report's words: before the resume, what a resume will do; after it, what it did
    assert "not run again yet: a --resume runs it" in before and "it runs again on --resume" not in before
    text = report.render(st.load_study("ex"))
    again = [r for r in st.records(st.load_study("ex")) if r.config == cut[0].config and r.status == "ok"]
    assert f"run again as trial {again[0].number} (ok)" in text and "not run again" not in text


def test_the_report_says_so_when_the_stopping_rule_left_an_interrupted_trial_unrun(trials):
    """The issue's case: Ctrl-C of an --exhaustive search, then a resume under the stopping rule, which ends
    without the interrupted configuration; the report said it 'runs again on --resume'."""
    _interrupted_after(open_search(model="13b", gpus="4xA100", study="ex", exhaustive=True), results=2)
    with open_search(study="ex", resume=True, exhaustive=False) as s:
        assert s.run(progress=False).stop == "bound"
    text = report.render(st.load_study("ex"))
    assert "while it ran; not run again: the stopping rule ended the search without it" in text
    assert "runs again on --resume" not in text


def test_a_setting_given_again_replaces_the_studys_and_says_so(trials, tmp_path):
    space = tmp_path / "two.yaml"
    space.write_text("zero_stage: [3]\nmicro_batch: [1, 2]\nckpt_layers: [0, 40]\n")
    with open_search(model="13b", gpus="4xA100", study="t", space=space, exhaustive=True, n_trials=1) as s:
        s.run(progress=False)
    assert st.settings_of(st.load_study("t")) == st.Settings(exhaustive=True, n_trials=1)
    with open_search(study="t", resume=True, exhaustive=False, tolerance=0.05) as s:
        assert "  --no-exhaustive replaces the study's --exhaustive" in s.notes
        assert "  --tolerance 5% replaces the study's --tolerance 2%" in s.notes
        assert s.settings == st.Settings(exhaustive=False, tolerance=0.05, n_trials=1)  # n-trials kept
        assert s.run(progress=False).stop == "n-trials"
    assert st.settings_of(st.load_study("t")).tolerance == 0.05  # the study remembers the latest


def test_other_concurrent_trials_on_a_measured_study_are_refused(trials):
    from autotune.hardware import parse_gpus
    from autotune.models import resolve_model
    from autotune.search.space import parse_space

    space = parse_space(ONE)
    attrs = st.study_attrs(
        resolve_model("tiny-llama"),
        parse_gpus("2xcpu"),
        seq_len=64,
        global_batch=None,
        space_text=space.text,
        space_path="one.yaml",
        source="measured",
        settings=st.Settings(),
    )
    st.create_study("m", None, attrs, sampler=None)
    with pytest.raises(SpecError, match="measured its trials 1 at a time; --concurrent-trials 2"):
        open_search(study="m", resume=True, concurrent_trials=2)  # refused before any executor starts


# ---- 5. the README's main command, twice -----------------------------------------------------------
@pytest.mark.slow  # the README's main command twice (~6 s)
def test_the_main_command_twice_continues_its_study_and_shows_the_result(trials, capsys):
    code, first, _ = _run(MAIN, capsys)
    assert code == 0
    name = "llama-2-13b_4xA100"
    runs = _completed(name)
    code, second, err = _run(MAIN, capsys)
    assert code == 0, err
    assert f"study '{name}' exists with the same model, GPUs" in second and "continuing it" in second
    assert "SIMULATED by the cost model, not measured" in second
    assert _completed(name) == runs  # nothing ran again: the stopping rule had decided
    table = lambda out: out[out.index("rank trial") : out.index("report: ")]  # noqa: E731
    assert table(second) == table(first)  # the stored result
    assert f"export the winner: autotune export --study {name}" in second
    # a conflicting study is refused, naming what conflicts
    err = _bad(MAIN + ["--seq-len", "1024"], capsys, "already exists", "--seq-len 1024 (the study: 2048)", "--resume")
    assert "--gpus" not in err and "--model" not in err


@pytest.mark.slow  # two processes; the test above runs the same in this one
def test_the_readme_command_twice_through_run_on_the_shipped_traces(tmp_path):
    """`./run search --model 13b --gpus 4xA100` as the README gives it, twice, each a new process."""
    env = {**os.environ, "AUTOTUNE_TRIALS_DIR": str(tmp_path / "trials"), "PYTHONPATH": str(ROOT)}
    cmd = [str(ROOT / "run"), "search", "--model", "13b", "--gpus", "4xA100", "--no-progress"]
    if not Path(os.environ.get("AUTOTUNE_VENV", ROOT / ".venv"), "bin", "autotune").exists():
        cmd = [sys.executable, "-m", "autotune", *cmd[1:]]  # `./run` would build its .venv first
    outs = [subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600) for _ in "12"]
    assert [p.returncode for p in outs] == [0, 0], outs[1].stderr[-2000:]
    assert "continuing it" in outs[1].stdout and "export the winner" in outs[1].stdout


# ---- 6. both peaks, each labelled ----------------------------------------------------------------
@pytest.mark.slow  # a 13B search and its report (~3 s)
def test_the_report_labels_both_peaks(trials):
    assert main(MAIN + ["--study", "p"]) == 0
    md = (trials / "p" / "report.md").read_text()
    why = md[md.index("## Why") : md.index("## Pictures")]
    rec = next(r for r in st.records(st.load_study("p")) if r.status == "ok")
    tensor, total = rec.estimate["tensor_bytes"] / 2**30, rec.estimate["total_bytes"] / 2**30
    assert total > tensor
    assert f"peak {total:.2f} GiB with the framework allowance" in why
    assert f"tensor peak {tensor:.2f} GiB (the table's) + allowance {total - tensor:.2f} GiB" in why
    assert "(with the framework allowance, estimated;" in why.split("**Ruled out**")[1]  # the stages' needs too
    header = next(line for line in md.splitlines() if line.startswith("| rank"))
    assert "tensor peak GiB (estimated)" in header and "tensor peak GiB (simulated)" in header


# ---- 7. small ones --------------------------------------------------------------------------------
def test_models_footer_says_what_works(capsys):
    assert main(["models"]) == 0
    footer = capsys.readouterr().out.split("\n\n")[-1]
    assert "AutoModelForCausalLM" in footer and "qwen2" in footer and "docs/models.md" in footer


def test_study_name_message_does_not_offer_what_it_refuses(trials, capsys):
    for name in (".", "..", "_x"):
        _bad(MAIN + ["--study", name], capsys, "must start with a letter or a digit")


def test_an_empty_space_file_is_refused(trials, tmp_path, capsys):
    for i, text in enumerate(("", "# only a comment\n", "{}\n")):
        empty = tmp_path / f"empty{i}.yaml"
        empty.write_text(text)
        _bad(MAIN + ["--study", f"e{i}", "--space", str(empty)], capsys, "is empty")
    assert not trials.exists() or not list(trials.iterdir())


@pytest.mark.slow  # a fresh CLI process importing torch and transformers (~7 s)
def test_a_refused_config_shows_its_error_alone(tmp_path):
    cfg = tmp_path / "config.json"
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    cfg.write_text(json.dumps({"model_type": "llama", **shape, "vocab_size": 0}))
    p = subprocess.run(
        [sys.executable, "-m", "autotune", "estimate", "--model", str(cfg), "--gpus", "2xcpu"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2
    assert p.stderr.splitlines() == [f"error: model {cfg}: vocab_size must be a positive integer, got 0"]
