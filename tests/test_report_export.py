"""Report and export on real Optuna studies in real SQLite files, with numbers chosen by hand;
the export checked by DeepSpeed's own config parser; the exploration notebook executed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from autotune import report
from autotune.cli import main
from autotune.deepspeed_config import deepspeed_config
from autotune.hardware import parse_gpus
from autotune.models import resolve_model
from autotune.search import study as st
from autotune.train_config import TrainConfig
from autotune.units import GiB

ROOT = Path(__file__).resolve().parent.parent

# trial number -> (config, state, status, samples/s, measured peak GiB, estimated peak GiB, pruned_by)
ROWS = [
    (dict(zero_stage=2, micro_batch=2, ckpt_layers=20), "COMPLETE", "ok", 30.0, 60.0, 58.0, None),
    (dict(zero_stage=3, micro_batch=4, ckpt_layers=10), "COMPLETE", "ok", 40.0, 70.0, 72.0, None),
    (dict(zero_stage=3, micro_batch=1, ckpt_layers=0), "COMPLETE", "ok", 20.0, 50.0, 49.0, None),
    (dict(zero_stage=1, micro_batch=1, ckpt_layers=0), "PRUNED", "pruned", None, None, 95.0, "memory"),
    (dict(zero_stage=3, micro_batch=4, ckpt_layers=11), "PRUNED", "pruned", None, None, 70.0, "dominated"),
    (dict(zero_stage=3, micro_batch=8, ckpt_layers=20), "FAIL", "oom", None, None, 79.0, None),
]


def make_study(name: str, source: str = "measured", precision: str = "bf16") -> optuna.Study:
    model, cluster = resolve_model("13b"), parse_gpus("4xA100")
    attrs = st.study_attrs(
        model, cluster, seq_len=2048, global_batch=None, space_text="", space_path="t", source=source
    )
    study = st.create_study(name, None, attrs, sampler=None)
    cands = [TrainConfig(**c, precision=precision, seq_len=2048) for c, *_ in ROWS]
    dists = st.distributions(cands)
    for cfg, (_, state, status, sps, peak, est, by) in zip(cands, ROWS):
        res = {
            "status": status,
            "source": source,
            "samples_per_s": sps,
            "tokens_per_s": sps and sps * 2048,
            "peak_bytes": peak and int(peak * GiB),
            "log_tail": "tail",
        }
        ua = {
            "config": cfg.to_dict(),
            "status": status,
            "source": source,
            "estimate": {
                "tensor_bytes": int(est * GiB),
                "total_bytes": int(est * GiB),
                "capacity_bytes": 80 * GiB,
                "dominant_term": "activations",
            },
            "reason": "out of memory in backward" if status == "oom" else "",
            "result": res,
        }
        if by:
            ua["pruned_by"] = by
        study.add_trial(
            optuna.trial.create_trial(
                state=TrialState[state], value=sps, params=st.params_of(cfg, dists), distributions=dists, user_attrs=ua
            )
        )
    return study


@pytest.fixture
def trials_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "trials"


def test_ranked_table_labels_every_number(trials_dir):
    study = make_study("r")
    table = report.ranked(report.trials_frame(study))
    assert list(table["trial"]) == [1, 0, 2]  # 40 > 30 > 20 samples/s
    assert list(table["samples/s (measured)"]) == [40.0, 30.0, 20.0]
    assert list(table["tokens/s (measured)"]) == [40.0 * 2048, 30.0 * 2048, 20.0 * 2048]
    assert list(table["tensor peak GiB (estimated)"]) == [72.0, 58.0, 49.0]
    assert list(table["tensor peak GiB (measured)"]) == [70.0, 60.0, 50.0]
    assert list(table["rank"]) == [1, 2, 3] and list(table["ckpt layers"]) == [10, 20, 0]
    counts = report.outcome_counts(report.trials_frame(study))
    assert sum(counts["pruned"].values()) == 2 and sum(counts["failed"].values()) == 1
    assert counts["failed"] == {"oom: out of memory in backward": 1}
    sim = report.ranked(report.trials_frame(make_study("sim", source="simulated")))
    assert "samples/s (simulated)" in sim.columns and "MFU % (simulated)" in sim.columns


@pytest.mark.slow  # draws the pictures (matplotlib)
def test_formats_and_files(trials_dir, capsys):
    make_study("f")
    for fmt in ("table", "csv", "json", "markdown"):
        assert main(["report", "--study", "f", "--format", fmt, "--top", "2"]) == 0
        out = capsys.readouterr().out
        if fmt == "json":
            data = json.loads(out)
            assert [r["trial"] for r in data["ranked"]] == [1, 0] and data["source"] == "measured"
            assert sum(data["pruned"].values()) == 2
        elif fmt == "csv":
            assert out.splitlines()[0].startswith("rank,trial,samples/s (measured)") and len(out.splitlines()) == 3
        else:
            assert "samples/s (measured)" in out and "pruned: 2" in out and "failed: 1" in out
    d = trials_dir / "f"
    assert (d / "report.md").read_text().startswith("# study f:")
    assert "![throughput](throughput.png)" in (d / "report.md").read_text()
    assert len((d / "trials.csv").read_text().splitlines()) == 1 + len(ROWS)
    for png in ("throughput.png", "memory.png"):
        assert (d / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report"]) == 0 and "study f:" in capsys.readouterr().out  # default: most recent
    make_study("later")
    assert main(["report", "--study", "f"]) == 0  # reading f and rewriting its files does not make it newer
    capsys.readouterr()
    assert main(["report"]) == 0 and "study later:" in capsys.readouterr().out


def test_export_best_and_given_trial(trials_dir, tmp_path, capsys):
    study = make_study("e")
    out = tmp_path / "ds.json"
    assert main(["export", "--study", "e", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    cfg = TrainConfig(zero_stage=3, micro_batch=4, ckpt_layers=10, precision="bf16", seq_len=2048)
    assert json.loads(out.read_text()) == deepspeed_config(
        cfg, resolve_model("13b"), parse_gpus("4xA100"), style="trainer"
    )
    assert "trial 1" in text and "deepspeed --num_gpus 4 train.py --deepspeed_config" in text
    assert "per_device_train_batch_size=4" in text and "gradient_accumulation_steps=1" in text
    assert "model.model.layers[10:]" in text  # k = 10 of 40 layers: partial checkpointing
    assert main(["export", "--study", "e", "--trial", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Activation checkpointing: none" in text
    # "auto" in the Trainer's JSON: the tuned micro batch reaches the Trainer as its argument
    assert json.loads(out.read_text())["train_micro_batch_size_per_gpu"] == "auto"
    assert "per_device_train_batch_size=1," in text
    for bad in ("3", "5", "99"):  # pruned, failed, absent: exit 2
        assert main(["export", "--study", "e", "--trial", bad, "--out", str(out)]) == 2
    assert "did not run successfully" in capsys.readouterr().err
    assert study.trials[1].value == 40.0


VALIDATE = r"""
import json, os, sys, tempfile
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed, deepspeed.ops
# docs/platform.md: skip the shared-memory comm op's 40 s compile at init_distributed
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
import torch.distributed as dist
from deepspeed.runtime.config import DeepSpeedConfig

dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
deepspeed.init_distributed(dist_backend="gloo")


class DataParallel:  # DeepSpeedConfig takes the data-parallel world size from an mpu
    def get_data_parallel_world_size(self):
        return int(sys.argv[2])

    def get_data_parallel_rank(self):
        return 0


c = DeepSpeedConfig(sys.argv[1], mpu=DataParallel())
print(json.dumps({"world": c.world_size, "train_batch": c.train_batch_size, "stage": c.zero_optimization_stage,
                  "fp16": c.float16_config.enabled, "bf16": c.bfloat16_config.enabled,
                  "scale_power": c.float16_config.initial_scale_power,
                  "window": c.float16_config.loss_scale_window, "clip": c.gradient_clipping}))
"""


@pytest.mark.slow
def test_exported_json_is_accepted_by_deepspeeds_config_class(trials_dir, tmp_path):
    make_study("fp16", precision="fp16")
    out = tmp_path / "ds.json"
    assert main(["export", "--study", "fp16", "--out", str(out), "--concrete"]) == 0  # numbers: DeepSpeed alone
    run = subprocess.run(
        [sys.executable, "-c", VALIDATE, str(out), "4"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    parsed = json.loads(run.stdout.strip().splitlines()[-1])
    assert parsed == {
        "world": 4,
        "train_batch": 16,
        "stage": 3,
        "fp16": True,
        "bf16": False,
        "scale_power": 16,
        "window": 2000,
        "clip": 1.0,
    }
    bad = json.loads(out.read_text())
    bad["train_batch_size"] += 1  # the parser does check: an inconsistent batch fails
    out.write_text(json.dumps(bad))
    run = subprocess.run(
        [sys.executable, "-c", VALIDATE, str(out), "4"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert run.returncode != 0 and "train_batch_size is not equal" in run.stderr


@pytest.mark.slow
def test_notebook_runs_on_a_study(trials_dir, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    make_study("nb")
    nb = nbformat.read(ROOT / "notebooks" / "explore_study.ipynb", as_version=4)
    monkeypatch.setenv("AUTOTUNE_STUDY", "nb")  # the kernel inherits the environment
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(trials_dir.parent)}}
    ).execute()
    text = json.dumps([c.get("outputs", []) for c in nb.cells])
    assert "study nb:" in text and "3 runs with a peak" in text and "image/png" in text
    assert "peak" in text and "GiB of" in text  # the report_pictures cell printed its memory bars
