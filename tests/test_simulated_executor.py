"""The simulated executor: the Executor contract, results that say they are simulated, OOM from the
real memory model (Llama-2-13B on 4 x A100-80GB: ZeRO-3 fits, ZeRO-1 does not), and the cost model's
numbers."""

from __future__ import annotations

import json

import pytest

from autotune.costmodel import simulate
from autotune.executors import simulated as sim
from autotune.hardware import parse_gpus
from autotune.memory import estimate
from autotune.models import resolve_model
from autotune.train_config import TrainConfig
from autotune.trial.record import TrialRequest

MODEL, CLUSTER = resolve_model("13b"), parse_gpus("4xA100")


def request(tmp_path, i=0, **kw) -> TrialRequest:
    cfg = TrainConfig(**{"zero_stage": 3, "ckpt_layers": 40, "seq_len": 2048, **kw})
    return TrialRequest(model=MODEL, cluster=CLUSTER, config=cfg, out_dir=tmp_path / f"trial-{i}")


def test_ok_result_carries_the_cost_model_numbers(tmp_path):
    with sim.SimulatedExecutor() as ex:
        assert ex.source == "simulated" and ex.slots() >= 64
        ticket = ex.submit(request(tmp_path, micro_batch=2))
        [(got, res)] = ex.wait_any()
    step = simulate(MODEL, CLUSTER, TrainConfig(zero_stage=3, ckpt_layers=40, micro_batch=2, seq_len=2048))
    assert got == ticket
    assert res.status == "ok" and res.source == "simulated"
    assert "simulated" in res.reason and "simulated" in res.log_tail
    assert res.samples_per_s == pytest.approx(step.samples_per_s)
    assert res.tokens_per_s == pytest.approx(step.samples_per_s * 2048)
    assert res.step_time_s == pytest.approx(step.step_time_s)
    assert res.mfu == pytest.approx(step.mfu) and res.tflops == pytest.approx(step.tflops_per_gpu)
    record = json.loads((tmp_path / "trial-0" / "simulated.json").read_text())
    assert record["source"] == "simulated" and record["cost_model"]["step_time_s"] > 0


def test_oom_when_the_memory_model_says_it_does_not_fit(tmp_path):
    with sim.SimulatedExecutor(write_files=False) as ex:
        ex.submit(request(tmp_path, zero_stage=1))
        [(_, res)] = ex.wait_any()
    assert res.status == "oom" and res.source == "simulated"
    assert res.reason == "simulated: estimate exceeds capacity"
    est = estimate(MODEL, CLUSTER, TrainConfig(zero_stage=1, ckpt_layers=40, seq_len=2048))
    assert not est.fits and res.samples_per_s is None and res.peak_bytes == est.tensor_peak_bytes


def test_many_in_flight_and_wait_any_returns_all(tmp_path):
    ex = sim.SimulatedExecutor(write_files=False)
    tickets = {ex.submit(request(tmp_path, i, micro_batch=mb)) for i, mb in enumerate((1, 2, 4))}
    done = ex.wait_any()
    assert {t for t, _ in done} == tickets and len(tickets) == 3
    assert ex.wait_any(timeout_s=0.0) == []
    speeds = [r.samples_per_s for _, r in sorted(done)]
    assert speeds == sorted(speeds)  # bigger micro batches, faster (sim-0 is mb 1)


def test_invalid_config_comes_back_crashed_with_why(tmp_path):
    req = TrialRequest(
        model=MODEL, cluster=parse_gpus("4xV100"), config=TrainConfig(zero_stage=3), out_dir=tmp_path / "t"
    )
    res = sim.simulated_result(req)
    assert res.status == "crashed" and "bf16" in res.reason and res.source == "simulated"


@pytest.mark.parametrize("fault,status", [("nan", "diverged"), ("hang", "timeout"), ("crash", "crashed")])
def test_fault_hooks(tmp_path, fault, status):
    req = TrialRequest(model=MODEL, cluster=CLUSTER, config=TrainConfig(zero_stage=3), out_dir=tmp_path, fault=fault)
    res = sim.simulated_result(req)
    assert res.status == status and res.source == "simulated"


def test_ok_result_reports_the_memory_models_tensor_peak(tmp_path):
    res = sim.simulated_result(request(tmp_path, micro_batch=1))
    est = estimate(MODEL, CLUSTER, TrainConfig(zero_stage=3, ckpt_layers=40, micro_batch=1, seq_len=2048))
    assert est.fits and res.status == "ok" and res.peak_bytes == est.tensor_peak_bytes
