"""The stopping rule (autotune/stopping.py) in the real search loop: a real Optuna study in SQLite, the
real memory model, and an executor that answers from a formula (pure glue: the throughput of a
candidate is what the rule reasons about, so it is given, not measured)."""

from __future__ import annotations

import dataclasses
import json
import math

import optuna
import pytest

from autotune import study as st
from autotune.cli import main
from autotune.executors.base import Executor
from autotune.hardware import parse_gpus
from autotune.memory import estimate
from autotune.models import from_hf_config
from autotune.report import render
from autotune.search import Search
from autotune.search_space import expand, parse_space
from autotune.stopping import ResidualModel, error_kernel, t_quantile
from autotune.train_config import TrainConfig
from autotune.trial.record import TrialResult

TINY = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
        "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256}
SPACE = "zero_stage: [0, 1, 2, 3]\nprecision: [fp32]\nmicro_batch: [1, 2, 4, 8, 16]\nckpt_layers: [0, 2, 4]\n"
SEQ = 64


def prior(c: TrainConfig) -> float:
    """What the search believes: larger micro batches amortise, checkpointing recomputes, ZeRO-3 gathers."""
    return c.micro_batch / (1 + 0.15 * c.micro_batch) / (1 + 0.08 * c.ckpt_layers) * (0.85 if c.zero_stage == 3 else 1)


class Table(Executor):
    """samples/s = prior x truth(cfg). Pure glue."""

    def __init__(self, truth):
        self.truth, self.seen, self.pending = truth, [], {}

    def slots(self) -> int:
        return 1

    def submit(self, request) -> str:
        c = request.config
        self.seen.append(c)
        self.pending[str(len(self.seen))] = TrialResult(status="ok", samples_per_s=prior(c) * self.truth(c))
        return str(len(self.seen))

    def wait_any(self, timeout_s=None):
        done, self.pending = list(self.pending.items()), {}
        return done


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    model = dataclasses.replace(from_hf_config(cfg), implementation="builtin")
    return model, parse_gpus("2xcpu@64GiB"), parse_space(SPACE)


def _search(env, truth, name, **kw):
    model, cluster, space = env
    attrs = st.study_attrs(model, cluster, seq_len=SEQ, global_batch=None, space_text=space.text,
                           space_path="test", source="measured")
    study = st.create_study(name, None, attrs, sampler=None)
    ex = Table(truth)
    return Search(study, model, cluster, space, ex, seq_len=SEQ, prior=prior, **kw), ex


def _true_best(env, truth) -> float:
    model, cluster, space = env
    return max(prior(c) * truth(c) for c in expand(space, model, cluster, seq_len=SEQ).candidates
               if estimate(model, cluster, c).fits)


def test_an_exact_prior_stops_early_and_says_why_in_the_summary_the_study_and_the_report(env):
    exact = lambda c: 1.0  # noqa: E731
    s, ex = _search(env, exact, "exact")
    summary = s.run(progress=False)
    full, ex_all = _search(env, exact, "all", exhaustive=True)
    full.run(progress=False)
    assert summary.stop == "bound" and full.summary.stop == "exhausted"
    assert len(ex.seen) < len(ex_all.seen) / 2                     # 20 groups; the rule needs a few
    assert summary.best_value == pytest.approx(_true_best(env, exact))
    b = s.study.user_attrs["stopping"]
    assert b["rule"] == "bound" and b["stop"] and b["largest_bound"] <= 0.02 and b["tolerance"] == 0.02
    assert b["groups_run"] == len(ex.seen) and b["groups"] == len(ex_all.seen)
    line = b["line"]
    assert line.startswith(f"no unrun candidate can beat trial {summary.best_trial} by more than 2% (largest bound ")
    assert f"{len(ex.seen)} of {len(ex_all.seen)} groups run" in line
    assert line in render(s.study)


def test_a_prior_that_ranks_the_best_last_does_not_stop_before_it(env):
    # the truth reverses the prior's micro-batch trend at every stage, and ZeRO-1 is 30% faster than
    # it thinks: the prior's first picks (large micro batches) are its worst
    def truth(c):
        return (1 + 0.15 * c.micro_batch) / (1 + 0.15) / c.micro_batch ** 0.5 * (1.3 if c.zero_stage == 1 else 1)

    s, ex = _search(env, truth, "reversed")
    summary = s.run(progress=False)
    assert summary.best_value >= 0.98 * _true_best(env, truth)
    first = prior(ex.seen[0]) * truth(ex.seen[0])
    assert first < 0.8 * summary.best_value                       # the first pick was far off; it went on


def test_tolerance_and_n_trials(env):
    exact = lambda c: 1.0  # noqa: E731
    loose, ex_loose = _search(env, exact, "loose", tolerance=0.5)
    loose.run(progress=False)
    tight, ex_tight = _search(env, exact, "tight", tolerance=0.0)
    tight.run(progress=False)
    assert len(ex_loose.seen) <= len(ex_tight.seen)
    capped, ex_capped = _search(env, exact, "capped", tolerance=0.0)
    assert capped.run(n_trials=1, progress=False).stop == "n-trials" and len(ex_capped.seen) == 1
    with pytest.raises(Exception, match="tolerance"):
        _search(env, exact, "bad", tolerance=1.5)


def test_the_bound_widens_with_the_error_the_study_shows():
    """Four measurements along micro batch: residuals that agree leave the known error; residuals that
    disagree raise sigma above it, and a candidate between them gets a wider bound."""
    cfgs = [TrainConfig(micro_batch=m, seq_len=SEQ) for m in (1, 2, 8, 16)]
    mid = TrainConfig(micro_batch=4, seq_len=SEQ)
    kernel = lambda a, b: error_kernel(a, b, 4)  # noqa: E731
    calm, wild = ResidualModel(kernel, 0.05), ResidualModel(kernel, 0.05)
    for c, r in zip(cfgs, (0.3, 0.3, 0.3, 0.3)):
        calm.observe(c, r)
    for c, r in zip(cfgs, (0.0, 0.4, -0.2, 0.5)):
        wild.observe(c, r)
    assert calm.sigma < 0.05 < wild.sigma
    (m_calm,), (sd_calm,) = calm.predict([mid])
    (_, ), (sd_wild,) = wild.predict([mid])
    assert m_calm == pytest.approx(0.3, abs=0.01) and sd_calm < sd_wild
    # a measured candidate keeps only its own part (the nugget), a far one the whole
    (_, ), (sd_at,) = calm.predict([cfgs[0]])
    (_, ), (sd_far,) = calm.predict([TrainConfig(zero_stage=3, precision="bf16", micro_batch=1, seq_len=SEQ)])
    assert sd_at < 0.3 * sd_far


def test_t_quantile_matches_the_table():
    # Student's t, one-sided 95% (any statistics table)
    for dof, t in ((3, 2.353), (5, 2.015), (10, 1.812), (30, 1.697)):
        assert t_quantile(0.95, dof) == pytest.approx(t, rel=0.005)
    assert t_quantile(0.95, 1e9) == pytest.approx(1.6449, rel=1e-4)


@pytest.mark.parametrize("value", ["x", "-1", "100", "150%"])
def test_bad_tolerance_exits_2(value, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    assert main(["search", "--model", "tiny-llama", "--gpus", "2xcpu", "--tolerance", value]) == 2
    assert "--tolerance" in capsys.readouterr().err and not (tmp_path / "trials").exists()


def test_settings_the_prior_prices_alike_share_their_error_and_another_stage_does_not():
    """error_kernel: LoRA ranks 0.4% apart by the prior are mispriced alike; what the prior prices further
    apart shares less of the smooth part; another ZeRO stage shares only the smooth part."""
    from autotune.stopping import W_SMOOTH, W_STAGE, NUGGET

    var = W_STAGE + W_SMOOTH + NUGGET
    r8 = TrainConfig(method="lora", lora_rank=8, seq_len=SEQ)
    r64 = dataclasses.replace(r8, lora_rank=64)
    full = TrainConfig(seq_len=SEQ)
    assert error_kernel(r8, r64, 4, prior_gap=0.004) / var > 0.98
    near, far, farther = (error_kernel(r8, full, 4, prior_gap=g) for g in (0.004, 0.30, 1.0))
    assert near > far > farther > W_STAGE and far < W_STAGE + 0.75 * W_SMOOTH     # 0.69 of it at 30% apart
    # a setting the prior does not price at all still differs a little (OTHER_MIN)
    assert error_kernel(r8, r64, 4, prior_gap=0.0) < error_kernel(r8, r8, 4)
    z3 = dataclasses.replace(r8, zero_stage=3)
    assert error_kernel(r8, z3, 4) == pytest.approx(W_SMOOTH)


def test_the_cost_models_calibration_counts_and_the_cpu_priors_does_not_as_much():
    """After one measurement the bound's t: 1.94 for the cost model (its known error counts as six
    pseudo-measurements), 6.3 for the CPU prior (one)."""
    from autotune.stopping import Bounded, QUANTILE

    for kind, t in (("cost model", 1.943), ("cpu prior", 6.314)):
        b = Bounded(lambda c: 1.0, 4, kind)
        b.observe(TrainConfig(seq_len=SEQ), 2.0)
        assert t_quantile(QUANTILE, b.model.dof) == pytest.approx(t, rel=0.01)


@pytest.mark.slow
def test_simulated_13b_stops_after_the_first_trial_with_the_exhaustive_answer(tmp_path, monkeypatch):
    """13B on 4 x A100 (the default space, simulated): the cost model prices the runner-up (micro batch 2,
    15 layers checkpointed) 3.8% below micro batch 1 in the same stage; with the calibration's weight and a
    trend-like smooth part one trial settles it, and --exhaustive's four find nothing better."""
    from autotune.workflow import open_search

    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    runs = {}
    for exhaustive in (False, True):
        with open_search(model="13b", gpus="4xA100", executor="simulated", study=f"e{exhaustive}",
                         exhaustive=exhaustive) as s:
            runs[exhaustive] = s.run(progress=False)
    stop, every = runs[False], runs[True]
    assert stop.stop == "bound" and stop.ok == 1 and every.ok == 4
    assert stop.best_value == pytest.approx(every.best_value)
    assert stop.bound["line"].startswith("no unrun candidate can beat trial")
    assert "1 of 4 groups run" in stop.bound["line"]
