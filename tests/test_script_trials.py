"""The user's own script as the trial (`autotune search --script`, `autotune trial --script`; autotune/trial/script.py,
script_rank.py) and `autotune export --verify` (autotune/report/verify.py): real searches of examples/train_hf.py and
examples/train_deepspeed.py on two CPU ranks (Ray, DeepSpeed, the Trainer), and what the script's JSON is made of.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cases import TINY_LLAMA

from autotune.cli import main
from autotune.errors import SpecError
from autotune.hardware import parse_gpus
from autotune.models import resolve_model
from autotune.search import study as st
from autotune.train_config import TrainConfig
from autotune.trial.record import TrialRequest
from autotune.trial.script import script_config, script_spec

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SPACE = """\
zero_stage: [0]
precision: [fp32]
micro_batch: [1, 4]
ckpt_layers: [0]
grad_accum: [1]
trial:
  steps: 3
  warmup_steps: 1
  timeout: 3m
"""
"""Two candidates whose samples/s differ by about 2-3x on two CPU ranks, so the ranking is not noise."""


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A folder holding the tiny model's config.json and the space; trials/ under it."""
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY_LLAMA))
    (tmp_path / "space.yaml").write_text(SPACE)
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    return tmp_path


def _request(here: Path, spec, **cfg) -> TrialRequest:
    model = resolve_model(str(here / "tiny" / "config.json"))
    cluster = parse_gpus("2xcpu")
    return TrialRequest(
        model=model,
        cluster=cluster,
        config=TrainConfig(seq_len=64, precision="fp32", **cfg),
        out_dir=here / "t",
        steps=3,
        warmup_steps=2,
        script=spec,
    )


def test_script_json_keeps_the_users_template_and_stops_after_the_measured_steps(here):
    spec = script_spec(EXAMPLES / "train_deepspeed.py", "--seq_len 64", config=EXAMPLES / "ds_config.json")
    ds = script_config(_request(here, spec, micro_batch=4, zero_stage=2))
    template = json.loads((EXAMPLES / "ds_config.json").read_text())
    # the user's keys kept: their optimizer's hyperparameters, their scheduler, their progress log
    assert ds["scheduler"] == template["scheduler"] and ds["steps_per_print"] == template["steps_per_print"]
    assert ds["optimizer"]["params"]["lr"] == template["optimizer"]["params"]["lr"]
    assert ds["gradient_clipping"] == template["gradient_clipping"]
    # the tuned ones changed
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["zero_optimization"]["stage"] == 2
    # DeepSpeed exits inside step() once global_steps == end_profile_step + 1 (runtime/engine.py): after 2 + 3 steps
    assert ds["autotuning"]["enabled"] and ds["autotuning"]["end_profile_step"] == 4
    assert spec.trainer_args is False and spec.args == ("--seq_len", "64")


def test_script_json_in_the_trainers_style_by_default(here):
    spec = script_spec(EXAMPLES / "train_hf.py")
    ds = script_config(_request(here, spec, micro_batch=2))
    assert ds["train_micro_batch_size_per_gpu"] == "auto" and ds["gradient_accumulation_steps"] == "auto"
    assert all(ds["optimizer"]["params"][k] == "auto" for k in ("lr", "betas", "eps", "weight_decay"))
    assert spec.trainer_args and spec.config_flag == "--deepspeed"


def test_script_bad_input_is_a_spec_error(here, capsys):
    with pytest.raises(SpecError, match="no such file"):
        script_spec(here / "missing.py")
    (here / "bad.json").write_text("{not json")
    with pytest.raises(SpecError, match="not JSON"):
        script_spec(EXAMPLES / "train_hf.py", config=here / "bad.json")
    with pytest.raises(SpecError, match="unbalanced|quotation|closing"):
        script_spec(EXAMPLES / "train_hf.py", '--x "open')
    model = str(here / "tiny" / "config.json")
    assert main(["trial", "--model", model, "--gpus", "2xcpu", "--script-args", "--x 1"]) == 2
    assert "--script-args needs --script" in capsys.readouterr().err


def _search(here: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "autotune", "search", "--model", str(here / "tiny" / "config.json")]
    cmd += ["--gpus", "2xcpu", "--seq-len", "64", "--space", str(here / "space.yaml"), "--no-progress", *extra]
    env = {**os.environ, "AUTOTUNE_TRIALS_DIR": str(here / "trials"), "DS_ACCELERATOR": "cpu"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _check_ranked_by_measured_samples(study, script_name: str, ran: int | None) -> st.TrialRecord:
    runs = [r for r in st.records(study) if r.status == "ok"]
    assert len(runs) == ran if ran else 1 <= len(runs) <= 2
    for r in runs:
        res = r.result
        assert res.script.startswith(script_name) and res.implementation == f"script:{script_name}"
        # the script's own engine ran the candidate, and samples/s is its batch over its measured step time
        assert res.engine["micro_batch"] == r.config.micro_batch and res.engine["train_batch_size"] == 2 * (
            r.config.micro_batch
        )
        assert (
            r.value
            == pytest.approx(res.samples_per_s)
            == pytest.approx(res.engine["train_batch_size"] / res.step_time_s)
        )
        assert res.peak_bytes and res.engine["steps_run"] == 4  # 1 warm-up + 3 measured, then DeepSpeed's exit
        assert res.engine["deepspeed_metric"]  # DeepSpeed's own autotuning metric, written by rank 0
    best = max(runs, key=lambda r: r.value)
    assert study.best_trial.number == best.number
    return best


@pytest.mark.slow
def test_search_script_deepspeed_stops_ranks_and_exports(here, tmp_path):
    script = ["--script", str(EXAMPLES / "train_deepspeed.py"), "--script-config", str(EXAMPLES / "ds_config.json")]
    script += ["--script-config-flag", "deepspeed_config", "--script-args"]
    script += [f"--seq_len 64 --model_config {here / 'tiny' / 'config.json'}"]
    # --exhaustive: both candidates run (the stopping rule may end this space after one: the next test)
    p = _search(here, *script, "--study", "ds", "--exhaustive")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "stopped: every feasible candidate is decided" in p.stdout
    assert "script: train_deepspeed.py" in p.stdout
    study = st.load_study("ds")
    best = _check_ranked_by_measured_samples(study, "train_deepspeed.py", ran=2)
    got = json.loads((here / "trials" / "ds" / f"trial-{best.number:04d}" / "deepspeed_config.json").read_text())
    assert got["scheduler"]["type"] == "WarmupLR"  # the user's template, kept
    assert "script: train_deepspeed.py" in (here / "trials" / "ds" / "report.md").read_text()
    # the same command continues the study (nothing runs again); another script's arguments are refused
    again = _search(here, *script, "--study", "ds")
    assert again.returncode == 0 and "continuing it" in again.stdout
    assert len([r for r in st.records(st.load_study("ds")) if r.status == "ok"]) == 2
    resumed = subprocess.run(
        [sys.executable, "-m", "autotune", "search", "--resume", "--study", "ds", "--no-progress"],
        cwd=ROOT,
        env={**os.environ, "AUTOTUNE_TRIALS_DIR": str(here / "trials"), "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0 and "script: train_deepspeed.py" in resumed.stdout  # --resume: the study's script
    other = _search(here, *script[:-1], "--seq_len 32", "--study", "ds")
    assert other.returncode == 2 and "--script" in other.stderr
    out = tmp_path / "winner.json"
    # a plain deepspeed.initialize script takes the concrete export (DeepSpeed resolves no "auto")
    assert main(["export", "--study", "ds", "--out", str(out), "--concrete"]) == 0
    assert json.loads(out.read_text())["train_micro_batch_size_per_gpu"] == best.config.micro_batch


@pytest.mark.slow
def test_search_script_trainer_stops_ranks_exports_and_verifies(here, tmp_path, capsys):
    model_arg = f"--seq_len 64 --model_config {here / 'tiny' / 'config.json'}"
    p = _search(here, "--script", str(EXAMPLES / "train_hf.py"), "--script-args", model_arg, "--study", "hf")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "stopped: " in p.stdout and "script: train_hf.py" in p.stdout  # by itself: no --n-trials, no --timeout
    study = st.load_study("hf")
    best = _check_ranked_by_measured_samples(study, "train_hf.py", ran=None)
    got = json.loads((here / "trials" / "hf" / f"trial-{best.number:04d}" / "deepspeed_config.json").read_text())
    assert got["optimizer"]["params"]["lr"] == "auto"  # the Trainer's style: its own hyperparameters train
    out = tmp_path / "winner.json"
    capsys.readouterr()
    # the winner through the Trainer with the exported file, on the study's 2 CPU ranks
    assert main(["export", "--study", "hf", "--out", str(out), "--verify"]) == 0
    said = capsys.readouterr().out
    assert f"verify: trial {best.number}'s configuration" in said and ": ok" in said
    assert "samples/s" in said and "(measured, the Trainer)" in said and "peak" in said
    verify_dir = next((here / "trials" / "hf").glob("verify-*"))
    res = json.loads((verify_dir / "result.json").read_text())
    assert (
        res["status"] == "ok" and res["samples_per_s"] > 0 and res["engine"]["micro_batch"] == best.config.micro_batch
    )


@pytest.mark.slow
def test_trial_script_failure_keeps_the_scripts_output(here, capsys):
    bad = here / "bad_train.py"
    bad.write_text("print('my script starts', flush=True)\nraise RuntimeError('my data is missing')\n")
    rc = main(
        ["trial", "--model", str(here / "tiny" / "config.json"), "--gpus", "2xcpu", "--seq-len", "64"]
        + ["--script", str(bad), "--out", str(here / "t"), "--json", "--timeout", "120"]
    )
    assert rc == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "crashed" and "my data is missing" in doc["reason"]
    assert "my script starts" in doc["log_tail"] and doc["script"] == "bad_train.py"


@pytest.mark.slow
def test_trial_script_that_hangs_is_a_timeout_and_leaves_nothing_running(here, capsys):
    import psutil

    hang = here / "hang_train.py"
    hang.write_text("import time\nprint('my script waits', flush=True)\ntime.sleep(600)\n")
    rc = main(
        ["trial", "--model", str(here / "tiny" / "config.json"), "--gpus", "2xcpu", "--seq-len", "64"]
        + ["--script", str(hang), "--out", str(here / "t"), "--json", "--timeout", "25"]
    )
    assert rc == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "timeout" and "my script waits" in doc["log_tail"]
    left = [p for p in psutil.process_iter(["cmdline"]) if str(here / "t") in " ".join(p.info["cmdline"] or [])]
    assert not left


@pytest.mark.slow
def test_trial_script_over_the_cap_is_oom_measured(here, capsys):
    # 2 MiB per rank: the tiny Llama's weights, grads and Adam states alone are ~3 MiB (fp32), so the script's
    # measured peak is over the cap
    rc = main(
        ["trial", "--model", str(here / "tiny" / "config.json"), "--gpus", "2xcpu@2MiB", "--seq-len", "64"]
        + ["--precision", "fp32", "--script", str(EXAMPLES / "train_deepspeed.py"), "--script-config"]
        + [str(EXAMPLES / "ds_config.json"), "--script-config-flag", "deepspeed_config", "--steps", "2"]
        + ["--warmup-steps", "1", "--script-args", f"--seq_len 64 --model_config {here / 'tiny' / 'config.json'}"]
        + ["--out", str(here / "t"), "--json"]
    )
    assert rc == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["status"] == "oom" and "exceeds the per-rank cap of 2,097,152 bytes" in doc["reason"]
    assert doc["peak_bytes"] > 2 * 2**20


NAN_SCRIPT = """\
import argparse, json
import deepspeed, torch
from transformers import AutoConfig, AutoModelForCausalLM
p = argparse.ArgumentParser()
p.add_argument("--model_config")
p.add_argument("--deepspeed")
a = p.parse_args()
ds = json.load(open(a.deepspeed))
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a.model_config))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
x = torch.randint(0, 256, (engine.train_micro_batch_size_per_gpu(), 64))
for _ in range(100):
    loss = engine(input_ids=x, labels=x).loss * float("nan")
    engine.backward(loss)
    engine.step()
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["diverged", "ignores the JSON"])
def test_trial_script_diverged_and_one_that_ignores_the_json(here, capsys, case):
    model = str(here / "tiny" / "config.json")
    if case == "diverged":
        script = here / "nan_train.py"
        script.write_text(NAN_SCRIPT)
        extra = ["--script", str(script), "--script-config", str(EXAMPLES / "ds_config.json")]
        extra += ["--script-args", f"--model_config {model}"]
    else:  # the Trainer without the candidate's batch arguments fills "auto" with its default, 8 per device
        extra = ["--script", str(EXAMPLES / "train_hf.py"), "--no-script-trainer-args"]
        extra += ["--script-args", f"--model_config {model} --seq_len 64"]
    rc = main(
        ["trial", "--model", model, "--gpus", "2xcpu", "--seq-len", "64", "--precision", "fp32", "--micro-batch", "2"]
        + ["--steps", "2", "--warmup-steps", "1", "--out", str(here / "t"), "--json", *extra]
    )
    assert rc == 1
    doc = json.loads(capsys.readouterr().out)
    if case == "diverged":
        assert doc["status"] == "diverged" and "non-finite loss" in doc["reason"]
    else:
        assert doc["status"] == "crashed" and "did not run the candidate" in doc["reason"]
        assert "micro_batch 8 (the candidate's: 2)" in doc["reason"]
