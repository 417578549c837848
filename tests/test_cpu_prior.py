"""The CPU prior (autotune/search/cpu_prior.py): its probes time the real trial model, and its sum puts each
probed part where the module docstring says. How well it ranks measured trials is a benchmark
(benchmarks/cpu_prior.py), not a test: timings on a shared machine are noisy."""

from __future__ import annotations

import pytest

from autotune.hardware import parse_gpus
from autotune.models import from_shape
from autotune.search import cpu_prior as cp
from autotune.train_config import TrainConfig

TINY = from_shape(
    "t", "llama", num_layers=4, hidden_size=64, num_heads=4, ffn_hidden_size=128, vocab_size=256, max_seq_len=256
)
GPT2 = from_shape(
    "g", "gpt2", num_layers=2, hidden_size=48, num_heads=4, ffn_hidden_size=192, vocab_size=128, max_seq_len=128
)


@pytest.mark.slow
@pytest.mark.parametrize("model", [TINY, GPT2], ids=["llama", "gpt2"])
def test_probe_times_the_real_model(model):
    small = cp.probe_model(model, 64, 1, "fp32", "sdpa", 1)
    large = cp.probe_model(model, 64, 32, "fp32", "sdpa", 1)
    assert large[0] > small[0]  # 32x the tokens through the same model
    assert large[1] < large[0]  # one block's forward < the whole forward and backward
    assert cp.probe_model(model, 64, 32, "fp32", "sdpa", 1) is large  # probed once, then cached


def test_adamw_probe_is_per_parameter():
    t = cp.probe_adamw_s_per_param(1, 1 << 16)
    assert 0 < t < 1e-6  # a 65K-parameter AdamW step takes microseconds, not seconds per parameter


def test_prior_is_the_documented_sum(monkeypatch):
    """With the probes fixed (pure glue), one case worked by hand: samples / (ga x (model + k x block
    + DeepSpeed per micro step) + gloo calls and bytes + AdamW on the rank's share + DeepSpeed per
    parameter); and the prior falls with every checkpointed layer and with more communication."""
    monkeypatch.setattr(cp, "probe_model", lambda m, s, mb, p, a, th: (0.01 * mb, 0.001 * mb))
    monkeypatch.setattr(cp, "probe_adamw_s_per_param", lambda th: 1e-8)
    monkeypatch.setattr(cp, "probe_gloo", lambda w: (cp.GLOO_CALL_S, cp.GLOO_BUS_BYTES_PER_S, "fixed"))
    prior = cp.cpu_prior(TINY, parse_gpus("2xcpu"))

    def cfg(**kw):
        return TrainConfig(
            **{
                "zero_stage": 0,
                "micro_batch": 4,
                "grad_accum": 1,
                "ckpt_layers": 2,
                "precision": "fp32",
                "seq_len": 64,
                **kw,
            }
        )

    # TINY has 197,184 parameters. ZeRO-0, mb 4, k 2, ga 1 on 2 ranks:
    #   micro step   0.04 + 2 x 0.004 + 0.011 (DeepSpeed)                 = 0.059 s
    #   gloo         1 all-reduce x 0.31 ms + 4 B x 197,184 / 1.43 GB/s    = 0.00086156 s
    #   AdamW        197,184 x 1e-8 (every rank steps all of it at ZeRO-0) = 0.00197184 s
    #   DeepSpeed    197,184 x 2.6 ns                                      = 0.00051268 s
    #   8 samples / 0.06234608 s                                           = 128.316 samples/s
    assert prior(cfg()) == pytest.approx(128.316, rel=1e-4)
    assert prior(cfg(ckpt_layers=0)) > prior(cfg()) > prior(cfg(ckpt_layers=4))
    assert prior(cfg(zero_stage=3, grad_accum=4)) < prior(cfg(zero_stage=0, grad_accum=4))


def test_the_shapes_asked_about_are_probed_in_two_passes_and_the_faster_kept(monkeypatch):
    """cpu_prior(..., configs): each shape timed in micro batch order, then all again, the faster of
    each shape's two kept (pure glue: the probe scripted, a slow moment met by micro batch 2's first timing)."""
    calls = []

    def timed(m, s, mb, p, a, th):
        calls.append(mb)
        slow = 5.0 if (mb == 2 and calls.count(2) == 1) else 1.0
        return 0.01 * mb * slow, 0.001 * mb

    cached = lambda *key: pytest.fail("a shape asked about was probed again")  # noqa: E731
    cached.__wrapped__ = timed
    monkeypatch.setattr(cp, "probe_model", cached)
    monkeypatch.setattr(cp, "probe_gloo", lambda w: (cp.GLOO_CALL_S, cp.GLOO_BUS_BYTES_PER_S, "fixed"))
    monkeypatch.setattr(cp, "probe_adamw_s_per_param", lambda th: 1e-8)
    cfgs = [
        TrainConfig(micro_batch=mb, ckpt_layers=k, precision="fp32", seq_len=64) for mb in (4, 1, 2) for k in (0, 2)
    ]
    prior = cp.cpu_prior(TINY, parse_gpus("2xcpu"), cfgs)
    assert calls == [1, 2, 4, 1, 2, 4]
    assert prior(cfgs[4]) > prior(cfgs[2])  # mb 2 beats mb 1: its slow first timing (5x) was not kept


def test_a_shape_timed_at_long_probe_s_is_not_probed_again(monkeypatch):
    """A forward+backward of LONG_PROBE_S or longer already spans the machine's bursts: no second
    pass for it (pure glue: the probe scripted), while the short shapes still get theirs."""
    calls = []

    def timed(m, s, mb, p, a, th):
        calls.append(mb)
        return cp.LONG_PROBE_S * mb / 4, 0.001 * mb  # mb 4 and 8 at or over the line, 1 and 2 under

    monkeypatch.setattr(cp.probe_model, "__wrapped__", timed, raising=False)
    keys = [cp._probe_key(TINY, TrainConfig(micro_batch=mb, precision="fp32", seq_len=64), 1) for mb in (8, 1, 4, 2)]
    got = cp.probe_passes(keys, 2)
    assert calls == [1, 2, 4, 8, 1, 2]
    assert got[keys[0]][0] == 2 * cp.LONG_PROBE_S


@pytest.mark.slow
def test_a_long_forward_and_backward_is_timed_once(monkeypatch):
    """probe_model itself: with the line at 0 every shape is long, so one timing after the warm-up
    (a real tiny model, its forwards counted at the causal-LM module's call)."""
    import torch

    calls = []
    real = torch.nn.Module.__call__

    def counting(self, *a, **kw):
        if type(self).__name__.endswith("ForCausalLM"):
            calls.append(1)
        return real(self, *a, **kw)

    monkeypatch.setattr(torch.nn.Module, "__call__", counting)
    for line, want in ((float("inf"), 1 + cp.PROBE_TIMINGS), (0.0, 2)):
        monkeypatch.setattr(cp, "LONG_PROBE_S", line)
        calls.clear()
        cp.probe_model.__wrapped__(TINY, 32, 2, "fp32", "sdpa", 1)
        assert len(calls) == want


def test_ring_volumes_and_calls_follow_the_stage():
    """ZeRO-0 all-reduces once per step; ZeRO-2 reduces every micro step; ZeRO-3 also gathers twice."""
    cfg = lambda z, ga: TrainConfig(zero_stage=z, micro_batch=1, grad_accum=ga, precision="fp32", seq_len=64)  # noqa: E731
    assert [cp._ring_volumes_per_step(cfg(z, 4)) for z in range(4)] == [2.0, 2.0, 5.0, 12.0]
    calls = [cp._collectives_per_step(TINY, cfg(z, 4)) for z in range(4)]
    buckets = -(-TINY.num_params // 64**2)  # reduce and all-gather buckets of hidden^2
    assert calls == [1, 2 * buckets, 5 * buckets, 4 * (buckets + 2 * (4 * 5 + 2))]  # 5 matrices/block + embed, head
