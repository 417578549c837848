"""The cost model under tensor parallelism (AutoTP) and Ulysses sequence parallelism: one rank's compute, ZeRO's
collectives over the ranks it shards over, the tp all-reduces and the Ulysses all-to-alls, and the throughput
counts (autotune/costops/parallel.py, costmodel.simulate; docs/parallelism.md, "Cost model")."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autotune import costmodel as cm
from autotune.costops import micro_step_price
from autotune.costops.parallel import _narrow_head, shard_price, sp_group, tp_group, ulysses_comm_s
from autotune.hardware import parse_gpus
from autotune.memory.tensor_parallel import dp_cluster, local_model
from autotune.models import resolve_model
from autotune.train_config import TrainConfig, check_config

H100x8 = parse_gpus("8xH100")
L3 = resolve_model("llama-3-8b", implementation="hf")  # 32 heads, 8 KV heads, untied head
KEY = cm.price_key(H100x8.gpu, "bf16")
S = cm.Constants().for_gpu(H100x8.gpu.name)


def sim(cfg, cluster=H100x8, model=L3):
    check_config(cfg, model, cluster)
    return cm.simulate(model, cluster, cfg)


def test_without_parallelism_the_price_is_the_plain_one():
    assert shard_price(L3, 1, 1, "hf", "bf16", "sdpa", 1, 2048, KEY, S) == micro_step_price(
        L3, "hf", "bf16", "sdpa", 1, 2048, KEY, S
    )


def test_a_tp_rank_computes_its_shard():
    """GEMMs of the narrower model (heads, KV heads, intermediate / tp) and a V / tp head: about half at tp 2;
    norms, residuals and the loss on whole logits stay whole, so element-wise work falls far less."""
    whole = shard_price(L3, 1, 1, "hf", "bf16", "sdpa", 1, 4096, KEY, S)
    half = shard_price(L3, 2, 1, "hf", "bf16", "sdpa", 1, 4096, KEY, S)
    assert 0.45 < half.gemm / whole.gemm < 0.55
    assert half.attention == pytest.approx(whole.attention / 2, rel=0.01)  # heads / 2, same kernel shapes
    assert 0.55 < half.elementwise / whole.elementwise < 1.0
    assert half.layer_forward < 0.6 * whole.layer_forward


def test_untied_heads_gemms_are_vocab_over_tp():
    from autotune.costops.ops import Op

    V, h, T = L3.vocab_size, L3.hidden_size, 4096
    fwd = Op("gemm", "mm", "fwd", 2.0 * T * h * V, 2 * (T * h + h * V + T * V), (1, T, h, V))
    narrow = _narrow_head(fwd, V, 2)
    assert narrow.shape == (1, T, h, V // 2) and narrow.flops == fwd.flops / 2
    assert narrow.nbytes == 2 * (T * h + h * V // 2 + T * V // 2)
    layer = Op("gemm", "mm", "fwd", 2.0 * T * h * h, 2 * 3 * T * h, (1, T, h, h))
    assert _narrow_head(layer, V, 2) is layer


def test_zero_collectives_move_the_shard_over_world_over_tp_ranks():
    cfg = TrainConfig(zero_stage=2, micro_batch=1, seq_len=2048, autotp_size=2)
    s = sim(cfg)
    shard, dp = local_model(L3, 2), dp_cluster(H100x8, 2)
    assert dp.world_size == 4 and shard.num_params < 0.6 * L3.num_params
    want = 3 / 4 * shard.num_params * 2 / cm.link_bytes_per_s(dp)  # reduce-scatter of bf16 gradients
    assert s.breakdown_s["grad_reduce"] == pytest.approx(want)
    assert s.breakdown_s["param_gather"] == pytest.approx(want)
    plain = sim(replace(cfg, autotp_size=1))
    assert s.breakdown_s["optimizer"] == pytest.approx(
        plain.breakdown_s["optimizer"] * shard.num_params * 2 / L3.num_params
    )


def test_tp2_is_no_longer_priced_as_the_whole_model():
    """Before: a tp 2 rank was priced as the whole model, its step slower than tp 1's; now well under it."""
    cfg = TrainConfig(zero_stage=3, micro_batch=2, seq_len=2048)
    one, two = sim(cfg), sim(replace(cfg, autotp_size=2))
    assert two.step_time_s < 0.7 * one.step_time_s
    assert two.samples_per_s == pytest.approx(2 * 4 / two.step_time_s)  # dp 4
    assert two.tokens_per_s_per_gpu == pytest.approx(2 * 2048 / two.step_time_s / 2)
    assert sum(two.terms().values()) == pytest.approx(two.step_time_s)  # tp_comm is communication


def test_tp_comm_counts_a_checkpointed_layers_recomputed_forward():
    from autotune.costops.parallel import tp_comm_s

    cfg = TrainConfig(zero_stage=1, micro_batch=1, seq_len=2048, autotp_size=2)
    bare = tp_comm_s(L3, cfg, H100x8, cm.link_bytes_per_s, 2)
    ckpt = tp_comm_s(L3, replace(cfg, ckpt_layers=L3.num_layers), H100x8, cm.link_bytes_per_s, 2)
    per_allreduce = 2 * (1 / 2) * 2048 * L3.hidden_size * 2 / cm.link_bytes_per_s(tp_group(H100x8, 2))
    assert ckpt - bare == pytest.approx(2 * L3.num_layers * per_allreduce)


def test_sp_ranks_split_the_tokens_and_the_heads():
    """Every op outside attention on seq / sp tokens (the profile of seq / sp); attention over the whole sequence
    for heads / sp (the whole sequence's attention / sp)."""
    cfg = TrainConfig(zero_stage=3, micro_batch=1, seq_len=16384, ckpt_layers=L3.num_layers)
    whole, quarter = sim(cfg), sim(replace(cfg, sequence_parallel_size=4))
    short = sim(replace(cfg, seq_len=4096))
    for term in ("compute", "elementwise"):
        assert quarter.breakdown_s[term] == pytest.approx(short.breakdown_s[term])
    assert quarter.breakdown_s["attention"] == pytest.approx(whole.breakdown_s["attention"] / 4)
    # a checkpointed block reruns its forward: seq / 4 outside attention, the whole sequence's attention / 4
    fwd_attn = whole.breakdown_s["attention"] / 3.5  # forward of fwd + 2.5 x fwd (costops.attention_s)
    short_attn = short.breakdown_s["attention"] / 3.5
    assert quarter.breakdown_s["recompute"] == pytest.approx(
        short.breakdown_s["recompute"] - short_attn + fwd_attn / 4, rel=0.01
    )
    # ZeRO shards over data and sequence parallel ranks together (world / tp = 8): the same collectives, but the
    # gradients reduced in fp32 (seq_parallel_communication_data_type's default), twice bf16's bytes
    for term in ("stage3_gather", "optimizer"):
        assert quarter.breakdown_s[term] == pytest.approx(whole.breakdown_s[term])
    assert quarter.breakdown_s["grad_reduce"] == pytest.approx(2 * whole.breakdown_s["grad_reduce"])


def test_sp_throughput_counts_one_sample_per_group():
    cfg = TrainConfig(zero_stage=3, micro_batch=1, seq_len=16384, sequence_parallel_size=4, grad_accum=2)
    s = sim(cfg)
    assert s.samples_per_s == pytest.approx(1 * 2 * (8 // 4) / s.step_time_s)  # dp = world / sp = 2
    assert s.tokens_per_s_per_gpu == pytest.approx(16384 * 2 / s.step_time_s / 4)
    assert sum(s.terms().values()) == pytest.approx(s.step_time_s)


def test_ulysses_all_to_alls_per_layer():
    """Forward: q, k, v and the output, each rank's seq / sp tokens x its heads; backward the same; a
    checkpointed layer's recompute once more (DeepSpeed-Ulysses sec. 3.2: 4Nh/P per link for MHA)."""
    cfg = TrainConfig(zero_stage=3, micro_batch=1, seq_len=16384, sequence_parallel_size=4)
    link = cm.link_bytes_per_s(sp_group(H100x8, 1, 4))
    assert link == cm.link_bytes_per_s(replace(H100x8, gpus_per_node=4))  # NVLink within the node
    per_layer = 4096 * (2 * 32 + 2 * 8) * 128 * 2  # q and out 32 heads, k and v 8
    want = 2 * L3.num_layers * (3 / 4) * per_layer / link
    assert ulysses_comm_s(L3, cfg, H100x8, cm.link_bytes_per_s, 2) == pytest.approx(want)
    assert sim(cfg).breakdown_s["sp_comm"] == pytest.approx(want)
    ckpt = replace(cfg, ckpt_layers=L3.num_layers)
    assert ulysses_comm_s(L3, ckpt, H100x8, cm.link_bytes_per_s, 2) == pytest.approx(1.5 * want)
    assert "sp_comm" not in sim(replace(cfg, sequence_parallel_size=1)).breakdown_s


def test_ulysses_across_nodes_repeats_kv_heads_and_takes_the_network():
    """sp 16 on 2 nodes of 8: the group leaves the node, so the network bounds it; 8 KV heads are repeated to
    16 before the all-to-all (ulysses_sp.py kv_replication_factor)."""
    two_nodes = parse_gpus("2x8xH100")
    cfg = TrainConfig(zero_stage=3, micro_batch=1, seq_len=32768, sequence_parallel_size=16)
    group = sp_group(two_nodes, 1, 16)
    assert (group.num_nodes, group.gpus_per_node) == (2, 8)
    assert cm.link_bytes_per_s(group) < cm.link_bytes_per_s(sp_group(H100x8, 1, 8))
    per_layer = 2048 * (2 * 32 + 2 * 16) * 128 * 2
    want = 2 * L3.num_layers * (15 / 16) * per_layer / cm.link_bytes_per_s(group)
    assert ulysses_comm_s(L3, cfg, two_nodes, cm.link_bytes_per_s, 2) == pytest.approx(want)


def test_sp_keeps_tokens_per_gpu_near_plain_data_parallel():
    """Ulysses divides a sequence's work over sp ranks; per GPU the throughput stays within the all-to-alls'
    cost of plain data parallelism (simulated: llama-3-8b, 8 x H100, seq 32768, ZeRO-3, every layer
    checkpointed)."""
    cfg = TrainConfig(zero_stage=3, micro_batch=1, seq_len=32768, ckpt_layers=L3.num_layers)
    base = sim(cfg).tokens_per_s_per_gpu
    for sp in (2, 4, 8):
        s = sim(replace(cfg, sequence_parallel_size=sp))
        assert 0.9 * base < s.tokens_per_s_per_gpu < base
