"""benchmarks/gpu_check.py without a GPU: the dry run plans and parses every config with DeepSpeed's
own parser; the run loop, rows, checks and exit code on results made by hand (the real trial path is
tested by test_trial.py; here only what the script does with its results)."""

from __future__ import annotations

import csv
import importlib.util
import itertools
import json
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from autotune.errors import SpecError
from autotune.memory import estimate
from autotune.trial.record import TrialResult
from autotune.units import GiB

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
spec = importlib.util.spec_from_file_location("gpu_check", PATH)
gc = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gc  # dataclasses look their module up
spec.loader.exec_module(gc)


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    assert gc.main(["--dry-run", "--out", str(out)]) == 0
    return out, json.loads((out / "plan.json").read_text())


@pytest.mark.slow
def test_dry_run_plans_the_issue_matrix_most_telling_first(dry):
    _, p = dry
    trials = p["trials"]
    assert len(trials) == 17  # 2 x 2 x 2 x 2 + the OOM probe
    assert [t["order"] for t in trials] == list(range(17))
    assert trials[0]["name"] == "z0-bf16-k0-mb1" and trials[0]["group"] == 0
    assert trials[1]["role"] == "oom_probe" and trials[1]["group"] == 1
    regular = {
        (t["config"]["zero_stage"], t["config"]["precision"], t["config"]["ckpt_layers"], t["config"]["micro_batch"])
        for t in trials
        if t["role"] == "trial"
    }
    assert regular == set(itertools.product((0, 3), ("bf16", "fp16"), (0, 22), (1, 4)))
    # one change from the baseline before two: ZeRO-3, fp16, k=L, mb4 are the next four
    assert [t["name"] for t in trials[2:6]] == ["z3-bf16-k0-mb1", "z0-fp16-k0-mb1", "z0-bf16-k22-mb1", "z0-bf16-k0-mb4"]
    sizes = [sum(t["group"] == g for t in trials) for g in range(max(t["group"] for t in trials) + 1)]
    assert sizes[:2] == [1, 1] and all(1 <= s <= gc.GROUP_SIZE for s in sizes)
    assert p["gpus"].startswith("1 x H200") and "1.10B params" in p["model"]
    assert "Transformer" in p["implementation"] or "hf" in p["implementation"].lower()


@pytest.mark.slow
def test_every_config_went_through_deepspeeds_parser(dry):
    _, p = dry
    for t in p["trials"]:
        cfg, parsed, ds = t["config"], t["parsed"], t["deepspeed_config"]
        assert parsed["train_batch_size"] == parsed["micro_batch"] == cfg["micro_batch"]  # world size 1
        assert parsed["zero_stage"] == cfg["zero_stage"]
        assert (parsed["fp16"], parsed["bf16"]) == (cfg["precision"] == "fp16", cfg["precision"] == "bf16")
        assert "torch_adam" not in ds["optimizer"]["params"]  # a GPU config: FusedAdam, as on the GPU
        assert ("activation_checkpointing" in ds) == (cfg["ckpt_layers"] > 0)


@pytest.mark.slow
def test_the_oom_probe_cannot_fit_by_the_estimate_and_only_just(dry):
    _, p = dry
    probe = p["trials"][1]
    cap = 143771 * 2**20  # gpus.yaml: H200
    assert not probe["est_fits"] and probe["est_total_gib"] * GiB >= gc.OOM_MARGIN * cap
    model, cluster = gc.model_spec(), gc.parse_gpus("1xH200")
    smaller = gc.TrainConfig(**{**probe["config"], "micro_batch": probe["config"]["micro_batch"] - 1})
    assert estimate(model, cluster, smaller).total_bytes < gc.OOM_MARGIN * cap
    assert all(t["est_fits"] for t in p["trials"] if t["role"] == "trial")


@pytest.mark.slow
def test_plan_file_lists_every_trial(dry):
    out, p = dry
    text = (out / "plan.md").read_text()
    for t in p["trials"]:
        assert f"| {t['name']} |" in text
    assert text.count("| ok: train_batch") == 17 and "TinyLlama" in text


def test_deepspeeds_parser_does_reject_a_bad_config():
    model, cluster = gc.model_spec(), gc.parse_gpus("1xH200")
    ds = gc.deepspeed_config(gc.TrainConfig(micro_batch=2, seq_len=gc.SEQ_LEN), model, cluster)
    assert gc.validate(ds, 1)["train_batch_size"] == 2
    ds["train_batch_size"] = 3
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        gc.validate(ds, 1)


@pytest.mark.parametrize(
    "device, preset",
    [
        ("NVIDIA H200", "H200"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
        ("NVIDIA GeForce RTX 4090", "RTX4090"),
    ],
)
def test_gpu_name_to_preset(device, preset):
    assert gc.preset_for(device) == preset


def test_unknown_gpu_is_refused():
    with pytest.raises(SpecError, match="no preset"):
        gc.preset_for("NVIDIA B200")


# ---- the run loop, on results made by hand -------------------------------------------------------
CUDA_OOM = "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.24 GiB"


def fake_runner(statuses: dict[str, tuple[str, str]], seen: list):
    """run_trials stand-in: ok with plausible numbers unless `statuses` names the trial."""

    def run(reqs):
        seen.append([r.out_dir.name for r in reqs])
        out = []
        for r in reqs:
            status, reason = statuses.get(r.out_dir.name, ("ok", ""))
            ok = status == "ok"
            out.append(
                TrialResult(
                    status=status,
                    reason=reason,
                    samples_per_s=10.0 if ok else None,
                    peak_bytes=20 * GiB if ok else None,
                    baseline_bytes=GiB // 2,
                    reserved_bytes=22 * GiB if ok else None,
                    losses=[10.4, 9.8] if ok else [],
                    loss_scale=32768.0 if ok and r.config.precision == "fp16" else None,
                    overflow_count=1 if r.config.precision == "fp16" else None,
                    wall_s=5.0,
                )
            )
        return out

    return run


SLOW_PLAN = pytest.mark.slow  # the run loop plans and prices a 1.1B Llama in its own code (~10 s of traces)


def run_fake(tmp_path, statuses=None, budget_s=gc.BUDGET_S):
    seen = []
    args = Namespace(out=tmp_path, gpus="1xH200", budget_s=budget_s, wheels=tmp_path)
    code = gc.run(args, runner=fake_runner(statuses or {}, seen), prepare=lambda a: {"install_s": 0.0})
    rows = list(csv.DictReader(open(tmp_path / "gpu_check.csv")))
    return code, rows, seen, (tmp_path / "summary.md").read_text()


def probe_name() -> str:
    """The OOM probe's trial name: its micro batch is the memory model's first that cannot fit."""
    trials = gc.plan(gc.model_spec(), gc.detect_cluster("1xH200"))
    return next(t.name for t in trials if t.role == "oom_probe")


@SLOW_PLAN
def test_a_good_run_passes_and_writes_every_row(tmp_path):
    probe = probe_name()
    code, rows, seen, summary = run_fake(tmp_path, {probe: ("oom", CUDA_OOM)})
    assert code == 0 and len(rows) == 17 and len(seen) == 6  # 1 + 1 + 4 + 4 + 4 + 3 per group
    assert seen[0] == ["z0-bf16-k0-mb1"] and seen[1] == [probe]
    by = {r["trial"]: r for r in rows}
    assert by[probe]["check"] == "PASS" and by[probe]["status"] == "oom"
    base = by["z0-bf16-k0-mb1"]
    assert float(base["max_allocated_gib"]) == 20.5 and float(base["fragmentation_gib"]) == 1.5
    assert float(base["peak_error_pct"]) == pytest.approx(100 * (20 / float(base["est_tensor_peak_gib"]) - 1), abs=0.1)
    assert float(base["speed_ratio"]) == pytest.approx(10 / float(base["sim_samples_per_s"]), rel=1e-3)
    fp16 = by["z0-fp16-k0-mb1"]
    assert float(fp16["loss_scale_initial"]) == 65536 and float(fp16["loss_scale_final"]) == 32768
    assert base["losses"] == "10.4;9.8" and base["processes_left"] == "0"
    assert "OOM probe: PASS" in summary and "processes left behind: 0" in summary
    assert len(json.loads((tmp_path / "plan.json").read_text())["trials"]) == 17  # the plan beside the rows


def test_allocated_and_reserved_cover_the_same_window():
    """max_memory_reserved spans build, initialize and the steps: so must the allocated peak it is
    compared with, while peak_gib (against the estimate) stays the steps' own."""
    res = TrialResult(
        status="ok", peak_bytes=20 * GiB, init_peak_bytes=25 * GiB, baseline_bytes=GiB, reserved_bytes=27 * GiB
    )
    m = sys.modules["gpu_check_run"].measured(res, gc.TrainConfig(), 27 * GiB, {"device_used_gib": 28.5})
    assert (m["max_allocated_gib"], m["fragmentation_gib"], m["peak_gib"]) == (26, 1, 20)
    assert m["non_allocator_gib"] == 1.5 and m["loss_scale_initial"] is None


@SLOW_PLAN
def test_an_oom_that_is_not_cudas_fails_the_probe(tmp_path):
    cap = "measured peak of 300 tensor bytes in a training step exceeds the per-rank cap"
    code, rows, _, summary = run_fake(tmp_path, {probe_name(): ("oom", cap)})
    assert code == 1 and rows[1]["check"] == "FAIL" and "OOM probe: FAIL" in summary


@SLOW_PLAN
def test_a_failed_first_trial_stops_the_run(tmp_path):
    code, rows, seen, _ = run_fake(tmp_path, {"z0-bf16-k0-mb1": ("crashed", "RuntimeError: no nvcc")})
    assert code == 1 and len(seen) == 1 and len(rows) == 17
    assert rows[0]["check"] == "FAIL" and all(r["check"] == "not run" for r in rows[1:])


@SLOW_PLAN
def test_a_trial_oom_is_a_finding_not_a_failure(tmp_path):
    code, rows, _, _ = run_fake(tmp_path, {probe_name(): ("oom", CUDA_OOM), "z3-bf16-k0-mb4": ("oom", CUDA_OOM)})
    assert code == 0 and {r["trial"]: r for r in rows}["z3-bf16-k0-mb4"]["check"] == "finding"


@SLOW_PLAN
def test_no_group_starts_past_the_budget(tmp_path):
    code, rows, seen, summary = run_fake(tmp_path, budget_s=0.0)
    assert seen == [] and all(r["check"] == "not run" for r in rows) and code == 1
    assert "not run: 17" in summary


def test_leftover_finds_a_live_rank_and_nothing_else(tmp_path):
    import subprocess
    import time

    import psutil

    sleep = "import time; time.sleep(60)"
    rank = subprocess.Popen([sys.executable, "-c", sleep, "-m", "autotune.trial.worker", str(tmp_path / "p.pkl")])
    other = subprocess.Popen([sys.executable, "-c", sleep, str(tmp_path / "p.pkl")])  # names the folder only
    try:
        for _ in range(100):  # until both children have exec'd their own command lines
            if all(str(tmp_path) in " ".join(psutil.Process(p.pid).cmdline()) for p in (rank, other)):
                break
            time.sleep(0.05)
        assert gc.leftover(tmp_path) == [rank.pid]
    finally:
        for p in (rank, other):
            p.kill()
            p.wait()
    assert gc.leftover(tmp_path) == []


@pytest.mark.slow
def test_the_run_loop_on_real_cpu_trials(tmp_path, monkeypatch):
    """The loop on real TrialResults (run_trials, gloo, a tiny Llama): rows filled, no rank left. On
    CPU the probe is stopped by the trial's cap guard, not by CUDA, so its check must say FAIL."""
    from types import SimpleNamespace

    from autotune.models import resolve_model

    monkeypatch.setattr(gc, "model_spec", lambda: resolve_model("tiny-llama"))
    monkeypatch.setattr(gc, "simulate", lambda m, c, cfg: SimpleNamespace(samples_per_s=1.0, step_time_s=1.0))
    for name, value in (
        ("SEQ_LEN", 32),
        ("ZERO", (0,)),
        ("PRECISION", ("bf16",)),
        ("MICRO_BATCH", (1,)),
        ("STEPS", 2),
        ("WARMUP_STEPS", 1),
    ):
        monkeypatch.setattr(gc, name, value)
    args = Namespace(out=tmp_path, gpus="1xcpu@64MiB", budget_s=600, wheels=tmp_path)
    assert gc.run(args, prepare=lambda a: {}) == 1
    rows = {r["trial"]: r for r in csv.DictReader(open(tmp_path / "gpu_check.csv"))}
    assert list(rows) == ["z0-bf16-k0-mb1", next(n for n in rows if n.startswith("oom-probe")), "z0-bf16-k4-mb1"]
    base = rows["z0-bf16-k0-mb1"]
    assert base["status"] == "ok" and base["check"] == "ok" and abs(float(base["peak_error_pct"])) < 5
    assert len(base["losses"].split(";")) == gc.STEPS + gc.WARMUP_STEPS
    probe = rows[next(n for n in rows if n.startswith("oom-probe"))]
    assert probe["status"] == "oom" and "per-rank cap" in probe["reason"] and probe["check"] == "FAIL"
    assert all(r["processes_left"] == "0" for r in rows.values()) and gc.leftover(tmp_path) == []


def wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    import zipfile

    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(
            f"{name}-{version}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {name}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
        )
    return path


def test_install_takes_only_what_is_missing_or_too_old_and_never_torch(tmp_path, monkeypatch):
    setup = sys.modules["gpu_check_install"]
    wheel(tmp_path, "deepspeed", "0.19.8", "torch>=2.0.0", "pydantic>=2.0.0", "hjson", "nvidia-ml-py")
    wheel(tmp_path, "pydantic", "2.14.4", "pydantic-core==2.50.5", "email-validator>=2; extra == 'email'")
    for name, version in (
        ("pydantic_core", "2.50.5"),
        ("hjson", "3.1.0"),
        ("nvidia_ml_py", "13.615.71"),
        ("torch", "2.13.0"),
    ):
        wheel(tmp_path, name, version)
    here = {"torch": "2.11.0", "pydantic": "1.10.9", "hjson": "3.1.0"}  # a GPU machine, say
    monkeypatch.setattr(setup, "installed", here.get)
    names = sorted(w.name.split("-")[0] for w in setup._missing(tmp_path))
    assert names == ["deepspeed", "nvidia_ml_py", "pydantic", "pydantic_core"]
    here |= {"deepspeed": "0.19.8"}
    assert setup._missing(tmp_path) == []  # installed: nothing to do
    (tmp_path / "nvidia_ml_py-13.615.71-py3-none-any.whl").unlink()
    here.pop("deepspeed")
    with pytest.raises(SystemExit, match="nvidia-ml-py is needed"):
        setup._missing(tmp_path)
