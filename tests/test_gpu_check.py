"""benchmarks/gpu_check.py without a GPU: the dry run plans and parses every config with DeepSpeed's
own parser, and places every trial through the Ray executor's dry run (the GPU declared); the run loop, rows, checks
and exit code on results made by hand, and once on real CPU trials through the Ray executor, as the GPU run goes."""

from __future__ import annotations

import csv
import importlib.util
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


NAMES = [
    "z0-bf16-k0-mb1",
    None,  # the OOM probe
    "z0-fp16-k0-mb1",
    "z2-bf16-k22-mb1-offload",
    "z3-bf16-k0-mb1",
    "z0-bf16-k0-mb1-torch-adamw",
    "z3-fp16-k22-mb4",
    "z0-bf16-k22-mb4",
]


@pytest.mark.slow
def test_dry_run_plans_the_findings_most_telling_first(dry):
    _, p = dry
    trials = p["trials"]
    assert [t["order"] for t in trials] == [t["group"] for t in trials] == list(range(len(NAMES)))
    assert [t["name"] for t in trials if t["role"] == "trial"] == [n for n in NAMES if n]
    assert trials[1]["role"] == "oom_probe" and trials[1]["name"].startswith("oom-probe-z0-bf16-k0-mb")
    assert any(t["config"]["precision"] == "fp16" for t in trials)  # finding 5
    offload = next(t for t in trials if t["config"]["offload_optimizer"])  # finding 4
    assert offload["gpus"] == "1xH200@16GiB" and offload["deepspeed_config"]["zero_optimization"]["offload_optimizer"]
    assert all(t["why"] for t in trials)
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
        # a GPU config: FusedAdam (or DeepSpeedCPUAdam offloaded), but for the trial of torch's fused AdamW
        fallback = t["name"].endswith("-torch-adamw")
        assert ds["optimizer"]["params"].get("fused", False) == fallback
        assert ds["optimizer"]["params"].get("torch_adam", False) == fallback
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
    assert text.count("| ok: train_batch") == len(NAMES) and "TinyLlama" in text


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


def run_fake(tmp_path, monkeypatch, statuses=None, budget_s=gc.BUDGET_S):
    seen = []
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # what run() sets for finding 1, put back after
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    args = Namespace(out=tmp_path, gpus="1xH200", budget_s=budget_s, wheels=tmp_path)
    code = gc.run(args, runner=fake_runner(statuses or {}, seen), prepare=lambda a: {"install_s": 0.0}, executor=None)
    rows = list(csv.DictReader(open(tmp_path / "gpu_check.csv")))
    return code, rows, seen, (tmp_path / "summary.md").read_text()


def probe_name() -> str:
    """The OOM probe's trial name: its micro batch is the memory model's first that cannot fit."""
    trials = gc.plan(gc.model_spec(), gc.detect_cluster("1xH200"))
    return next(t.name for t in trials if t.role == "oom_probe")


@SLOW_PLAN
def test_a_good_run_passes_and_writes_every_row(tmp_path, monkeypatch):
    probe = probe_name()
    code, rows, seen, summary = run_fake(tmp_path, monkeypatch, {probe: ("oom", CUDA_OOM)})
    assert code == 0 and len(rows) == len(NAMES) and len(seen) == len(NAMES)  # one placement per trial
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
    assert "verifies issue 52's findings 1" in summary  # as the first line printed
    assert len(json.loads((tmp_path / "plan.json").read_text())["trials"]) == len(NAMES)  # the plan beside the rows


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
def test_an_oom_that_is_not_cudas_fails_the_probe(tmp_path, monkeypatch):
    cap = "measured peak of 300 tensor bytes in a training step exceeds the per-rank cap"
    code, rows, _, summary = run_fake(tmp_path, monkeypatch, {probe_name(): ("oom", cap)})
    assert code == 1 and rows[1]["check"] == "FAIL" and "OOM probe: FAIL" in summary


@SLOW_PLAN
def test_a_failed_first_trial_stops_the_run(tmp_path, monkeypatch):
    code, rows, seen, _ = run_fake(tmp_path, monkeypatch, {"z0-bf16-k0-mb1": ("crashed", "RuntimeError: no nvcc")})
    assert code == 1 and len(seen) == 1 and len(rows) == len(NAMES)
    assert rows[0]["check"] == "FAIL" and all(r["check"] == "not run" for r in rows[1:])


@SLOW_PLAN
def test_a_trial_oom_is_a_finding_not_a_failure(tmp_path, monkeypatch):
    statuses = {probe_name(): ("oom", CUDA_OOM), "z3-fp16-k22-mb4": ("oom", CUDA_OOM)}
    code, rows, _, _ = run_fake(tmp_path, monkeypatch, statuses)
    assert code == 0 and {r["trial"]: r for r in rows}["z3-fp16-k22-mb4"]["check"] == "finding"


@SLOW_PLAN
def test_no_trial_starts_past_the_budget(tmp_path, monkeypatch):
    code, rows, seen, summary = run_fake(tmp_path, monkeypatch, budget_s=0.0)
    assert seen == [] and all(r["check"] == "not run" for r in rows) and code == 1
    assert f"not run: {len(NAMES)}" in summary


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
def test_the_run_loop_on_real_cpu_trials_through_the_ray_executor(tmp_path, monkeypatch):
    """The loop on real TrialResults, through the executor `autotune search` starts (Ray, gloo, a tiny Llama): rows
    filled, no rank left. On CPU the probe is stopped by the trial's cap guard, not by CUDA, so its check must say
    FAIL. The driver's DS_ACCELERATOR=cpu (finding 1) is what CPU ranks run with anyway."""
    from types import SimpleNamespace

    from autotune.models import resolve_model

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setattr(gc, "model_spec", lambda: resolve_model("tiny-llama"))
    monkeypatch.setattr(gc, "simulate", lambda m, c, cfg: SimpleNamespace(samples_per_s=1.0, step_time_s=1.0))
    trials = ((0, "bf16", 0, 1, "", "baseline"), (0, "bf16", -1, 1, "", "every layer checkpointed"))
    for name, value in (("SEQ_LEN", 32), ("TRIALS", trials), ("STEPS", 2), ("WARMUP_STEPS", 1)):
        monkeypatch.setattr(gc, name, value)
    args = Namespace(out=tmp_path, gpus="1xcpu@64MiB", budget_s=600, wheels=tmp_path)
    assert gc.run(args, prepare=lambda a: {}) == 1
    rows = {r["trial"]: r for r in csv.DictReader(open(tmp_path / "gpu_check.csv"))}
    assert list(rows) == ["z0-bf16-k0-mb1", next(n for n in rows if n.startswith("oom-probe")), "z0-bf16-k4-mb1"]
    base = rows["z0-bf16-k0-mb1"]
    assert base["status"] == "ok" and base["check"] == "ok" and abs(float(base["peak_error_pct"])) < 5
    assert base["optimizer_impl"] == "torch_adamw" and gc.leftover(tmp_path) == []
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
    wheel(tmp_path, "ray", "2.60.0", "click>=7.0", "jsonschema", "msgpack<2.0.0,>=1.0.0", "cupy; extra == 'cgraph'")
    wheel(tmp_path, "jsonschema", "4.25.1")
    wheel(tmp_path, "pydantic", "2.14.4", "pydantic-core==2.50.5", "email-validator>=2; extra == 'email'")
    for name, version in (
        ("pydantic_core", "2.50.5"),
        ("hjson", "3.1.0"),
        ("nvidia_ml_py", "13.615.71"),
        ("torch", "2.13.0"),
    ):
        wheel(tmp_path, name, version)
    # a GPU machine, say: click and msgpack there, jsonschema not
    here = {"torch": "2.11.0", "pydantic": "1.10.9", "hjson": "3.1.0", "click": "8.1.8", "msgpack": "1.1.0"}
    monkeypatch.setattr(setup, "installed", here.get)
    names = sorted(w.name.split("-")[0] for w in setup._missing(tmp_path))
    assert names == ["deepspeed", "jsonschema", "nvidia_ml_py", "pydantic", "pydantic_core", "ray"]
    here |= {"deepspeed": "0.19.8", "ray": "2.60.0", "jsonschema": "4.25.1"}
    assert setup._missing(tmp_path) == []  # installed: nothing to do
    (tmp_path / "nvidia_ml_py-13.615.71-py3-none-any.whl").unlink()
    here.pop("deepspeed")
    with pytest.raises(SystemExit, match="nvidia-ml-py is needed"):
        setup._missing(tmp_path)


def test_rays_wheel_is_trimmed_to_what_a_cluster_of_trials_loads(tmp_path):
    """Java jars, the dashboard's page and Ray's libraries (rllib, serve, data, tune, train, llm) out, RECORD rewritten
    for what is kept (pip checks each kept file's sha256 and size against it)."""
    import base64
    import hashlib
    import zipfile

    setup = sys.modules["gpu_check_install"]
    path = tmp_path / "ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl"
    files = {
        "ray/__init__.py": b"x = 1\n",
        "ray/_raylet.so": b"\0" * 1000,
        "ray/jars/ray_dist.jar": b"j" * 5000,
        "ray/dashboard/client/build/index.html": b"<html>",
        "ray/dashboard/agent.py": b"# kept: the raylet starts it",
        "ray/rllib/__init__.py": b"",
        "ray/util/placement_group.py": b"y = 2\n",
    }
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr("ray-2.60.0.dist-info/RECORD", "".join(f"{n},,\n" for n in files))
    setup.trim_ray_wheel(path)
    with zipfile.ZipFile(path) as z:
        names = set(z.namelist())
        record = z.read("ray-2.60.0.dist-info/RECORD").decode().splitlines()
        assert names == {
            "ray/__init__.py",
            "ray/_raylet.so",
            "ray/dashboard/agent.py",
            "ray/util/placement_group.py",
            "ray-2.60.0.dist-info/RECORD",
        }
        for line in record[:-1]:
            name, digest, size = line.rsplit(",", 2)
            data = z.read(name)
            assert int(size) == len(data)
            assert digest == "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        assert record[-1] == "ray-2.60.0.dist-info/RECORD,,"


@pytest.mark.slow
def test_the_gpu_check_places_every_trial_through_the_executors_dry_run(tmp_path, monkeypatch):
    """`--dry-run --ray`: the check's trials through the Ray executor on a local Ray with the GPU declared, the
    driver holding DS_ACCELERATOR=cpu; each rank stopped before the first CUDA call. Two trials here (each rank imports
    DeepSpeed: ~15 s on 2 busy cores), the baseline and the offload one."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setattr(gc, "TRIALS", (gc.TRIALS[0], gc.TRIALS[2]))
    monkeypatch.setattr(gc, "oom_micro_batch", lambda *a: 64)  # not traced here: the plan's own test traces it
    out = tmp_path / "out"
    assert gc.main(["--dry-run", "--ray", "--out", str(out)]) == 0
    plans = [json.loads(p.read_text()) for p in sorted(out.glob("trials/*/rank0.json"))]
    assert len(plans) == 3  # the baseline, the probe and the offload trial
    for p in plans:
        plan = p["plan"]
        assert plan["accelerator"] == "cuda" and plan["backend"] == "nccl" and plan["CUDA_VISIBLE_DEVICES"] == "0"
        assert plan["optimizer_impl"] in ("torch_adamw_fused", "cpu_adam")
