"""The search-efficiency benchmark's harness: scoring, and the DeepSpeed-autotuner emulation, on a
landscape small enough to follow by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from autotune.hardware import parse_gpus
from autotune.models import resolve_model
from autotune.search.space import SearchSpace, expand

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "search_efficiency.py"
spec = importlib.util.spec_from_file_location("search_efficiency", PATH)
se = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = se  # dataclasses look their module up
spec.loader.exec_module(se)


@pytest.fixture
def landscape():
    """gpt2 (124M), fp32, 2 GiB (2.147 GB) per rank. States take 16 x 124.4M = 1.99 GB at ZeRO-0,
    half at ZeRO-3 (as DeepSpeed's own arithmetic counts them); activations 100 MB per sequence,
    halved by checkpointing, which costs 25% of the throughput."""
    model, cluster = resolve_model("gpt2"), parse_gpus("2xcpu@2GiB")
    space = SearchSpace.of(zero_stage=(0, 3), precision=("fp32",), micro_batch=(1, 2, 4, 8, 16), ckpt_layers=(0, 12))
    configs = expand(space, model, cluster, seq_len=128).candidates
    states = 16 * model.num_params
    table = {}
    for c in configs:
        need = states / (2 if c.zero_stage == 3 else 1) + c.micro_batch * 100e6 * (0.5 if c.ckpt_layers else 1)
        ok = need <= cluster.capacity_bytes
        sps = c.micro_batch / (1 + 0.1 * c.micro_batch) * (0.75 if c.ckpt_layers else 1.0)
        table[c.key()] = se.Outcome("ok" if ok else "oom", sps if ok else None, 10.0, int(need))
    return se.Landscape("hand", model, cluster, space, 128, configs, table)


def test_best_and_reach(landscape):
    # mb 16 with checkpointing fits (1.0 GB + 0.8 GB) and is best: 16 / 2.6 * 0.75 = 4.615
    assert landscape.best == pytest.approx(16 / 2.6 * 0.75)
    order = se.grid(landscape, 0)
    trials, spent, total = se.reach(landscape, order)
    assert order[trials - 1].micro_batch == 16 and order[trials - 1].ckpt_layers == 12
    assert spent == 10.0 * trials and total == 10.0 * len(order)


def test_deepspeed_autotuner_emulation(landscape):
    """Profile run (ZeRO-3, mb 1: 1.095 GB, so 0.1 GB of activations per sequence; it stops at the
    first forward and measures no throughput). ZeRO-0: it leaves room for (2.147 - 1.99) / 0.1 = 1
    sequence: mb 1 runs, 1.05 x 1 -> 2 OOMs. ZeRO-3: (2.147 - 0.995) / 0.1 -> 11; from its previous
    best, mb 1 runs as an experiment of its own, then 12 (rounded down to the space's 8); the list
    [6, 12] adds mb 6 -> 4; 11 -> 8 does not beat 8 by 5%, so it stops. It never checkpoints: the
    best (mb 16, k 12) is out of its reach."""
    order = se.deepspeed_autotuner(landscape, 0)
    assert isinstance(order[0], se.ProfileRun) and (order[0].cfg.zero_stage, order[0].cfg.micro_batch) == (3, 1)
    assert [(c.zero_stage, c.micro_batch, c.ckpt_layers) for c in order[1:]] == [
        (0, 1, 0),
        (0, 2, 0),
        (3, 1, 0),
        (3, 8, 0),
        (3, 4, 0),
    ]
    assert se.reach(landscape, order)[0] is None


def test_a_profile_run_costs_its_trial_but_reaches_nothing(landscape):
    best = max(landscape.configs, key=lambda c: landscape.run(c).samples_per_s or 0)
    assert se.reach(landscape, [se.ProfileRun(best)]) == (None, None, 10.0)
    assert se.reach(landscape, [se.ProfileRun(best), best]) == (2, 20.0, 20.0)


def test_tpe_runs_each_config_once_and_stops_at_the_target(landscape):
    order = se.tpe(landscape, 0)
    assert len({c.key() for c in order}) == len(order)
    assert landscape.reached(order[-1])


def test_perturbed_landscape_is_bounded_structured_and_seeded(landscape):
    """The error of a perturbed copy stays within its amplitude, is the same for one seed and another
    for another seed, and the prior ours sees is the unperturbed landscape."""
    a = se.perturbed(landscape, 0.15, 3)
    ratios = {
        c.key(): a.run(c).samples_per_s / landscape.run(c).samples_per_s
        for c in landscape.configs
        if landscape.run(c).status == "ok"
    }
    assert all(abs(r - 1) <= 0.15 + 1e-12 for r in ratios.values()) and max(abs(r - 1) for r in ratios.values()) > 0.01
    assert ratios == {
        k: se.perturbed(landscape, 0.15, 3).table[k].samples_per_s / landscape.table[k].samples_per_s for k in ratios
    }
    assert a.table != se.perturbed(landscape, 0.15, 4).table
    assert a.prior == {k: o.samples_per_s for k, o in landscape.table.items() if o.status == "ok"}
    # the stage factor is shared: configs of one stage and micro batch differ by the k trend and the noise alone
    z0 = [c for c in landscape.configs if c.zero_stage == 0 and c.micro_batch == 1]
    z3 = [c for c in landscape.configs if c.zero_stage == 3 and c.micro_batch == 1]
    noise = 2 * se.PERTURB_SHARES["noise"] * 0.15
    assert abs(ratios[z0[0].key()] - ratios[z3[0].key()]) > 0 and all(
        abs(ratios[c.key()] - ratios[z0[0].key()]) <= noise + 2 * se.PERTURB_SHARES["ckpt"] * 0.15 + 1e-12
        for c in z0
        if c.key() in ratios
    )


def _restaged(landscape, z3_speed: float):
    """The hand landscape with everything fitting and ZeRO-3 at `z3_speed` x ZeRO-0's samples/s."""
    table = {}
    for c in landscape.configs:
        sps = c.micro_batch / (1 + 0.1 * c.micro_batch) * (0.75 if c.ckpt_layers else 1.0)
        table[c.key()] = se.Outcome("ok", sps * (z3_speed if c.zero_stage == 3 else 1.0), se.SIM_STARTUP_S + 10.0, 0)
    return se.Landscape("restaged", landscape.model, landscape.cluster, landscape.space, 128, landscape.configs, table)


def test_stage_floor_needs_every_stage_the_prior_cannot_tell_apart(landscape):
    """Two stages tied by the prior: each is the only one within 2% of the best in a share of the seeds
    (its own factor), so a rule must run both, and its trial-seconds after the first hit count. One stage
    at half the speed: it is never within 2%, and the floor is one trial at 1.0x."""
    tied = se.stage_floor(_restaged(landscape, 1.0), 0.15, 200)
    assert tied["needed"] == [0, 3] and all(v > 0.05 for v in tied["only"].values())
    # the first stage reaches in more than half of the seeds, and there the second one doubles the trial-seconds
    assert tied["reached"] >= 0.95 * 200 and 0.5 < tied["first_reached"] < 0.8
    assert tied["ratio"] == pytest.approx(2.0, rel=0.02)
    far = se.stage_floor(_restaged(landscape, 0.5), 0.15, 200)
    assert far["needed"] == [0] and far["only"][3] == 0.0
    assert far["reached"] == 200 and far["first_reached"] == 1.0 and far["ratio"] == 1.0
