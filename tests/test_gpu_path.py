"""The CUDA path made right before a GPU runs it (issue 52), tested on this CPU machine: each of the issue's eight
findings at its root (the DeepSpeed JSON, the node's facts, the rank environment, the guards, the fp16 step times, the
capacity, the remote nodes, out-of-memory classes, the profiler and the memory probe), and the rank dry run on GPUs
that Ray declares on a machine without any (a local cluster, and two nodes of ray.cluster_utils joined by address)."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from autotune import executors
from autotune.deepspeed_config import deepspeed_config
from autotune.errors import SpecError
from autotune.hardware import parse_gpus
from autotune.models import resolve_model
from autotune.train_config import TrainConfig
from autotune.trial import launch, memprof, worker
from autotune.trial.record import RankReport, TrialRequest
from autotune.units import GiB

ROOT = Path(__file__).resolve().parents[1]


class _Ops:
    """autotune.trial.ops, imported when a test uses it (so that each test, not the module, fails without it)."""

    def __getattr__(self, name):
        from autotune.trial import ops as module

        return getattr(module, name)


ops = _Ops()
MODEL = resolve_model("tiny-llama")
A100x4 = parse_gpus("4xA100")
CFG = TrainConfig(zero_stage=2, precision="bf16", seq_len=32)


A100x1 = parse_gpus("1xA100")


def parsed(ds: dict):
    """`ds` through DeepSpeed's own config parser, in this process without a process group: world size 1 (a
    one-GPU cluster's JSON; tests/test_report_export.py parses larger worlds in a process group of its own)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(json.loads(json.dumps(ds)))


# ---- finding 2: FusedAdam or torch's fused AdamW, one function for the trial and the export -------------------
def test_without_fusedadam_deepspeed_builds_torchs_fused_adamw_from_the_json():
    """The fallback's JSON, read by DeepSpeed's own code: get_optimizer_configuration returns torch.optim.AdamW for
    `torch_adam`, and the params it leaves (with `fused`) are that constructor's arguments."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    ds = deepspeed_config(CFG, MODEL, A100x1, "torch_adamw_fused")
    assert ds["optimizer"]["params"]["torch_adam"] is True and ds["optimizer"]["params"]["fused"] is True
    params = dict(parsed(ds).optimizer_params)
    cls, extra = DeepSpeedEngine.get_optimizer_configuration(None, params, True)
    opt = cls([torch.zeros(4, requires_grad=True)], **params, **extra)
    assert cls is torch.optim.AdamW and opt.defaults["fused"] is True and opt.defaults["lr"] == 3e-4
    # the default on GPUs is still FusedAdam: no torch_adam key, which DeepSpeed reads as FusedAdam
    assert "torch_adam" not in deepspeed_config(CFG, MODEL, A100x4)["optimizer"]["params"]
    with pytest.raises(ValueError, match="cannot run"):
        deepspeed_config(CFG, MODEL, parse_gpus("2xcpu"), "fused_adam")


def test_fused_adam_is_decided_as_deepspeeds_op_builder_decides(tmp_path, monkeypatch):
    """This machine's torch has no CUDA: no FusedAdam. With a CUDA torch, DeepSpeed's own check decides on nvcc's
    version: CUDA 12 tolerates a minor mismatch, CUDA 13 none (builder.py cuda_minor_mismatch_ok)."""
    import torch.utils.cpp_extension as cpp

    ok, why = ops.fused_adam.__wrapped__()
    assert not ok and "without CUDA" in why
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    monkeypatch.setattr(cpp, "CUDA_HOME", str(tmp_path))
    cases = [("13.0", "13.1", False), ("12.4", "12.6", True), ("13.0", "13.0", True)]
    for have, torch_cuda, expected in cases:
        nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {have}, V{have}.1'\n")
        nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
        monkeypatch.setattr(torch.version, "cuda", torch_cuda)
        ok, why = ops.fused_adam.__wrapped__()
        assert ok == (expected and cpp.is_ninja_available()), (have, torch_cuda, why)
    nvcc.unlink()
    ok, why = ops.fused_adam.__wrapped__()
    assert not ok and "no CUDA compiler" in why


def test_one_optimizer_for_every_node_of_a_trial():
    fused, plain = {"host": "a", "fused_adam": True}, {"host": "b", "fused_adam": False}
    assert ops.optimizer_impl(CFG, A100x4, [fused, fused]) == "fused_adam"
    assert ops.optimizer_impl(CFG, A100x4, [fused, plain]) == "torch_adamw_fused"
    assert ops.optimizer_impl(dataclasses.replace(CFG, offload_optimizer=True), A100x4, [plain]) == "cpu_adam"
    assert ops.optimizer_impl(CFG, parse_gpus("2xcpu"), []) == "torch_adamw"


# ---- finding 3: bitsandbytes, an optional extra refused clearly; the JSON right for ZeRO ----------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_8bit_adamw_json_lets_zero_take_bitsandbytes(stage):
    """DeepSpeed asserts at ZeRO 1-3 that a client optimizer is one it tested (engine.py
    _do_optimizer_sanity_check) unless zero_allow_untested_optimizer is set; bitsandbytes' is not in its list."""
    cfg = TrainConfig(zero_stage=stage, precision="bf16", optimizer="adamw8bit", seq_len=32)
    ds = deepspeed_config(cfg, MODEL, A100x1)
    assert "optimizer" not in ds
    assert parsed(ds).zero_allow_untested_optimizer == (stage >= 1)


def test_8bit_adamw_without_bitsandbytes_is_refused_before_any_rank_starts(tmp_path):
    pytest.importorskip("deepspeed")
    if ops.bitsandbytes()[0]:
        pytest.skip("bitsandbytes is installed here")
    req = TrialRequest(
        model=MODEL,
        cluster=parse_gpus("1xA100"),
        config=TrainConfig(precision="bf16", optimizer="adamw8bit", seq_len=32),
        out_dir=tmp_path,
    )
    with pytest.raises(SpecError, match=r"needs bitsandbytes .* pip install 'autotune\[bnb\]'"):
        launch.with_optimizer(req)
    extras = (ROOT / "pyproject.toml").read_text()
    assert 'bnb = ["bitsandbytes' in extras


# ---- finding 4: the host-RAM guard of GPU ranks comes from the node's memory ----------------------------------
def test_rss_cap_of_gpu_ranks_is_the_nodes_ram_not_the_gpus_memory():
    ram = psutil.virtual_memory().total
    assert launch.rss_cap(A100x4, 4) == ram // 4 - launch.RSS_ALLOWANCE_BYTES
    assert launch.rss_cap(A100x4, 4, node_ram_bytes=512 * GiB) == 128 * GiB - launch.RSS_ALLOWANCE_BYTES
    cpu = parse_gpus("2xcpu@1GiB")
    assert launch.rss_cap(cpu, 2) == cpu.capacity_bytes  # CPU ranks: the device is the host


# ---- finding 5: fp16 steps skipped for an overflow are neither timed nor mixed with the warm-up -----------------
def test_skipped_fp16_steps_are_left_out_of_the_step_time(tmp_path):
    cfg = TrainConfig(precision="fp16", seq_len=32)
    req = TrialRequest(model=MODEL, cluster=parse_gpus("1xA100"), config=cfg, out_dir=tmp_path, steps=4, warmup_steps=2)
    report = RankReport(
        status="ok",
        losses=[10.0] * 6,
        step_times_s=[1.0, 0.2, 1.0, 1.2],  # the 0.2 s step made no update
        step_skipped=[True, True, False, True, False, False],
        step_loss_scales=[65536.0, 32768.0, 32768.0, 16384.0, 16384.0, 16384.0],
        loss_scale=16384.0,
        overflow_count=3,
    )
    res = launch.aggregate(req, launch.NodeOutcome(ranks={0: report}))
    assert res.step_time_s == 1.0 and res.step_time_spread_s == pytest.approx(0.2)
    assert (res.overflow_count, res.warmup_overflow_count, res.skipped_steps) == (1, 2, [1])
    assert res.step_loss_scales[-1] == 16384.0
    every = dataclasses.replace(report, step_skipped=[False, False, True, True, True, True])
    assert launch.aggregate(req, launch.NodeOutcome(ranks={0: every})).status == "diverged"


def test_steplog_marks_the_optimizer_steps_deepspeed_skipped():
    """StepLog reads DeepSpeed's own counters around engine.step(): global_steps moves at each gradient-accumulation
    boundary, skipped or not, skipped_steps with it on an overflow (runtime/engine.py _take_model_step). A stand-in
    engine with those two counters (glue only: no GPU runs fp16 here), two micro batches per step."""

    class Engine:
        def __init__(self, overflow_at):
            self.global_steps = self.skipped_steps = self.micro = 0
            self.overflow_at, self.optimizer = overflow_at, type("Opt", (), {"loss_scale": 65536.0})()

        def step(self):
            self.micro += 1
            if self.micro % 2 == 0:  # the boundary: one optimizer step
                if self.global_steps in self.overflow_at:
                    self.skipped_steps += 1
                    self.optimizer.loss_scale /= 2
                self.global_steps += 1

    engine = Engine(overflow_at={0, 3})
    log = worker.StepLog(engine)
    for _ in range(5 * 2):
        engine.step()
    assert log.skipped == [True, False, False, True, False]
    assert log.scales == [32768.0, 32768.0, 32768.0, 16384.0, 16384.0]


# ---- finding 6: the capacity the devices report, and the devices --gpus names --------------------------------
def test_capacity_and_type_come_from_the_devices_torch_sees():
    from autotune.executors.ray_executor import devices_seen

    nodes = [{"NodeManagerAddress": "10.0.0.1", "Resources": {"GPU": 4.0}}]
    # torch's total for an A100-80GB: about 79.1-79.3 GiB (issue 52), below the driver's 81,920 MiB of the preset
    torch_total = int(79.2 * GiB)
    cluster, note = devices_seen(
        A100x4, nodes, [{"count": 4, "name": "NVIDIA A100-SXM4-80GB", "total_bytes": torch_total}]
    )
    assert cluster.capacity_bytes == torch_total and "79.20 GiB" in note
    with pytest.raises(SpecError, match="torch sees no CUDA device"):
        devices_seen(A100x4, nodes, [{"count": 0}])
    with pytest.raises(SpecError, match="not the A100-80GB"):
        devices_seen(A100x4, nodes, [{"count": 4, "name": "NVIDIA H100 80GB HBM3", "total_bytes": 85 * 10**9}])


# ---- finding 7 (the environment part): what every rank of every node gets -------------------------------------
def test_the_driver_exports_what_deepspeeds_launcher_exports(tmp_path):
    env = {"NCCL_IB_HCA": "mlx5", "UCX_TLS": "rc", "PYTHONPATH": "/x", "MV2_X": "1", "HOME_X": "no", "CUDA_HOME": "no"}
    (tmp_path / ".deepspeed_env").write_text("NCCL_SOCKET_IFNAME=eth1\nFOO=bar\n")
    out = launch.exported_env(env, cwd=tmp_path)
    assert out == {"NCCL_IB_HCA": "mlx5", "UCX_TLS": "rc", "PYTHONPATH": "/x", "MV2_X": "1",
                   "NCCL_SOCKET_IFNAME": "eth1", "FOO": "bar"}  # fmt: skip


# ---- finding 8: out-of-memory outside the caching allocator, the profiler, the memory probe ----------------------
@pytest.mark.parametrize(
    "message, oom",
    [
        ("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported", True),
        ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", True),
        (
            "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with NCCL_DEBUG=INFO for details), "
            "NCCL version 2.27.3\nncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
            "Cuda failure 2 'out of memory'",
            True,
        ),
        ("CUDA error: an illegal memory access was encountered", False),
        ("RuntimeError: shapes do not match", False),
    ],
)
def test_out_of_memory_outside_the_allocator_is_oom(message, oom):
    assert worker.is_out_of_memory(RuntimeError(message)) == oom
    try:
        try:
            raise RuntimeError(message)
        except RuntimeError as inner:
            raise ValueError("wrapped") from inner
    except ValueError as e:
        assert worker.is_out_of_memory(e) == oom


def test_profile_on_a_gpu_is_kineto_not_the_legacy_cuda_event_profiler():
    import contextlib

    from torch.autograd.profiler import profile as autograd_profile
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as kineto

    gpu = worker.profiler(on_gpu=True, profile=True)
    assert isinstance(gpu, kineto) and ProfilerActivity.CUDA in gpu.activities
    assert isinstance(worker.profiler(on_gpu=True, profile=False), contextlib.nullcontext)
    cpu = worker.profiler(on_gpu=False, profile=False)
    assert isinstance(cpu, autograd_profile) and cpu.profile_memory  # on CPU the profiler is the measurement


def test_the_per_phase_memory_probe_does_not_synchronize(monkeypatch):
    """The allocator's counters are host-side (c10/cuda/CUDACachingAllocator.cpp): reading them needs no sync. Only
    the counters are replaced here (no GPU); what is counted is how often GpuPhases synchronizes per micro batch."""
    calls = {"sync": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.__setitem__("sync", calls["sync"] + 1))
    for name, value in (("memory_allocated", 100), ("max_memory_allocated", 300), ("max_memory_reserved", 400)):
        monkeypatch.setattr(torch.cuda, name, lambda *a, v=value: v)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    phases = worker.Phases(memprof.GpuPhases(torch.device("cuda:0")))
    before = calls["sync"]
    for name in ("forward", "backward", "optimizer"):  # one micro batch
        with phases(name):
            pass
    assert calls["sync"] == before and phases.peaks == {"forward": 200, "backward": 200, "optimizer": 200}


@pytest.mark.slow
def test_a_cuda_oom_outside_the_allocator_ends_a_real_trial_as_oom(tmp_path):
    from autotune.trial import run_trial

    res = run_trial(
        TrialRequest(
            model=MODEL,
            cluster=parse_gpus("1xcpu"),
            config=CFG,
            out_dir=tmp_path,
            steps=1,
            warmup_steps=1,
            fault="cuda-oom",
            timeout_s=120,
        )
    )
    assert res.status == "oom" and "CUDA error: out of memory" in res.reason, res.reason + res.log_tail


# ---- issue 49 item 1: an unreachable --ray-address ---------------------------------------------------------------
def test_an_unreachable_ray_address_is_a_clear_error_at_once(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(SpecError, match="cannot reach a Ray cluster there"):
        executors.choose("ray", parse_gpus("1xcpu"), "127.0.0.1:1")
    assert time.monotonic() - t0 < 2
    with pytest.raises(SpecError, match="HOST:PORT"):
        executors.choose("ray", parse_gpus("1xcpu"), "nonsense")
    env = {**os.environ, "AUTOTUNE_TRIALS_DIR": str(tmp_path)}
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "autotune", "search", "--model", "tiny-llama", "--gpus", "1xcpu"]
    run = subprocess.run(cmd + ["--ray-address", "127.0.0.1:1"], env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert run.returncode == 2 and "cannot reach a Ray cluster" in run.stderr, run.stderr
    assert len(run.stderr.splitlines()) <= 3 and "gcs_client" not in run.stderr
    assert took < 60, took  # the interpreter and autotune's imports; Ray itself is never started


# ---- the rank dry run on declared GPUs ---------------------------------------------------------------------------
def dry_request(cluster, out: Path, trial_id: int, **kw) -> TrialRequest:
    return TrialRequest(model=MODEL, cluster=cluster, config=CFG, out_dir=out, trial_id=trial_id, timeout_s=180, **kw)


def ranks_of(res) -> list[dict]:
    return sorted((p for k, p in res.rank_plans.items() if not k.startswith("node")), key=lambda p: int(p["RANK"]))


@pytest.mark.slow
def test_dry_run_on_a_local_ray_with_declared_gpus(tmp_path, monkeypatch):
    """Two trials of 2 x A100 side by side on a local Ray of 4 declared GPUs, the driver's shell holding
    DS_ACCELERATOR=cpu (./run exported it) and an NCCL setting."""
    from autotune.executors.ray_executor import RayExecutor

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    two = parse_gpus("2xA100")
    ex = RayExecutor(two, concurrent_trials=2, dry_run=True)
    try:
        assert ex.slots() == 2 and ex.source == "dry-run"
        tickets = {ex.submit(dry_request(two, tmp_path / f"t{i}", i)) for i in range(2)}
        results = {}
        end = time.monotonic() + 300
        while len(results) < 2 and time.monotonic() < end:
            results.update(ex.wait_any(timeout_s=1.0))
        assert set(results) == tickets
        visible = []
        for res in results.values():
            assert res.status == "dry-run" and res.source == "dry-run", res.reason + res.log_tail
            assert res.step_time_s is None and res.samples_per_s is None  # nothing measured
            ranks = ranks_of(res)
            assert [(p["RANK"], p["LOCAL_RANK"], p["WORLD_SIZE"]) for p in ranks] == [("0", "0", "2"), ("1", "1", "2")]
            assert len({(p["MASTER_ADDR"], p["MASTER_PORT"]) for p in ranks}) == 1 and ranks[0]["MASTER_PORT"]
            for p in ranks:
                assert p["DS_ACCELERATOR"] == "cuda" and p["accelerator"] == "cuda"  # not the shell's cpu
                assert p["backend"] == p["accelerator_backend"] == "nccl" and p["device"] == f"cuda:{p['LOCAL_RANK']}"
                assert p["optimizer_impl"] == "torch_adamw_fused"  # this torch has no CUDA: the fallback
                assert p["exported"]["NCCL_DEBUG"] == "WARN"
                assert p["host_ram_cap_bytes"] == psutil.virtual_memory().total // 2
                assert p["threads"] >= 1 and p["OMP_NUM_THREADS"] == str(p["threads"])
            visible.append(ranks[0]["CUDA_VISIBLE_DEVICES"])
            ds = json.loads(Path(ranks[0]["deepspeed_config"]).read_text())
            assert ds["optimizer"]["params"]["fused"] is True and res.optimizer_impl == "torch_adamw_fused"
        ids = [set(v.split(",")) for v in visible]
        assert all(len(i) == 2 for i in ids) and not ids[0] & ids[1]  # disjoint GPUs for concurrent trials
        text = ex.dry_run_text()
        assert text.startswith("DRY RUN: nothing was measured") and "torch_adamw_fused" in text
    finally:
        ex.close()


@pytest.fixture
def two_gpu_nodes(monkeypatch):
    """A CPU-only head node (1 CPU) and two nodes of 2 declared GPUs and 4 CPUs each, started before the driver's
    shell sets an NCCL variable, so that only the job's runtime_env can bring it to their workers."""
    import ray
    from ray.cluster_utils import Cluster as RayCluster

    from autotune.executors import ray_auth

    ray_auth.secure_local_cluster()
    rc = RayCluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "num_gpus": 0, "include_dashboard": False, "object_store_memory": 256 << 20},
    )
    for _ in range(2):
        rc.add_node(num_cpus=4, num_gpus=2, object_store_memory=256 << 20)
    rc.wait_for_nodes()
    monkeypatch.setenv("NCCL_AUTOTUNE_TEST", "from-the-driver")
    yield rc
    if ray.is_initialized():
        ray.shutdown()
    rc.shutdown()


@pytest.mark.slow
def test_dry_run_on_two_gpu_nodes_joined_by_address(two_gpu_nodes, tmp_path):
    from autotune.executors.ray_executor import RayExecutor

    cluster = parse_gpus("2x2xA100")
    kind, how = executors.choose("ray", cluster, two_gpu_nodes.address, dry_run=True)
    assert kind == "ray" and "DRY RUN" in how
    ex = RayExecutor(cluster, ray_address=two_gpu_nodes.address, dry_run=True)
    try:
        # threads from the GPU nodes (4 CPUs for 2 ranks), not from the CPU-only head node's 1
        assert ex.cpus_per_rank == 2
        ticket = ex.submit(dry_request(cluster, tmp_path / "two", 0))
        results = {}
        end = time.monotonic() + 300
        while not results and time.monotonic() < end:
            results.update(ex.wait_any(timeout_s=1.0))
        res = results[ticket]
        assert res.status == "dry-run", res.reason + res.log_tail
        ranks = ranks_of(res)
        assert [p["RANK"] for p in ranks] == ["0", "1", "2", "3"]
        assert [p["LOCAL_RANK"] for p in ranks] == ["0", "1", "0", "1"]
        assert len({(p["MASTER_ADDR"], p["MASTER_PORT"]) for p in ranks}) == 1
        assert len(set(res.nodes)) == 2  # STRICT_SPREAD: one Ray node per cluster node
        for p in ranks:
            assert p["exported"].get("NCCL_AUTOTUNE_TEST") == "from-the-driver"  # reached both nodes
            assert p["threads"] == 2 and p["OMP_NUM_THREADS"] == "2"
            assert p["backend"] == "nccl" and p["accelerator"] == "cuda"
    finally:
        ex.close()
    with pytest.raises(SpecError, match=r"needs 3 Ray node\(s\) with 2 GPU"):
        RayExecutor(parse_gpus("3x2xA100"), ray_address=two_gpu_nodes.address, dry_run=True)


@pytest.mark.slow
@pytest.mark.usefixtures("shipped_traces")
def test_the_issues_dry_run_command(tmp_path):
    """`autotune search --model 13b --gpus 4xA100 --executor ray --dry-run` as issue 52 gives it, on this machine as it
    is: a local Ray with 4 GPUs declared, one trial's rank plan, no study stored; --resume is refused with it."""
    from autotune.search import study as st

    env = {**os.environ, "AUTOTUNE_TRIALS_DIR": str(tmp_path)}
    # a real study of the name the dry run takes: it must be left as it is (its --resume unaffected)
    os.environ["AUTOTUNE_TRIALS_DIR"] = str(tmp_path)
    try:
        model, cluster = resolve_model("13b"), A100x4
        attrs = st.study_attrs(
            model, cluster, seq_len=2048, global_batch=None, space_text="", space_path="t", source="measured"
        )
        st.create_study(st.default_name(model, cluster), None, attrs, sampler=None)
    finally:
        del os.environ["AUTOTUNE_TRIALS_DIR"]
    db = tmp_path / st.default_name(model, cluster) / "study.db"
    before = db.read_bytes()
    cmd = [sys.executable, "-m", "autotune", "search", "--model", "13b", "--gpus", "4xA100", "--executor", "ray"]
    run = subprocess.run(cmd + ["--dry-run"], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    assert "DRY RUN" in out and "4 GPU(s)" in out and "nothing was measured" in out
    rows = [
        ln.split() for ln in out.splitlines() if ln.startswith("  ") and ln.split()[:1] in (["0"], ["1"], ["2"], ["3"])
    ]
    assert [r[0] for r in rows] == ["0", "1", "2", "3"] and all("nccl" in r and "cuda" in r for r in rows)
    assert list(tmp_path.rglob("study.db")) == [db] and db.read_bytes() == before  # the real study untouched
    assert list(tmp_path.rglob("dry-run/*/rank0.json"))
    again = subprocess.run(cmd + ["--dry-run", "--resume"], env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "--dry-run reads and writes no study" in again.stderr


def test_export_writes_the_json_for_the_optimizer_the_trial_ran(tmp_path, monkeypatch):
    """A trial that ran torch's fused AdamW (FusedAdam could not be built on its nodes) exports that JSON, through
    the same deepspeed_config, and says which optimizer it names."""
    import optuna
    from optuna.trial import TrialState

    from autotune.report.export import export
    from autotune.search import study as st

    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path))
    attrs = st.study_attrs(
        MODEL, A100x1, seq_len=32, global_batch=None, space_text="", space_path="t", source="measured"
    )
    study = st.create_study("fallback", None, attrs, sampler=None)
    dists = st.distributions([CFG])
    result = {"status": "ok", "source": "measured", "samples_per_s": 10.0, "optimizer_impl": "torch_adamw_fused"}
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.COMPLETE,
            value=10.0,
            params=st.params_of(CFG, dists),
            distributions=dists,
            user_attrs={"config": CFG.to_dict(), "status": "ok", "source": "measured", "result": result},
        )
    )
    _, _, text = export(study, tmp_path / "ds.json")
    ds = json.loads((tmp_path / "ds.json").read_text())
    assert ds == deepspeed_config(CFG, MODEL, A100x1, "torch_adamw_fused", style="trainer")
    assert ds["optimizer"]["params"]["fused"] is True and "torch.optim.AdamW(fused=True)" in text
