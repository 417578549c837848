"""Op-level pricing (autotune/costops/): the traced op profile against hand counts, the roofline
per op class by hand, and the cache that lets a search price hundreds of candidates."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

from autotune import costmodel as cm
from autotune import costops as co
from autotune.costops import trace as optrace
from autotune.hardware import parse_gpus
from autotune.models import resolve_model
from autotune.train_config import TrainConfig

A100 = parse_gpus("8xA100")
TINY = resolve_model("tiny-llama")
GPT2 = resolve_model("tiny-gpt2")


def flops_by(profile: co.OpProfile, layers: int, cls: str, phase: str | None = None) -> float:
    return sum(
        op.flops * n for op, n in profile.ops(layers).items() if op.cls == cls and (phase is None or op.phase == phase)
    )


@pytest.mark.parametrize("spec", [TINY, GPT2], ids=lambda s: s.name)
def test_gemm_flops_are_six_times_matmul_params_times_tokens(spec):
    """Forward 2 x params x tokens, backward dgrad + wgrad twice that (Kaplan et al. 2020, Table 1):
    every weight matrix of the blocks and the LM head (tied or not); biases and norms are not GEMMs."""
    b, s = 2, 64
    p = co.profile_for(spec, "builtin", "fp32", "sdpa", b, s)
    h, L = spec.hidden_size, spec.num_layers
    matrices = (
        h * (spec.q_dim + 2 * spec.kv_dim)
        + spec.q_dim * h
        + (3 if spec.mlp == "swiglu" else 2) * h * spec.ffn_hidden_size
    )
    hand = 6 * (L * matrices + spec.vocab_size * h) * b * s
    assert flops_by(p, L, "gemm") == pytest.approx(hand, rel=1e-9)


def test_attention_flops_as_torch_flop_counter_counts_them():
    """torch.utils.flop_counter: sdpa forward = QK^T and AV (4 b h s^2 d), backward 2.5x that."""
    b, s = 2, 64
    p = co.profile_for(TINY, "builtin", "fp32", "sdpa", b, s)
    fwd = 4 * b * TINY.num_heads * s * s * TINY.head_dim * TINY.num_layers
    assert flops_by(p, TINY.num_layers, "attention", "fwd") == pytest.approx(fwd)
    assert flops_by(p, TINY.num_layers, "attention", "bwd") == pytest.approx(2.5 * fwd)


def test_per_block_extrapolation_matches_a_direct_trace():
    """The 1- and 2-block split, extrapolated to 3 blocks, is the 3-block program op for op."""
    from autotune.impl import BuiltinImpl

    impl = BuiltinImpl()
    build = lambda n: impl.build(TINY, dtype=torch.bfloat16, attention="sdpa", num_layers=n)  # noqa: E731
    p = optrace.op_profile(build, impl.loss, micro_batch=1, seq_len=32, vocab=TINY.vocab_size)
    direct = optrace._trace(build, impl.loss, 3, 1, 32, TINY.vocab_size)
    assert p.ops(3) == Counter(direct)


def test_hf_gpt2_runs_its_own_ops():
    """transformers' GPT-2 is traced as it is: eager gelu_new (tanh, pow) and dropout; the builtin
    model runs one fused gelu and no dropout."""
    hf = {op.name for op, _ in co.profile_for(GPT2, "hf", "fp16", "eager", 1, 64).layer}
    builtin = {op.name for op, _ in co.profile_for(GPT2, "builtin", "fp16", "eager", 1, 64).layer}
    assert {"tanh", "pow"} <= hf and "gelu" not in hf
    assert any(n in hf for n in ("bernoulli_", "native_dropout"))
    assert "gelu" in builtin and "tanh" not in builtin


def test_hf_llama_attention_is_priced_as_the_causal_kernel_a_real_run_calls(tmp_path, monkeypatch):
    """transformers' Llama with sdpa and no padding calls the causal kernel without a mask in a real
    run; on fake tensors its mask code cannot read the position ids and would hand SDPA a 4-D mask
    (priced then as full, not causal, attention). The profile also comes back from the disk cache
    unchanged, in a new process's place (the in-memory cache cleared)."""
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    spec = resolve_model("tiny-llama", implementation="hf")
    p = co.profile_for(spec, "hf", "fp32", "sdpa", 2, 64)
    attention = [op for op, _ in p.layer if op.cls == "attention"]
    assert len(attention) == 2 and all(op.shape[-1] is True for op in attention)
    co.profile_for.cache_clear()
    assert list(tmp_path.rglob("*.json"))
    assert co.profile_for(spec, "hf", "fp32", "sdpa", 2, 64) == p


def test_gemm_price_by_hand():
    """A 4096^3 bf16 GEMM on an A100: FLOPs over peak x MAMF 0.869 x depth fill 4096/(4096+128)
    x sustained (its 256x128 tiles fill 512 = 4.74 waves of 108 SMs; 128x128 tiles: 1024 = 9.48,
    so 9.48/10), bytes below the roofline; plus one launch."""
    key = cm.price_key(A100.gpu, "bf16")
    n = 4096
    op = co.Op("gemm", "mm", "fwd", 2.0 * n**3, 3 * n * n * 2, (1, n, n, n))
    eff = 0.869 * n / (n + 128) * 1024 / 1080
    assert co.gemm_s(op, key, 0.7) == pytest.approx(2 * n**3 / (312e12 * eff * 0.7) + co.LAUNCH_S)
    # fp32: the plain FP32 peak, ~16x slower (no TF32)
    key32 = cm.price_key(A100.gpu, "fp32")
    assert co.gemm_s(op, key32, 0.7) / co.gemm_s(op, key, 0.7) > 312 / 19.5 * 0.9


def test_memory_bound_kernels_price_bytes_over_achieved_bandwidth():
    key = cm.price_key(A100.gpu, "bf16")
    op = co.Op("elementwise", "add", "fwd", 0.0, 3 * 2**27)
    assert co.elementwise_s(op, key, 0.7) == pytest.approx(3 * 2**27 / (2039e9 * 0.83) + co.LAUNCH_S)


def test_attention_efficiency_rises_with_sequence_and_head_dim():
    key = cm.price_key(A100.gpu, "bf16")
    e = [co.attention_efficiency(key, "fwd", 128, s, True) for s in (512, 2048, 16384)]
    assert e[0] < e[1] < e[2] < 0.73
    assert co.attention_efficiency(key, "fwd", 64, 2048, True) < e[1]
    v100 = cm.price_key(parse_gpus("8xV100").gpu, "fp16")  # no flash kernel below sm80
    assert co.attention_efficiency(v100, "fwd", 128, 2048, True) == pytest.approx(e[1] * co.EFFICIENT_KERNEL_SCALE)


def test_attention_kernel_by_hand():
    """A causal flash forward and backward at seq 16384, head dim 128 on an A100: FLOPs as the flash
    kernels count them (4 b h s^2 d / 2, backward 2.5x) over peak x FlashAttention-2's efficiency x
    the causal diagonal's s / (s + 128); no sustained share. FlashAttention in Triton (llm-foundry's
    `attn_impl: triton`) takes 1.4x the forward's time and 2x the backward's (FlashAttention-2 sec. 4.1)."""
    key = cm.price_key(A100.gpu, "bf16")
    b, h, s, d = 2, 16, 16384, 128
    fwd_flops = 4.0 * b * h * s * s * d / 2
    diag = s / (s + 128)
    for phase, flops, e in (("fwd", fwd_flops, 0.73), ("bwd", 2.5 * fwd_flops, 0.63)):
        op = co.Op("attention", "_scaled_dot_product_flash_attention", phase, flops, 0, (b, h, s, s, d, True))
        flash2 = flops / (312e12 * e * diag) + co.LAUNCH_S
        assert co.attention_s(op, key, 0.5) == pytest.approx(flash2)  # the sustained share is not applied
        slower = 1.4 if phase == "fwd" else 2.0
        assert co.attention_s(op, key, 0.5, "triton") == pytest.approx((flash2 - co.LAUNCH_S) * slower + co.LAUNCH_S)
    with pytest.raises(ValueError, match="attention kernel"):
        co.attention_s(op, key, 1.0, "flash9")


def test_h100_flash_backward_meets_the_published_forward_backward():
    """H100: forward 35% (FlashAttention-3's abstract); the backward makes forward + 2.5x forward run
    at 335 of 989 TFLOPS, FlashAttention-2's H100 measurement (its sec. 4.1, Fig. 7)."""
    fwd, bwd = co.FLASH_EFFICIENCY["H100"]
    assert fwd == 0.35
    assert 3.5 / (1 / fwd + 2.5 / bwd) == pytest.approx(335 / 989)
    assert bwd == pytest.approx(0.334, abs=5e-4)


def test_runtime_attention_kernel_reaches_the_price():
    """Runtime.attention_kernel prices the step's sdpa kernels: triton is slower at long sequences,
    the GEMMs and element-wise kernels are the same."""
    model = resolve_model("llama-2-7b")
    c = TrainConfig(attention="sdpa", micro_batch=1, seq_len=8192)
    flash2 = cm.simulate(model, A100, c, runtime=cm.Runtime(attention_kernel="flash2")).breakdown_s
    triton = cm.simulate(model, A100, c, runtime=cm.Runtime(attention_kernel="triton")).breakdown_s
    assert 1.4 * flash2["attention"] < triton["attention"] < 2.0 * flash2["attention"]
    assert triton["compute"] == flash2["compute"] and triton["elementwise"] == flash2["elementwise"]


def test_eager_attention_costs_more_than_sdpa_at_long_sequence():
    model = resolve_model("llama-2-7b")
    kw = dict(micro_batch=1, seq_len=8192)
    sdpa = cm.simulate(model, A100, TrainConfig(attention="sdpa", **kw)).step_time_s
    eager = cm.simulate(model, A100, TrainConfig(attention="eager", **kw)).step_time_s
    assert eager > 1.2 * sdpa


def test_pricing_candidates_hits_the_cache():
    """After the first trace, a search's candidates that share (model, implementation, precision,
    attention, micro batch, seq len) are priced from the cache: no new trace, and every one reads the
    cached step FLOPs (which hold the traced profile, so it is not asked again)."""
    model = resolve_model("llama-2-7b")
    cm.simulate(model, A100, TrainConfig(micro_batch=2))
    before, flops = co.profile_for.cache_info(), co.step_flops.cache_info()
    t0 = time.perf_counter()
    for i in range(200):
        cfg = TrainConfig(micro_batch=2, zero_stage=i % 4, grad_accum=1 + i % 5, ckpt_layers=i % 33)
        cm.simulate(model, parse_gpus(f"{1 + i % 8}xA100"), cfg)
    after = co.profile_for.cache_info()
    print(f"200 candidates priced in {time.perf_counter() - t0:.3f} s")
    assert after.misses == before.misses
    assert co.step_flops.cache_info().misses == flops.misses
    assert co.step_flops.cache_info().hits >= flops.hits + 200


def test_per_term_view_sums_to_the_step():
    s = cm.simulate(resolve_model("llama-2-7b"), A100, TrainConfig(zero_stage=3, micro_batch=2, ckpt_layers=8))
    t = s.terms()
    assert set(t) == {"compute", "attention", "elementwise", "recompute", "communication exposed", "optimizer", "host"}
    assert sum(t.values()) == pytest.approx(s.step_time_s)
    assert t["compute"] > t["attention"] > 0 and t["recompute"] > 0


def test_eager_attention_kernels_are_reported_under_attention():
    """Eager's QK^T, AV and score kernels go under attention; a weight GEMM whose width equals the
    sequence length (hidden 128, seq 128) does not."""
    p = co.profile_for(GPT2, "builtin", "fp32", "eager", 2, GPT2.hidden_size)
    tagged = [op for op, _ in p.layer if op.term == "attention"]
    assert {op.name for op in tagged} >= {"bmm", "_softmax"}
    assert all(op.shape[0] > 1 for op in tagged if op.cls == "gemm")  # batched: per (sequence, head)
    assert not [op for op, _ in p.layer if op.cls == "gemm" and op.name in ("mm", "addmm") and op.term]


@pytest.mark.slow  # a mixed stack traced whole (~4 s)
def test_a_stack_of_mixed_layers_is_priced_as_its_whole_program():
    """Blocks that differ (2 dense, then MoE) do not split from 1- and 2-block copies: the profile is
    the blockless program plus the mean block, which at the model's depth is its whole program op for
    op; and the MFU counts the experts a token runs, not all of them."""
    from transformers import AutoConfig

    from autotune.costmodel import simulate
    from autotune.hardware import parse_gpus
    from autotune.impl import impl_for
    from autotune.models import hf_config as hf
    from autotune.train_config import TrainConfig

    d = dict(
        model_type="deepseek_v3",
        num_hidden_layers=5,
        first_k_dense_replace=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=256,
        vocab_size=512,
        max_position_embeddings=128,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_group=1,
        topk_group=1,
    )
    spec = hf.spec_from_config(AutoConfig.for_model(d.pop("model_type"), **d), name="test-mixed", source="test")
    impl = impl_for(spec)
    build = lambda n: impl.build(spec, dtype=torch.bfloat16, attention="sdpa", num_layers=n)  # noqa: E731
    assert not spec.uniform_blocks
    p = optrace.op_profile(build, impl.loss, micro_batch=1, seq_len=32, vocab=spec.vocab_size, depth=5, uniform=False)
    direct = optrace._trace(build, impl.loss, 5, 1, 32, spec.vocab_size)
    assert {op: n for op, n in p.ops(5).items() if abs(n) > 1e-9} == pytest.approx(dict(direct))
    cfg = TrainConfig(precision="bf16", micro_batch=4, seq_len=64)
    step = simulate(spec, parse_gpus("8xA100"), cfg)
    runs = co.step_flops(spec, "hf", "bf16", "sdpa", 4, 64)
    per_token = step.tflops_per_gpu * 1e12 / step.tokens_per_s_per_gpu
    assert per_token == pytest.approx(runs / cfg.tokens_per_micro_batch)
    assert per_token < 0.75 * spec.flops_per_token(64)  # 6N counts all 8 experts, a token runs 2
