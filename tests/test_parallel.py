"""Tensor parallelism (DeepSpeed AutoTP training): the setting, its refusals, the DeepSpeed JSON, the
rank's shard the memory model prices, and one real tp 2 trial on 2 CPU ranks (docs/parallelism.md)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from cases import benchmark, spec_of, summary

from autotune.cli import main
from autotune.deepspeed_config import deepspeed_config
from autotune.errors import SpecError
from autotune.hardware import parse_gpus
from autotune.memory import estimate
from autotune.memory.tensor_parallel import local_model, local_view
from autotune.models import resolve_model
from autotune.parallel import data_parallel_size, global_batch
from autotune.train_config import TrainConfig, check_config

TWO, FOUR = parse_gpus("2xcpu"), parse_gpus("4xcpu")


def test_default_is_off_and_json_has_no_section():
    cfg = TrainConfig()
    assert cfg.autotp_size == 1
    ds = deepspeed_config(cfg, spec_of("llama"), TWO)
    assert "tensor_parallel" not in ds and ds["train_batch_size"] == 2


def test_json_and_batch_arithmetic():
    cfg = TrainConfig(autotp_size=2, micro_batch=3, grad_accum=2)
    ds = deepspeed_config(cfg, spec_of("llama"), FOUR)
    assert ds["tensor_parallel"] == {"autotp_size": 2}
    # left for DeepSpeed to derive: its check runs against the whole world before the tp groups exist
    assert "train_batch_size" not in ds
    assert data_parallel_size(cfg, 4) == 2 and global_batch(cfg, 4) == 3 * 2 * 2


@pytest.mark.parametrize(
    "family,cluster,kw,says",
    [
        ("llama", parse_gpus("3xcpu"), {}, "must divide the world size 3"),
        ("llama", TWO, dict(method="lora"), "drops lora_A/lora_B"),
        ("llama", TWO, dict(zero_stage=2, offload_optimizer=True), "offload"),
        ("gpt2", TWO, dict(seq_len=64), "AutoTP not supported for model"),
        ("mistral", parse_gpus("3xcpu"), dict(autotp_size=3), "key/value heads"),  # 6 heads, 2 kv
        ("llama", parse_gpus("3xcpu"), dict(autotp_size=3), "divide the 8 attention heads"),
    ],
)
def test_refusals(family, cluster, kw, says):
    cfg = TrainConfig(**{"autotp_size": 2, **kw})
    with pytest.raises(SpecError, match=says):
        check_config(cfg, spec_of(family), cluster)


def test_refused_for_code_without_a_tp_plan():
    with pytest.raises(SpecError, match="tp_plan"):
        check_config(TrainConfig(autotp_size=2), replace(resolve_model("tiny-llama"), implementation="builtin"), TWO)


def test_cli_exit_code_2(capsys):
    code = main(["estimate", "--model", "gpt2", "--gpus", "2xcpu", "--autotp-size", "2"])
    assert code == 2 and "AutoTP" in capsys.readouterr().err


def test_local_shard_shapes():
    """The shard the estimate prices: measured shapes of deepspeed.initialize's AutoTP at tp 2 (2 CPU ranks,
    docs/parallelism.md): Llama q (64, 128), k/v (16, 128), gate/up (168, 128), embedding whole (2048, 128),
    head (1024, 128); Qwen2's tied embedding and head vocabulary-parallel (832, 128)."""
    llama, qwen = local_model(spec_of("llama"), 2), local_model(spec_of("qwen2"), 2)
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim, llama.ffn_hidden_size) == (4, 1, 16, 168)
    layer = 64 * 128 + 2 * 16 * 128 + 128 * 64 + 3 * 168 * 128 + 2 * 128
    assert llama.num_params == 4 * layer + 2048 * 128 + 128 + 1024 * 128
    assert qwen.vocab_size == 832
    qlayer = 64 * 128 + 64 + 2 * (32 * 128 + 32) + 128 * 64 + 3 * 160 * 128 + 2 * 128
    assert qwen.num_params == 3 * qlayer + 832 * 128 + 128


def test_zero_shards_over_dp():
    model, cluster, cfg = local_view(spec_of("llama"), FOUR, TrainConfig(autotp_size=2, zero_stage=3))
    assert cluster.world_size == 2 and cfg.autotp_size == 1 and model.num_params < spec_of("llama").num_params
    big = estimate(spec_of("llama"), TWO, TrainConfig(zero_stage=0, seq_len=64))
    small = estimate(spec_of("llama"), TWO, TrainConfig(zero_stage=0, seq_len=64, autotp_size=2))
    assert small.tensor_peak_bytes < big.tensor_peak_bytes and small.num_params == big.num_params


def test_the_layout_carries_the_zero3_shards_larger_group():
    """memory.layout, worked out once per estimate: the buckets of deepspeed_config.bucket_sizes, dp = world / tp,
    and at ZeRO-3 the shard's larger flat group, which its step prices (measured: Llama tp 2 ZeRO-3 on 2 CPU ranks,
    sqrt and div 4 B x 471,040 each); no group without AutoTP at ZeRO-3."""
    from autotune.deepspeed_config import bucket_sizes
    from autotune.memory import layout

    cfg = TrainConfig(autotp_size=2, zero_stage=3)
    lay = layout(spec_of("llama"), FOUR, cfg)
    assert (lay.tp, lay.sp, lay.dp, lay.zero_ranks, lay.zero3_largest_group) == (2, 1, 2, 2, 471_040)
    assert lay.reduce_bucket_size == bucket_sizes(spec_of("llama"), cfg)["reduce_bucket_size"]
    assert layout(spec_of("llama"), FOUR, replace(cfg, zero_stage=2)).zero3_largest_group is None


@pytest.mark.slow  # the 21 AutoTP rows, each estimated with today's memory model
def test_recorded_tp_runs_meet_the_bar():
    """benchmarks/data/parallel_memory_runs.csv's AutoTP rows (tp 2 on 2 ranks under ZeRO 0-3, tp 2 x dp 2 on 4 ranks
    under ZeRO 1-3; Llama, Qwen2, Mistral), each estimated again as benchmarks/parallel_memory.py report() does, against
    its measured peak: issue 31's bar, median |error| at most 1%, worst at most 3%, never more than 1% under."""
    import csv
    import json

    parallel_memory = benchmark("parallel_memory")
    with parallel_memory.CSV.open() as f:
        rows = [r for r in csv.DictReader(f) if int(r["autotp_size"]) > 1]
    from steady import unmet_timing

    errors, unmet = [], []
    for row in rows:
        spec, cfg = spec_of(row["family"], json.loads(row["hf_config"])), parallel_memory.train_config(row)
        cluster = parallel_memory.cluster(int(row["world"]))
        check_config(cfg, spec, cluster)  # every recorded tp row is a combination autotune allows
        # the largest step, the worst timing the estimate prices (issue 51); a run none of whose steps met it all
        # reads over by up to the terms priced for it: judged apart, on the safe side and no further over than them
        est, measured = estimate(spec, cluster, cfg), parallel_memory.judged_bytes(row)
        err = est.tensor_peak_bytes / measured - 1
        (unmet if unmet_timing(est, measured) else errors).append(err)
    s = summary(errors)
    assert s["n"] + len(unmet) == 21 and {r["family"] for r in rows} == {"llama", "qwen2", "mistral"}, s
    # measured again over 16 steps (parallel_memory.py --timing) all but two met their priced timing: Llama tp 2 x dp 2
    # ZeRO-3 met the logits gather in part (+4.4%), Qwen2's ZeRO-2 fp32 run never its late-freed gradient (+1.3%)
    assert s["n"] >= 19 and s["median"] <= 1 and s["max"] <= 3 and s["under"] <= 1, s


@pytest.mark.usefixtures("shipped_traces")  # llama-3-8b's estimates, as a user's first run reads them
def test_max_seq_len_with_sp_8_is_at_least_4x_without(capsys):
    """Issue 31's done-when: `autotune estimate --model llama-3-8b --gpus 8xH100 --zero 3 --sequence-parallel-size 8
    --max-seq-len` answers at least 4 times the length of the same command without sp (measured: 60,520 against
    7,821, docs/parallelism.md)."""
    import json

    def answer(*extra):
        assert (
            main(
                [
                    "estimate",
                    "--model",
                    "llama-3-8b",
                    "--gpus",
                    "8xH100",
                    "--zero",
                    "3",
                    "--max-seq-len",
                    "--json",
                    *extra,
                ]
            )
            == 0
        )
        return json.loads(capsys.readouterr().out)["max_seq_len"]

    plain, sp = answer(), answer("--sequence-parallel-size", "8")
    assert sp % 8 == 0 and sp >= 4 * plain > 0, (plain, sp)


@pytest.mark.slow
def test_real_tp2_trial_matches_the_estimate(tmp_path):
    """Llama at tp 2, ZeRO-1 bf16, on 2 gloo ranks: it trains, each rank holds the shard local_model prices
    (to the byte), and the estimate meets the bar against the steady peak (tests/steady.py). Then the same
    without tp in the same run_trials call: DeepSpeed's tp groups outlive an engine, so it runs in a process
    group of its own (launch.run_node), and holds the whole model."""
    from steady import timing_allowance, worst_peak

    from autotune.trial import run_trials
    from autotune.trial.record import TrialRequest

    spec, cfg = spec_of("llama"), TrainConfig(autotp_size=2, zero_stage=1, micro_batch=2, seq_len=64)
    check_config(cfg, spec, TWO)
    res, plain = run_trials(
        [
            TrialRequest(
                model=spec,
                cluster=TWO,
                config=c,
                steps=2,
                warmup_steps=1,
                timeout_s=300,
                out_dir=tmp_path / str(c.autotp_size),
            )
            for c in (cfg, replace(cfg, autotp_size=1))
        ]
    )
    assert res.status == "ok", res.reason + res.log_tail
    assert res.losses[-1] < res.losses[0]
    assert res.samples_per_s == pytest.approx(2 * 1 / res.step_time_s)  # micro batch x dp 1 x grad accum
    assert res.param_bytes_per_rank == [2 * local_model(spec, 2).num_params] * 2
    est = estimate(spec, TWO, cfg)  # the worst timing, against the worst step (issue 51)
    err = est.tensor_peak_bytes / worst_peak(res) - 1
    assert -0.01 <= err <= 0.03 + timing_allowance(est, worst_peak(res)), err
    assert plain.status == "ok", plain.reason + plain.log_tail
    assert plain.param_bytes_per_rank == [2 * spec.num_params] * 2


def test_tp_comm_prices_four_allreduces_per_layer_and_the_gathered_head():
    from autotune.costmodel import link_bytes_per_s, simulate
    from autotune.costops.parallel import tp_comm_s

    model, cluster = resolve_model("llama-3-8b"), parse_gpus("8xH100")
    cfg = TrainConfig(zero_stage=1, autotp_size=2, micro_batch=1, seq_len=4096)
    link = link_bytes_per_s(replace(cluster, gpus_per_node=2))
    act = 4096 * model.hidden_size * 2
    want = (model.num_layers * 4 * 2 * act / 2 + 4096 * model.vocab_size * 2 / 2) / link
    assert tp_comm_s(model, cfg, cluster, link_bytes_per_s, 2) == pytest.approx(want)
    assert simulate(model, cluster, cfg).breakdown_s["tp_comm"] == pytest.approx(want)
    assert "tp_comm" not in simulate(model, cluster, replace(cfg, autotp_size=1)).breakdown_s


def test_deepcompile_is_a_json_section_refused_on_cpu_and_at_zero_0():
    cfg = TrainConfig(zero_stage=1, deepcompile=True)
    assert deepspeed_config(cfg, spec_of("llama"), parse_gpus("8xH100"))["compile"] == {"deepcompile": True}
    check_config(cfg, spec_of("llama"), parse_gpus("8xH100"))
    with pytest.raises(SpecError, match="CUDA only"):
        check_config(cfg, spec_of("llama"), TWO)
    with pytest.raises(SpecError, match="ZeRO stage 1-3"):
        TrainConfig(zero_stage=0, deepcompile=True)
    assert (
        estimate(spec_of("llama"), parse_gpus("8xH100"), cfg).tensor_peak_bytes
        == estimate(spec_of("llama"), parse_gpus("8xH100"), replace(cfg, deepcompile=False)).tensor_peak_bytes
    )


def test_throughput_counts_a_tp_groups_batch_once():
    """The tp ranks of a group train one micro batch: samples/s over dp ranks, tokens/s per GPU shared by tp."""
    from autotune.costmodel import simulate

    model, cluster = resolve_model("llama-3-8b"), parse_gpus("8xH100")
    s = simulate(model, cluster, TrainConfig(zero_stage=1, autotp_size=2, micro_batch=1, seq_len=4096))
    assert s.samples_per_s == pytest.approx(1 * 4 / s.step_time_s)
    assert s.tokens_per_s_per_gpu == pytest.approx(4096 / s.step_time_s / 2)


def test_global_batch_counts_data_parallel_ranks():
    from autotune.search.space import SearchSpace, expand

    space = SearchSpace.of(autotp_size=(1, 2), zero_stage=(1,), micro_batch=(2,), ckpt_layers=(0,))
    exp = expand(space, spec_of("llama"), FOUR, seq_len=64, global_batch=16)
    accum = {c.autotp_size: c.grad_accum for c in exp.candidates}
    assert accum == {1: 16 // (2 * 4), 2: 16 // (2 * 2)}


def test_families_autotp_fails_on_or_misprices_are_refused():
    """benchmarks/parallel_families.py at tp 2 (2 CPU ranks): Mixtral's tp_plan has styles DeepSpeed 0.19.8 rejects
    whole (at ZeRO-1 and -3); Gemma2's per-rank peak is 18.4% above the estimate at ZeRO-0 and -1, exact at ZeRO-3."""
    from test_sequence_parallel import hf_spec

    mixtral = hf_spec("mixtral", num_local_experts=4, num_experts_per_tok=2, head_dim=16)
    with pytest.raises(SpecError, match="partition styles DeepSpeed 0.19.8 does not apply"):
        check_config(TrainConfig(autotp_size=2, zero_stage=3, seq_len=64), mixtral, parse_gpus("2xcpu"))
    gemma2 = hf_spec("gemma2", head_dim=16)
    for z in (0, 1, 2):
        with pytest.raises(SpecError, match="gemma2 at ZeRO-"):
            check_config(
                TrainConfig(autotp_size=2, zero_stage=z, seq_len=64, attention="eager"), gemma2, parse_gpus("2xcpu")
            )
    check_config(TrainConfig(autotp_size=2, zero_stage=3, seq_len=64, attention="eager"), gemma2, parse_gpus("2xcpu"))
