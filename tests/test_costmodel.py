"""The cost model: published calibration points, and terms a person can check by hand."""

from __future__ import annotations

import json

import pytest

from autotune import costmodel as cm
from autotune.hardware import parse_gpus
from autotune.models import SpecError, resolve_model
from autotune.train_config import TrainConfig

A100x8 = parse_gpus("8xA100")
L13B = resolve_model("13b")


def cfg(**kw) -> TrainConfig:
    return TrainConfig(**{"seq_len": 2048, **kw})


# ---- calibration ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def errors() -> dict[str, float]:
    return cm.calibration_errors()


@pytest.mark.parametrize("name", [p.name for p in cm.calibration_points()])
def test_published_point_within_10_percent(name, errors):
    assert abs(errors[name]) < 0.10, f"{name}: simulated/measured - 1 = {errors[name]:+.1%}"


def test_published_mfu_within_10_percent():
    """llm-foundry's MFU uses the same FLOP count as ModelSpec.flops_per_token (6N + 12 L h s)."""
    for p in cm.calibration_points():
        raw = cm._calibration()["points"][p.name]["measured"]
        if "mfu" in raw:
            s = cm.simulate(p.model, p.cluster, p.config, runtime=p.runtime)
            assert s.mfu == pytest.approx(raw["mfu"], rel=0.10), p.name


def test_gpt2_large_zero_stage_ordering():
    """DeepSpeedExamples: ZeRO-1 mb3 (87.3) > ZeRO-2 mb3 (77.8) > ZeRO-0 mb2 (59.0) samples/s."""
    sim = {
        p.name: cm.simulate(p.model, p.cluster, p.config, runtime=p.runtime).samples_per_s
        for p in cm.calibration_points()
        if p.name.startswith("gpt2-large")
    }
    assert sim["gpt2-large-16xv100-z1"] > sim["gpt2-large-16xv100-z2"] > sim["gpt2-large-16xv100-z0"]


def test_fit_reproduces_the_default():
    """The shipped constant is what benchmarks/fit_costmodel.py finds (no hand-tuned value)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "benchmarks" / "fit_costmodel.py"
    spec = importlib.util.spec_from_file_location("fit_costmodel", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for gen, share in cm.Constants().sustained:
        assert mod.fit(gen, lo=share - 0.01, hi=share + 0.01) == share, gen


# ---- hand-checkable terms ---------------------------------------------------------------------
def test_ring_collectives_by_hand():
    # 8 A100s on NVLink: 300 GB/s x 0.8 bus efficiency = 240 GB/s.
    assert cm.link_bytes_per_s(A100x8) == pytest.approx(240e9)
    assert cm.all_reduce_s(1e9, A100x8) == pytest.approx(2 * 7 / 8 * 1e9 / 240e9)
    assert cm.all_gather_s(1e9, A100x8) == pytest.approx(7 / 8 * 1e9 / 240e9)
    assert cm.all_reduce_s(1e9, parse_gpus("1xA100")) == 0.0
    # Two nodes: 8 NICs of 25 GB/s per node (200) bound the ring below NVLink's 300.
    assert cm.link_bytes_per_s(parse_gpus("2x8xA100")) == pytest.approx(200e9 * 0.8)


@pytest.mark.parametrize("stage,units", [(0, 2), (1, 2), (2, 2), (3, 3)])
def test_zero_communication_volume(stage, units):
    """ZeRO paper sec. 7: stages 0-2 move 2 Psi per step (as an all-reduce), stage 3 moves 3 Psi."""
    s = cm.simulate(L13B, A100x8, cfg(zero_stage=stage))
    comm = s.breakdown_s["grad_reduce"] + s.breakdown_s["param_gather"] + s.breakdown_s["stage3_gather"]
    psi = cm.all_gather_s(L13B.num_params * 2, A100x8)
    assert comm == pytest.approx(units * psi)


@pytest.mark.parametrize("stage,scales", [(0, False), (1, False), (2, True), (3, True)])
def test_gradient_accumulation_communication(stage, scales):
    """DeepSpeed reduces at stages 2/3 on every micro step, at stages 0/1 once per step."""
    one = cm.simulate(L13B, A100x8, cfg(zero_stage=stage, grad_accum=1)).breakdown_s
    four = cm.simulate(L13B, A100x8, cfg(zero_stage=stage, grad_accum=4)).breakdown_s
    assert four["grad_reduce"] == pytest.approx(one["grad_reduce"] * (4 if scales else 1))
    assert four["compute"] == pytest.approx(4 * one["compute"])


def test_recompute_is_the_forward_of_the_checkpointed_layers():
    """Each checkpointed block reruns its traced forward ops in backward."""
    from autotune.costops import micro_step_price

    c = cfg(ckpt_layers=10)
    p = micro_step_price(
        L13B,
        L13B.implementation,
        "bf16",
        "sdpa",
        1,
        2048,
        cm.price_key(A100x8.gpu, "bf16"),
        cm.Constants().for_gpu(A100x8.gpu.name),
    )
    assert cm.simulate(L13B, A100x8, c).breakdown_s["recompute"] == pytest.approx(10 * p.layer_forward)
    # a block's forward is about a third of its forward+backward (Narayanan et al. 2021, sec. 5.1)
    per_layer = (p.gemm + p.attention + p.elementwise) / L13B.num_layers
    assert 0.25 < p.layer_forward / per_layer < 0.45


def test_optimizer_step_memory_bound_by_hand():
    """Fused AdamW, bf16, ZeRO-1 on 8 GPUs: (28 + 24) bytes per owned parameter over HBM."""
    s = cm.simulate(L13B, A100x8, cfg(zero_stage=1))
    expect = L13B.num_params / 8 * 52 / (2039e9 * 0.83)
    assert s.breakdown_s["optimizer"] == pytest.approx(expect)
    # 8-bit moments: 16 bytes for the update itself instead of 28
    s8 = cm.simulate(L13B, A100x8, cfg(zero_stage=1, optimizer="adamw8bit"))
    assert s8.breakdown_s["optimizer"] == pytest.approx(expect * 40 / 52)


def test_offload_by_hand():
    """ZeRO-Offload: 4 bytes per owned parameter over 25 GB/s PCIe, CPU Adam at 1B per 0.22 s."""
    s = cm.simulate(L13B, A100x8, cfg(zero_stage=2, offload_optimizer=True))
    mine = L13B.num_params / 8
    assert s.breakdown_s["optimizer"] == 0.0
    assert s.breakdown_s["offload"] == pytest.approx(mine * 4 / 25e9 + mine * 8 * 0.22 / 1e9)


def test_overlap_hides_all_but_one_layer():
    c = cfg(zero_stage=3)
    base = cm.simulate(L13B, A100x8, c, runtime=cm.Runtime(overlap_comm=False))
    over = cm.simulate(L13B, A100x8, c, runtime=cm.Runtime(overlap_comm=True))
    comm = base.breakdown_s["grad_reduce"] + base.breakdown_s["stage3_gather"]
    assert base.breakdown_s["overlap"] == 0.0
    assert over.breakdown_s["overlap"] == pytest.approx(-comm * (1 - 1 / L13B.num_layers))


def test_throughput_mfu_and_parts_agree():
    c = cfg(zero_stage=3, micro_batch=2, grad_accum=2)
    s = cm.simulate(L13B, parse_gpus("4xA100"), c)
    assert sum(s.breakdown_s.values()) == pytest.approx(s.step_time_s)
    assert s.samples_per_s == pytest.approx(2 * 2 * 4 / s.step_time_s)
    assert s.tokens_per_s_per_gpu == pytest.approx(2 * 2 * 2048 / s.step_time_s)
    assert s.mfu == pytest.approx(s.tokens_per_s_per_gpu * L13B.flops_per_token(2048) / 312e12)
    assert 0.2 < s.mfu < 0.7


def test_bigger_micro_batch_is_faster_per_token_and_checkpointing_slower():
    tps = [cm.simulate(L13B, A100x8, cfg(zero_stage=3, micro_batch=mb)).tokens_per_s_per_gpu for mb in (1, 2, 4)]
    assert tps[0] < tps[1] < tps[2]
    ckpt = cm.simulate(L13B, A100x8, cfg(zero_stage=3, ckpt_layers=40)).tokens_per_s_per_gpu
    assert ckpt < tps[0]


def test_eager_attention_costs_score_traffic():
    """Eager attention writes and reads the s x s scores; sdpa keeps none (FlashAttention). Eager's
    GEMMs and score kernels are reported under attention."""
    eager = cm.simulate(L13B, A100x8, cfg(attention="eager")).breakdown_s
    sdpa = cm.simulate(L13B, A100x8, cfg(attention="sdpa")).breakdown_s
    assert eager["attention"] > 1.5 * sdpa["attention"] > 0
    assert eager["compute"] == pytest.approx(sdpa["compute"], rel=0.01)  # the weight GEMMs alike


def test_timer_scope_leaves_out_the_host():
    c = cfg(zero_stage=1)
    e2e = cm.simulate(L13B, A100x8, c)
    timers = cm.simulate(L13B, A100x8, c, scope="engine_timers")
    assert e2e.step_time_s - timers.step_time_s == pytest.approx(cm.HOST_STEP_S)
    assert "host" not in timers.breakdown_s


def test_param_tensor_count_gpt2_large():
    # 36 blocks x (ln_1, c_attn, c_proj, ln_2, c_fc, c_proj: weight + bias) + wte, wpe, ln_f w, b
    assert cm.num_param_tensors(resolve_model("gpt2-large")) == 36 * 12 + 4


def test_cpu_cluster_is_not_simulated():
    with pytest.raises(SpecError, match="measured, not simulated"):
        cm.simulate(resolve_model("gpt2"), parse_gpus("2xcpu@2GiB"), cfg(seq_len=256))


def test_to_json_has_the_estimate_fields():
    d = cm.simulate(L13B, A100x8, cfg(zero_stage=3)).to_json()
    assert {"step_time_s", "samples_per_s", "tokens_per_s_per_gpu", "mfu", "breakdown_s"} <= set(d)
    assert d["source"] == "simulated"
    json.dumps(d)


def test_runtime_follows_the_trial_deepspeed_config():
    from autotune.deepspeed_config import zero_section

    for stage in (0, 1, 2, 3):
        c = cfg(zero_stage=stage)
        z = zero_section(c, L13B)
        assert cm.runtime_for(c, L13B).overlap_comm == bool(z.get("overlap_comm", False))


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_lora_on_gpus_prices_the_adapters_and_its_terms_sum_to_the_step(method):
    """A frozen base: 2 of its weight GEMMs' 3, plus each adapter's own GEMMs (priced by costops'
    roofline, forward and both backward ones), plus QLoRA's dequantisation; the per-term view holds
    them all (adapters under compute, dequantisation under elementwise)."""
    full = cm.simulate(L13B, A100x8, cfg(zero_stage=0))
    s = cm.simulate(L13B, A100x8, cfg(zero_stage=0, method=method))
    b = s.breakdown_s
    assert b["compute"] == pytest.approx(full.breakdown_s["compute"] * 2 / 3)
    assert b["adapters"] > 0
    assert (b.get("dequantize", 0) > 0) == (method == "qlora")
    assert sum(s.terms().values()) == pytest.approx(s.step_time_s)
    # each adapter GEMM reads a (tokens x hidden) activation: memory-bound, so at least that traffic
    tokens, h = 2048, L13B.hidden_size
    assert b["adapters"] > L13B.num_layers * tokens * h * 2 / cm.hbm_bytes_per_s(A100x8.gpu)


# llm-foundry's published tables (mosaicml/llm-foundry scripts/train/benchmarking/README.md, commit 061f2c7): the
# NumParams column of an MPT at a sequence length, which its MFU formula multiplies by 6 (issue 49)
LLM_FOUNDRY_NUM_PARAMS = [
    ("125m", 2048, 125311488),
    ("125m", 65536, 174070272),
    ("350m", 512, 354412544),
    ("350m", 2048, 355985408),
    ("350m", 65536, 420997120),
    ("760m", 2048, 760470528),
    ("1b", 2048, 1315950592),
    ("1b", 65536, 1445974016),
    ("3b", 2048, 2651837440),
]


@pytest.mark.parametrize("name,seq,num_params", LLM_FOUNDRY_NUM_PARAMS)
def test_the_benchmark_builds_llm_foundrys_mpts(name, seq, num_params):
    """benchmarks/costmodel_accuracy.py's MPTs are the yamls' shapes: heads d_model / n_heads wide (125m, 350m: 64;
    a spec replaced from mpt-7b kept 128, doubling their attention: issue 49's small models priced 27-30% slow),
    learned positions of the run's length (the tables' NumParams grow with it), within 0.1% of NumParams."""
    from cases import benchmark

    spec = benchmark("costmodel_accuracy").mpt(name, seq)
    assert spec.head_dim * spec.num_heads == spec.hidden_size
    assert spec.num_params == pytest.approx(num_params, rel=1e-3)


@pytest.mark.slow
def test_small_llm_foundry_models_within_the_target():
    """Every 125m and 350m row of llm-foundry's A100 tables (none fitted) within 20%, issue 49's target."""
    from cases import benchmark

    acc = benchmark("costmodel_accuracy")
    errors = {
        (r["model"], r["seq_len"], r["gpus"], r["gpu"], r["micro_batch"]): s / m - 1
        for r, s, m in acc.pair_rows(acc.SMALL)
    }
    assert len(errors) == 39
    worst = max(errors, key=lambda k: abs(errors[k]))
    assert abs(errors[worst]) < 0.20, (worst, errors[worst])
