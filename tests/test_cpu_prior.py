"""The CPU prior (autotune/cpu_prior.py): its probes time the real trial model, and its sum puts each
probed part where the module docstring says. How well it ranks measured trials is a benchmark
(benchmarks/cpu_prior.py), not a test: timings on a shared machine are noisy."""

from __future__ import annotations

import pytest

from autotune import cpu_prior as cp
from autotune.hardware import parse_gpus
from autotune.models import from_shape
from autotune.train_config import TrainConfig

TINY = from_shape("t", "llama", num_layers=4, hidden_size=64, num_heads=4, ffn_hidden_size=128, vocab_size=256,
                  max_seq_len=256)
GPT2 = from_shape("g", "gpt2", num_layers=2, hidden_size=48, num_heads=4, ffn_hidden_size=192, vocab_size=128,
                  max_seq_len=128)


@pytest.mark.slow
@pytest.mark.parametrize("model", [TINY, GPT2], ids=["llama", "gpt2"])
def test_probe_times_the_real_model(model):
    small = cp.probe_model(model, 64, 1, "fp32", "sdpa", 1)
    large = cp.probe_model(model, 64, 32, "fp32", "sdpa", 1)
    assert all(t > 0 for t in small + large)
    assert large[0] > small[0]           # 32x the tokens through the same model
    assert large[1] < large[0]           # one block's forward < the whole forward and backward
    assert cp.probe_model(model, 64, 32, "fp32", "sdpa", 1) is large      # probed once, then cached


def test_adamw_probe_is_per_parameter():
    t = cp.probe_adamw_s_per_param(1, 1 << 16)
    assert 0 < t < 1e-6   # a 65K-parameter AdamW step takes microseconds, not seconds per parameter


def test_prior_is_the_documented_sum(monkeypatch):
    """With probes fixed (pure glue: the arithmetic is what is checked here), the prior is
    samples / (ga x (model + k x block + DeepSpeed) + gloo calls and bytes + AdamW on the rank's share
    + DeepSpeed per parameter)."""
    monkeypatch.setattr(cp, "probe_model", lambda m, s, mb, p, a, th: (0.01 * mb, 0.001 * mb))
    monkeypatch.setattr(cp, "probe_adamw_s_per_param", lambda th: 1e-8)
    cluster = parse_gpus("2xcpu")
    prior = cp.cpu_prior(TINY, cluster)
    n = TINY.num_params
    for z, ga, k, mb in [(0, 1, 0, 4), (1, 2, 2, 8), (2, 3, 0, 2), (3, 2, 4, 16)]:
        cfg = TrainConfig(zero_stage=z, micro_batch=mb, grad_accum=ga, ckpt_layers=k, precision="fp32", seq_len=64)
        micro = 0.01 * mb + k * 0.001 * mb + cp.DEEPSPEED_MICRO_S
        comm = (cp._collectives_per_step(TINY, cfg) * cp.GLOO_CALL_S
                + cp._ring_volumes_per_step(cfg) / 2 * 4 * n / cp.GLOO_BUS_BYTES_PER_S)
        adam = (n if z == 0 else n / 2) * 1e-8
        ds = n * cp.DEEPSPEED_S_PER_PARAM
        assert prior(cfg) == pytest.approx(mb * ga * 2 / (ga * micro + comm + adam + ds))


def test_ring_volumes_and_calls_follow_the_stage():
    """ZeRO-0 all-reduces once per step; ZeRO-2 reduces every micro step; ZeRO-3 also gathers twice."""
    cfg = lambda z, ga: TrainConfig(zero_stage=z, micro_batch=1, grad_accum=ga, precision="fp32", seq_len=64)  # noqa: E731
    assert [cp._ring_volumes_per_step(cfg(z, 4)) for z in range(4)] == [2.0, 2.0, 5.0, 12.0]
    calls = [cp._collectives_per_step(TINY, cfg(z, 4)) for z in range(4)]
    buckets = -(-TINY.num_params // 64 ** 2)              # reduce and all-gather buckets of hidden^2
    assert calls == [1, 2 * buckets, 5 * buckets, 4 * (buckets + 2 * (4 * 5 + 2))]   # 5 matrices/block + embed, head
