"""LoRA and QLoRA (issue #12): the method as a search dimension, peft through the model seam, the
memory against real 2-rank DeepSpeed + peft runs, QLoRA's bytes per weight, the LoraConfig export."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from steady import per_rank_steps, steady_peak

from autotune.errors import SpecError
from autotune.hardware import parse_gpus
from autotune.impl import default_dtype, impl_for
from autotune.memory import estimate
from autotune.memory import layout as memory_layout
from autotune.memory import lora as mlora
from autotune.models import resolve_model
from autotune.search.space import expand, load_space
from autotune.train_config import TrainConfig, check_config

DATA = Path(__file__).resolve().parent / "data"


def spec(name: str):
    return resolve_model(str(DATA / name), implementation="hf", factory=None)


def test_full_is_not_multiplied_by_lora_choices(tmp_path):
    space = tmp_path / "s.yaml"
    space.write_text(
        "zero_stage: [2]\nmicro_batch: [1]\nckpt_layers: [0]\nmethod: [full, lora]\n"
        "lora_rank: [8, 16, 64]\nlora_targets: [attention, all-linear]\n"
    )
    cands = expand(load_space(space), spec("hf-llama"), parse_gpus("2xcpu"), seq_len=32).candidates
    assert sum(c.method == "full" for c in cands) == 1
    assert sum(c.method == "lora" for c in cands) == 6
    assert TrainConfig(method="full", lora_rank=64).key() == TrainConfig().key()


def test_alpha_defaults_to_twice_the_rank_and_bad_values_say_what_is_allowed():
    assert TrainConfig(method="lora", lora_rank=16).alpha == 32
    assert TrainConfig(method="lora", lora_rank=16, lora_alpha=8).alpha == 8
    with pytest.raises(SpecError, match=r"lora_dropout must be a number in \[0, 1\)"):
        TrainConfig(method="lora", lora_dropout=1.0)
    with pytest.raises(SpecError, match="method must be one of full, lora, qlora"):
        TrainConfig(method="prefix")


def test_qlora_is_refused_on_cpu_ranks_with_its_reason_and_estimated_for_a_gpu():
    s = spec("hf-llama")
    with pytest.raises(SpecError, match="qlora needs a GPU: bitsandbytes"):
        check_config(TrainConfig(method="qlora", seq_len=32), s, parse_gpus("2xcpu"))
    gpu = parse_gpus("1xRTX4090")
    cfg = TrainConfig(method="qlora", seq_len=32, precision="bf16")
    check_config(cfg, s, gpu)
    est = estimate(s, gpu, cfg)
    assert "dequantized_weight" in est.terms and est.fits


def test_lora_needs_code_peft_can_wrap():
    with pytest.raises(SpecError, match="wraps the Hugging Face model with peft"):
        check_config(
            TrainConfig(method="lora", seq_len=32),
            resolve_model("tiny-llama", implementation="builtin", factory=None),
            parse_gpus("2xcpu"),
        )


def test_qlora_bytes_per_weight_are_the_papers():
    # Dettmers et al. 2023, sec. 3: 32/64 = 0.5 bits of constants per weight without double
    # quantisation, 8/64 + 32/(64*256) = 0.127 bits with it; 4 bits of NF4 each
    assert mlora.qlora_bytes_per_weight(double_quant=False) == pytest.approx((4 + 0.5) / 8)
    assert mlora.qlora_bytes_per_weight(double_quant=True) == pytest.approx((4 + 8 / 64 + 32 / (64 * 256)) / 8)


def test_seam_trains_only_the_adapters_and_counts_them():
    import torch

    s = spec("hf-gpt2")
    cfg = TrainConfig(method="lora", lora_rank=4, lora_targets="attention")
    with torch.device("meta"):
        model = impl_for(s, cfg).build(s, dtype=torch.float32, attention="sdpa")
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    # GPT-2's attention is attn.c_attn (fused q, k, v) and attn.c_proj, not the MLP's c_proj
    assert mlora.adapted_layers(s, cfg) == ["attn.c_attn", "attn.c_proj"]
    h, L, r = 128, 4, 4
    assert mlora.adapter_params(s, cfg) == L * r * ((h + 3 * h) + (h + h))
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == mlora.adapter_params(s, cfg)


def test_the_trial_builds_peft_adapters_as_users_get_them_and_the_trace_as_deepspeed_trains_them():
    """Issue 51: users call get_peft_model with peft's default, which upcasts 16-bit adapters to fp32
    (tuners_utils.py cast_adapter_dtype); deepspeed.initialize casts them back to the training dtype except
    in a zero.Init model (engine.py _cast_module_mixed_precision), so at ZeRO-3 they train in fp32. The
    trial builds peft's default (the trial's own `autocast_adapter_dtype=False` kept them bf16 and its
    peak 9.7% under the user's loop); the fake-tensor trace builds what DeepSpeed trains."""
    import torch

    s = spec("hf-llama")

    def adapter_dtypes(cfg, as_trained):
        # the default dtype too: peft does not move a new adapter on the meta device to its layer's dtype
        with torch.device("meta"), default_dtype(torch.bfloat16):
            model = impl_for(s, cfg, as_trained=as_trained).build(s, dtype=torch.bfloat16, attention="sdpa")
        return {p.dtype for p in model.parameters() if p.requires_grad}

    z3 = TrainConfig(method="lora", zero_stage=3, precision="bf16")
    z2 = dataclasses.replace(z3, zero_stage=2)
    assert adapter_dtypes(z3, as_trained=False) == adapter_dtypes(z2, as_trained=False) == {torch.float32}
    assert adapter_dtypes(z3, as_trained=True) == {torch.float32}
    assert adapter_dtypes(z2, as_trained=True) == {torch.bfloat16}


def test_fp32_adapters_at_zero_3_are_priced_in_fp32_and_their_gradients_in_the_training_dtype():
    """At ZeRO-3 in bf16 the adapters' partition, the whole small ones and the gathered ones are fp32
    (4 B), the gradient partition and reduce bucket bf16 (stage3.py: gradient_accumulation_dtype and
    communication_data_type are the model's); at ZeRO-2 DeepSpeed cast them to bf16."""
    s, gpus = spec("hf-llama"), parse_gpus("2xcpu")
    cfg = TrainConfig(
        method="lora", zero_stage=3, precision="bf16", lora_targets="all-linear", micro_batch=1, seq_len=32
    )
    adapters = mlora.adapter_params(s, cfg)
    layout = memory_layout(s, gpus, cfg)
    threshold = layout.stage3_param_persistence_threshold
    small = sum(n for n in mlora.adapter_numels(s, cfg) if n < threshold)
    held = mlora.held_parameters(s, gpus, cfg, layout)
    assert held["adapter_parameters"] == int(4 * (adapters / 2 + small))
    assert estimate(s, gpus, cfg).terms["gradient_partition"] == 2 * adapters // 2
    z2 = dataclasses.replace(cfg, zero_stage=2)
    assert mlora.held_parameters(s, gpus, z2, memory_layout(s, gpus, z2))["adapter_parameters"] == 2 * adapters


MIXED_STACKS = {
    # one dense layer, then MoE layers whose experts are grouped parameters, not nn.Linear
    "deepseek_v3": dict(
        num_hidden_layers=4,
        first_k_dense_replace=1,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=1024,
        vocab_size=512,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=24,
        n_group=1,
        topk_group=1,
    ),
    # Mamba layers (no attention), attention every other layer from the second on
    "jamba": dict(
        num_hidden_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        num_experts=4,
        num_experts_per_tok=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_dt_rank=8,
    ),
}


@pytest.mark.parametrize("model_type", sorted(MIXED_STACKS))
@pytest.mark.parametrize("targets", ["attention", "all-linear"])
def test_a_stack_of_mixed_layers_has_its_adapters_and_quantised_weights_counted_layer_by_layer(model_type, targets):
    """The adapters and QLoRA's 4-bit weights were read off the first decoder layer and multiplied
    by the depth: a DeepSeek-V3 had 4.6 times its quantised weights (its dense first layer's MLP for
    every MoE layer), Jamba 1.5 times its all-linear adapters, and its attention adapters were
    refused (its first layer is a Mamba one). They are the peft module's own counts now."""
    import torch
    from transformers import AutoConfig

    from autotune.impl.lora import LINEAR_TYPES
    from autotune.models import hf_config

    s = hf_config.spec_from_config(
        AutoConfig.for_model(model_type, **MIXED_STACKS[model_type]), name=f"test-{model_type}", source="test"
    )
    assert not s.uniform_blocks
    # peft's all-linear wraps the MoE experts' grouped parameters too, which it refuses with dropout
    cfg = TrainConfig(method="lora", lora_rank=4, lora_targets=targets, lora_dropout=0.0)
    impl = impl_for(s, cfg)
    with torch.device("meta"):
        model = impl.build(s, dtype=torch.bfloat16, attention="eager")
    assert mlora.adapter_params(s, cfg) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    linear = [
        m.weight.numel()
        for layer in impl.layers(model)
        for n, m in layer.named_modules()
        if type(m).__name__ in LINEAR_TYPES and ".lora_" not in f".{n}" and not hasattr(m, "base_layer")
    ]
    assert mlora.quantized_weights(s, cfg) == (sum(linear), max(linear))
    # on fake tensors too: peft casts the adapter of DeepSeek's fp32 router weight to fp32, a move
    # that fake parameters cannot make in place ("_apply(): Couldn't swap Linear.weight")
    from autotune.memory import code_trace
    from autotune.memory.tracer import fake_mode

    with fake_mode():
        _, fake = code_trace.build(s, "bf16", "sdpa", s.num_layers, cfg)
    assert sum(p.numel() for p in fake.parameters() if p.requires_grad) == mlora.adapter_params(s, cfg)


@pytest.mark.slow  # ~4 s of 13B traces; quick loop: LoRA's terms estimated for a GPU (test_qlora_is_refused_on_cpu...)
def test_lora_static_memory_is_far_below_full_fine_tuning_for_13b():
    s = resolve_model("13b", implementation="hf", factory=None)
    gpus = parse_gpus("4xA100")
    for z in (0, 1, 2, 3):
        full = estimate(s, gpus, TrainConfig(zero_stage=z, seq_len=512, ckpt_layers=40))
        lora = estimate(s, gpus, TrainConfig(zero_stage=z, seq_len=512, ckpt_layers=40, method="lora"))

        def static(e):
            return sum(
                v
                for k, v in e.terms.items()
                if k
                in (
                    "parameters",
                    "frozen_parameters",
                    "adapter_parameters",
                    "master_weights",
                    "optimizer_states",
                )
            )

        assert lora.terms["optimizer_states"] < full.terms["optimizer_states"] / 100
        assert static(lora) < static(full)


def test_export_writes_a_lora_config_peft_accepts(tmp_path):
    from peft import LoraConfig

    from autotune.report.export import lora_config_json

    text = lora_config_json(spec("hf-gpt2"), TrainConfig(method="lora", lora_rank=16, lora_dropout=0.1))
    cfg = LoraConfig(**json.loads(text))
    assert cfg.r == 16 and cfg.lora_alpha == 32 and cfg.lora_dropout == 0.1
    assert set(cfg.target_modules) == {"attn.c_attn", "attn.c_proj"}


# Hybrid (Granite-4, `granitemoehybrid`) shape of test_a_hybrid_stacks_layers_before_its_first_adapter_are_released_at_zero_3
GRANITE = dict(
    num_hidden_layers=3,
    hidden_size=96,
    num_attention_heads=4,
    intermediate_size=256,
    vocab_size=700,
    max_position_embeddings=256,
    num_key_value_heads=2,
    layer_types=["mamba", "attention", "mamba"],
    num_local_experts=4,
    num_experts_per_tok=2,
    shared_intermediate_size=96,
    mamba_n_heads=4,
    mamba_d_head=48,
    mamba_d_state=16,
    mamba_chunk_size=16,
)


def granite_spec():
    from transformers import AutoConfig

    from autotune.models import hf_config as hf

    return hf.spec_from_config(AutoConfig.for_model("granitemoehybrid", **GRANITE), name="test-granite", source="test")


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """The real DeepSpeed + peft runs of this module's slow tests (2 CPU ranks, 1 warm-up and 2 measured
    steps each), all in ONE process group (run_trials, as tests/test_trial.py's matrix and
    tests/test_knobs.py do): torch, DeepSpeed, transformers and peft are imported and gloo set up once
    instead of four times; each config is still measured on its own (launch.run_trials: peaks relative
    to the live bytes before its model is built). {name: (request, result)}; each test reads its own."""
    from autotune.trial.launch import run_trials
    from autotune.trial.record import TrialRequest

    root, gpus = tmp_path_factory.mktemp("lora-runs"), parse_gpus("2xcpu")
    llama = spec("hf-llama")
    runs = {
        # test_real_lora_trials_match_the_estimate
        "hf-llama": (
            llama,
            TrainConfig(
                method="lora", zero_stage=2, precision="bf16", micro_batch=2, seq_len=48, lora_rank=8, ckpt_layers=2
            ),
        ),
        "hf-gpt2": (
            spec("hf-gpt2"),
            TrainConfig(
                method="lora",
                zero_stage=3,
                precision="fp32",
                micro_batch=1,
                seq_len=64,
                lora_rank=4,
                lora_targets="all-linear",
            ),
        ),
        # test_a_real_lora_run_at_zero_3_is_not_underestimated
        "z3-attention": (
            llama,
            TrainConfig(method="lora", lora_rank=8, zero_stage=3, precision="fp32", micro_batch=2, seq_len=64),
        ),
        # test_lora_at_zero_3_with_every_layer_checkpointed_and_all_linear_adapters
        "z3-all-linear-every-layer": (
            llama,
            TrainConfig(
                method="lora",
                lora_rank=8,
                lora_targets="all-linear",
                zero_stage=3,
                precision="bf16",
                ckpt_layers=llama.num_layers,
                micro_batch=2,
                seq_len=64,
            ),
        ),
        # test_a_hybrid_stacks_layers_before_its_first_adapter_are_released_at_zero_3
        "granite-z3": (
            granite_spec(),
            TrainConfig(method="lora", lora_rank=8, zero_stage=3, precision="fp32", micro_batch=2, seq_len=80),
        ),
    }
    reqs = [
        TrialRequest(model=m, cluster=gpus, config=c, steps=2, warmup_steps=1, out_dir=root / name)
        for name, (m, c) in runs.items()
    ]
    return dict(zip(runs, zip(reqs, run_trials(reqs))))


@pytest.mark.slow
def test_real_lora_trials_match_the_estimate(lora_runs):
    """Real DeepSpeed + peft trials on 2 CPU ranks, one process group: ok, the loss falls, the
    measured peak within 5% of the estimate (the issue's worst-case bar)."""
    gpus = parse_gpus("2xcpu")
    for req, res in (lora_runs["hf-llama"], lora_runs["hf-gpt2"]):
        assert res.status == "ok", res.reason
        assert res.losses[-1] < res.losses[0]
        est = estimate(req.model, gpus, req.config).tensor_peak_bytes
        assert abs(est / steady_peak(res) - 1) <= 0.05, (req.model.name, req.config.short(), est, per_rank_steps(res))


def test_autotune_export_writes_the_lora_config_beside_the_deepspeed_json(tmp_path, monkeypatch, capsys):
    """`autotune export` on a real study whose winner is a LoRA run."""
    import optuna
    from optuna.trial import TrialState
    from peft import LoraConfig

    from autotune.cli import main
    from autotune.search import study as st

    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    monkeypatch.chdir(tmp_path)
    model, cluster = spec("hf-llama"), parse_gpus("2xcpu")
    attrs = st.study_attrs(
        model, cluster, seq_len=64, global_batch=None, space_text="", space_path="t", source="measured"
    )
    study = st.create_study("lora", None, attrs, sampler=None)
    cfg = TrainConfig(method="lora", lora_rank=16, lora_targets="all-linear", ckpt_layers=2, seq_len=64)
    dists = st.distributions([cfg])
    res = {
        "status": "ok",
        "source": "measured",
        "samples_per_s": 10.0,
        "tokens_per_s": 640.0,
        "peak_bytes": 1000,
        "log_tail": "",
    }
    ua = {
        "config": cfg.to_dict(),
        "status": "ok",
        "source": "measured",
        "reason": "",
        "result": res,
        "estimate": {
            "tensor_bytes": 1000,
            "total_bytes": 1000,
            "capacity_bytes": 10**9,
            "dominant_term": "activations",
        },
    }
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.COMPLETE, value=10.0, params=st.params_of(cfg, dists), distributions=dists, user_attrs=ua
        )
    )
    out = tmp_path / "ds.json"
    assert main(["export", "--study", "lora", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    lora = LoraConfig(**json.loads((tmp_path / "ds.lora.json").read_text()))
    assert lora.r == 16 and lora.lora_alpha == 32 and lora.target_modules == "all-linear"
    assert "get_peft_model" in text and "enable_input_require_grads" in text and "if p.requires_grad" in text


@pytest.mark.slow
def test_recorded_lora_runs_stay_within_the_bar():
    """The 55 real DeepSpeed + peft runs recorded by benchmarks/lora_memory.py (2 CPU ranks; GPT-2,
    Llama, Qwen2 and GPT-NeoX shapes no other test uses, ZeRO 0-3, attention-only and all-linear
    adapters, every layer checkpointed at ZeRO-3, seven of those at hidden 384 where the recompute
    peaks after DeepSpeed has released an untied LM head), estimated again by today's code, held to the bar of
    docs/memory.md: median |error| at most 1%, worst at most 3%, never under by more than 1% (an
    under-estimate keeps a candidate that runs out of memory). A change of a shared ZeRO term once put
    the four grad_accum 2 runs at ZeRO-2 20-28% over and no test saw it."""
    import statistics

    from cases import benchmark

    bench = benchmark("lora_memory")
    _estimate_on_two_cores(bench)
    rows = bench.rows_with_estimates()
    errors = {f"{r['family']} {r['cfg'].short()}": 100 * r["err"] for r in rows}
    assert len(errors) == 55
    assert statistics.median(abs(e) for e in errors.values()) <= 1, errors
    assert max(abs(e) for e in errors.values()) <= 3, errors
    assert min(errors.values()) >= -1, errors


def _estimate_on_two_cores(bench) -> None:
    """Trace the recorded runs' programs on two cores before rows_with_estimates() estimates them all:
    half in a forked process that hands its traces over through the trace cache
    (trace_cache.in_parallel, how `autotune estimate` traces on two cores), half here. Split by family
    (Qwen2, GPT-NeoX and the wide GPT-2 there, GPT-2 and Llama here, about 80 s each on one core), so
    that no program is traced twice. rows_with_estimates() then estimates every row again with the
    same code, reading those programs back (55 estimates in about 2 s once traced)."""
    import csv

    from autotune.trace_cache import in_parallel

    cluster = parse_gpus(f"{bench.RANKS}xcpu")
    with bench.CSV.open() as f:
        rows = list(csv.DictReader(f))

    def wide(row):
        shape = json.loads(row["hf_config"])
        return shape.get("hidden_size", shape.get("n_embd")) == 384

    def estimates(chosen):
        return lambda: [
            estimate(bench.spec_of(r["family"], json.loads(r["hf_config"])), cluster, bench.train_config(r))
            for r in chosen
        ]

    there = [r for r in rows if r["family"] in ("qwen2", "gpt_neox") or (r["family"] == "gpt2" and wide(r))]
    here = [r for r in rows if r not in there]
    in_parallel([estimates(here)], [estimates(there)])


@pytest.mark.slow  # a LoRA ZeRO-3 trace (~5 s); quick loop: test_fp32_adapters_at_zero_3_are_priced_in_fp32_and_their_gradients_in_the_training_dtype
def test_lora_under_zero_3_is_traced_with_deepspeeds_linear():
    """zero.Init swaps torch.nn.functional.linear for DeepSpeed's LinearFunctionForZeroStage3, which
    saves the input of every linear layer, frozen ones too, where torch's saves a frozen layer's input
    for nothing. A LoRA step under ZeRO-3 is traced with a function of the same saves
    (code_trace.zero3_linear_function), and is the real step with DeepSpeed's own function to the
    byte; torch's F.linear left it 884,720 B under at the forward here."""
    import torch
    from cpu_step import measure_cpu
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    from autotune.memory.traced import trace

    s = spec("hf-llama")
    cfg = TrainConfig(method="lora", lora_rank=8, zero_stage=3, precision="fp32", micro_batch=2, seq_len=48)
    got = trace(s, parse_gpus("1xcpu@8GiB"), cfg).raw_peaks
    original = torch.nn.functional.linear
    torch.nn.functional.linear = zero3_linear_wrap
    try:
        real = measure_cpu(s, cfg)
    finally:
        torch.nn.functional.linear = original
    for phase in ("forward", "backward", "optimizer"):  # the 0-dim scalars c10 makes outside the dispatcher
        assert 0 <= real[phase] - got[phase] <= 256, (phase, got, real)
    plain = trace(s, parse_gpus("1xcpu@8GiB"), dataclasses.replace(cfg, zero_stage=2)).raw_peaks
    assert plain["forward"] < got["forward"]


@pytest.mark.slow
def test_a_real_lora_run_at_zero_3_is_not_underestimated(lora_runs):
    """A LoRA r 8 run at ZeRO-3 on 2 CPU ranks (fp32, attention targets, no checkpointing), phase by
    phase. It read 5.9% under on a Qwen3 shape: DeepSpeed's linear saves the frozen layers' inputs
    (above); without checkpointing no backward runs through the frozen embedding, so DeepSpeed
    releases its gathered weight after the forward; and its step releases the persistent parameters,
    LoRA's adapters among them (model_states.zero3_step_parameters). Now within +2%, never under."""
    s, gpus = spec("hf-llama"), parse_gpus("2xcpu")
    cfg = TrainConfig(method="lora", lora_rank=8, zero_stage=3, precision="fp32", micro_batch=2, seq_len=64)
    req, res = lora_runs["z3-attention"]  # the run of cfg (lora_runs)
    assert (req.model, req.cluster, req.config) == (s, gpus, cfg)
    assert res.status == "ok", res.reason
    est = estimate(s, gpus, cfg)
    assert 0 <= est.tensor_peak_bytes / steady_peak(res) - 1 <= 0.02, (est.phases, per_rank_steps(res))
    assert abs(est.phases["optimizer"] / res.phase_peak_bytes["optimizer"] - 1) <= 0.005, (
        est.phases,
        res.phase_peak_bytes,
    )


@pytest.mark.slow
def test_lora_at_zero_3_with_every_layer_checkpointed_and_all_linear_adapters(lora_runs):
    """Issue 30's dangerous class (reported 9.7-15.8% under on GPT-2, Llama and Qwen2 shapes): with
    every layer checkpointed nothing is released after the forward (enable_input_require_grads gives
    the embedding's output a gradient), DeepSpeed's linear saves every frozen layer's input in the
    recompute, and the adapters of every linear layer are gathered with it. Measured within -0.01% to
    +0.83% on nine shapes (docs/measurements/memory.md, "Issue 30"); here one real run, at most 1% under, 3% over."""
    s, gpus = spec("hf-llama"), parse_gpus("2xcpu")
    cfg = TrainConfig(
        method="lora",
        lora_rank=8,
        lora_targets="all-linear",
        zero_stage=3,
        precision="bf16",
        ckpt_layers=s.num_layers,
        micro_batch=2,
        seq_len=64,
    )
    req, res = lora_runs["z3-all-linear-every-layer"]  # the run of cfg (lora_runs)
    assert (req.model, req.cluster, req.config) == (s, gpus, cfg)
    assert res.status == "ok", res.reason
    est = estimate(s, gpus, cfg)
    assert -0.01 <= est.tensor_peak_bytes / steady_peak(res) - 1 <= 0.03, (est.phases, per_rank_steps(res))


@pytest.mark.slow
def test_the_trial_measures_what_the_users_plain_loop_does_with_lora_at_zero_3(lora_runs):
    """Issue 51: at ZeRO-3 in bf16 with every layer checkpointed, the plain loop users run
    (benchmarks/user_loops.py: from_config under HfDeepSpeedConfig, get_peft_model with peft's defaults,
    activation_checkpointing_enable, deepspeed.initialize, engine forward/backward/step) needed 10.8% more than
    the trial, whose adapters stayed bf16 where peft's default keeps them fp32 (the recompute casts every
    adapted layer's input to fp32). The same config, same counter: the trial's peak is the user's."""
    from cases import benchmark

    req, res = lora_runs["z3-all-linear-every-layer"]
    assert res.status == "ok", res.reason
    plain = benchmark("user_loops").run_loop("plain", req.model, req.config)
    trial, user = max(map(max, per_rank_steps(res).values())), max(map(max, plain))
    assert abs(trial / user - 1) <= 0.001, (per_rank_steps(res), plain)
    assert abs(estimate(req.model, req.cluster, req.config).tensor_peak_bytes / user - 1) <= 0.01


@pytest.mark.slow
def test_a_hybrid_stacks_layers_before_its_first_adapter_are_released_at_zero_3(lora_runs):
    """Granite-4 (`granitemoehybrid`: Mamba, attention, Mamba, with MoE) with attention targets: its
    first layer, a Mamba one, is upstream of every adapter, so no gradient reaches its outputs, no
    backward hook fetches it again, and DeepSpeed releases it after its forward, as it does the
    embedding (code_trace.released_after_forward). Priced as held, this run read +12.4%."""
    from autotune.memory.code_trace import _numels, param_numels, released_after_forward

    s = granite_spec()  # the shape GRANITE
    gpus = parse_gpus("2xcpu")
    cfg = TrainConfig(method="lora", lora_rank=8, zero_stage=3, precision="fp32", micro_batch=2, seq_len=80)
    released = released_after_forward(s, cfg)
    pre, (first_layer, *_), _ = _numels(s)
    # the embedding, then the first layer but for its conv1d (weight and bias over 2 x 96 + 2 x 16
    # channels, kernel 4), which the Mamba path uses functionally: a module never called is kept
    # gathered, the safe side
    assert released[: len(pre)] == list(pre)
    kept = list(first_layer)
    for n in released[len(pre) : len(pre) + len(first_layer) - 2]:
        kept.remove(n)
    assert sorted(kept) == [224, 4 * 224]
    assert sum(released) < sum(param_numels(s)) / 2  # later layers' inputs need gradients: held
    assert released_after_forward(s, dataclasses.replace(cfg, ckpt_layers=1)) == []  # input_require_grads
    req, res = lora_runs["granite-z3"]  # the run of cfg (lora_runs)
    assert (req.model, req.cluster, req.config) == (s, gpus, cfg)
    assert res.status == "ok", res.reason
    est = estimate(s, gpus, cfg)
    assert 0 <= est.tensor_peak_bytes / steady_peak(res) - 1 <= 0.01, (est.phases, per_rank_steps(res))


def test_lora_at_zero_3_holds_no_more_gathered_than_the_reuse_distance():
    """ZeRO-3's coordinator releases a frozen module whose next use is further than
    stage3_max_reuse_distance elements away in the trace, as it does a trained one: Llama-2-70B
    with LoRA on 8 x A100 held its whole base gathered (128.5 GiB per GPU) and never fit."""
    spec, gpus = resolve_model("70b"), parse_gpus("8xA100")
    lora = estimate(spec, gpus, TrainConfig(zero_stage=3, method="lora", ckpt_layers=80))
    full = estimate(spec, gpus, TrainConfig(zero_stage=3, ckpt_layers=80))
    assert lora.terms["zero3_gathered_params"] <= 2 * int(1e9)  # bf16, 1e9 elements
    assert lora.fits and lora.tensor_peak_bytes < full.tensor_peak_bytes / 4
