"""Ulysses sequence parallelism (DeepSpeed ALST, `sequence_parallel_size`): the setting, its refusals, the DeepSpeed
JSON, the batch arithmetic, the per-rank memory terms, the recorded runs' bar, and one real sp 2 trial on 2 CPU ranks
(docs/parallelism.md)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.deepspeed_config import deepspeed_config
from autotune.errors import SpecError
from autotune.hardware import parse_gpus
from autotune.memory import estimate
from autotune.memory.sequence_parallel import all_to_all_terms, local_view
from autotune.models import resolve_model
from autotune.parallel import data_parallel_size, global_batch
from autotune.train_config import TrainConfig, check_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from hf_memory import spec_of  # noqa: E402

TWO, FOUR = parse_gpus("2xcpu"), parse_gpus("4xcpu")


def test_default_is_off_and_json_has_no_key():
    cfg = TrainConfig()
    assert cfg.sequence_parallel_size == 1
    ds = deepspeed_config(cfg, spec_of("llama"), FOUR)
    assert "sequence_parallel_size" not in ds and ds["train_batch_size"] == 4


def test_json_and_batch_arithmetic():
    """dp = world / sp; train_batch_size is left for DeepSpeed to derive (micro x grad accum x world / sp): the HF
    Trainer refuses the key written, as its check ignores sp (tests/test_export_sp.py)."""
    cfg = TrainConfig(sequence_parallel_size=2, micro_batch=3, grad_accum=2, seq_len=64)
    ds = deepspeed_config(cfg, spec_of("llama"), FOUR)
    assert ds["sequence_parallel_size"] == 2 and "train_batch_size" not in ds
    assert ds["train_micro_batch_size_per_gpu"] == 3 and ds["gradient_accumulation_steps"] == 2
    assert data_parallel_size(cfg, 4) == 2 and global_batch(cfg, 4) == 3 * 2 * 2
    assert "sp2" in cfg.short()


@pytest.mark.parametrize("family,cluster,kw,says", [
    ("llama", parse_gpus("3xcpu"), {}, "must divide the world size 3"),
    ("llama", TWO, dict(seq_len=63), "must divide seq_len 63"),
    ("llama", TWO, dict(attention="eager"), "eager attn_implementation isn't currently supported"),
    ("gpt2", TWO, dict(seq_len=64), "num_key_value_heads"),
    ("gpt_neox", TWO, dict(seq_len=64), "num_key_value_heads"),
    ("mistral", FOUR, dict(sequence_parallel_size=4), "divide the 6 attention heads"),
    ("mistral", parse_gpus("3xcpu"), dict(sequence_parallel_size=3), "key/value heads must divide one another"),
    ("llama", FOUR, dict(autotp_size=2), "self.mpu = groups"),
    ("llama", TWO, dict(zero_stage=2, offload_optimizer=True), "offload"),
])
def test_refusals(family, cluster, kw, says):
    cfg = TrainConfig(**{"sequence_parallel_size": 2, "seq_len": 64, **kw})
    with pytest.raises(SpecError, match=says):
        check_config(cfg, spec_of(family), cluster)


def test_lora_and_kv_replication_are_allowed():
    check_config(TrainConfig(sequence_parallel_size=2, seq_len=64, method="lora"), spec_of("llama"), TWO)
    check_config(TrainConfig(sequence_parallel_size=4, seq_len=64), spec_of("qwen2"), FOUR)   # 4 heads, 2 KV heads


@pytest.mark.parametrize("cluster", [TWO, FOUR])
@pytest.mark.parametrize("kw", [dict(offload_optimizer=True), dict(offload_param="cpu"),
                                dict(offload_optimizer=True, offload_param="cpu")])
def test_zero3_offload_is_allowed_and_priced_with_both_terms(cluster, kw):
    """ZeRO-3 with offload under Ulysses (measured at sp 2 on 2 ranks and sp 2 x dp 2 on 4, Llama and Qwen2,
    benchmarks/parallel_memory.py SP_OFFLOAD): the estimate is offload's terms (on CPU ranks the offloaded fp32
    partition, its moments and fp32 gradients are in the rank's memory, memory/model_states.py states) beside
    Ulysses' (memory/sequence_parallel.py all_to_all_terms)."""
    spec = spec_of("llama")
    cfg = TrainConfig(sequence_parallel_size=2, zero_stage=3, micro_batch=2, seq_len=64, **kw)
    check_config(cfg, spec, cluster)
    est, plain = estimate(spec, cluster, cfg), estimate(spec, cluster, replace(cfg, seq_len=32, sequence_parallel_size=1))
    q = 2 * 32 * 8 * 16 * 2   # b x seq / sp x heads x head_dim x 2 B
    assert est.phases["forward"] == plain.phases["forward"] + 4 * q + q   # o_proj's inputs, the all-to-all's gradient
    if cfg.offload_optimizer:
        assert est.terms["offloaded_fp32_gradients"] == 4 * spec.num_params // cluster.world_size


@pytest.mark.parametrize("kw,says", [
    (dict(zero_stage=1, offload_optimizer=True), "ZeRO stage 1 is not priced"),
    (dict(zero_stage=2, offload_optimizer=True), "ZeRO stage 2 is not priced"),
    (dict(zero_stage=3, offload_optimizer=True, method="lora"), "method lora is not measured"),
])
def test_offload_that_stays_refused(kw, says):
    with pytest.raises(SpecError, match=says):
        check_config(TrainConfig(sequence_parallel_size=2, seq_len=64, **kw), spec_of("llama"), FOUR)


def test_cli_exit_code_2_for_zero2_offload(capsys):
    code = main(["estimate", "--model", "llama-3-8b", "--gpus", "8xH100", "--sequence-parallel-size", "2",
                 "--seq-len", "4096", "--zero", "2", "--offload-optimizer"])
    assert code == 2 and "ZeRO stage 2 is not priced" in capsys.readouterr().err


def test_refused_for_code_without_hf_attention():
    with pytest.raises(SpecError, match="ALL_ATTENTION_FUNCTIONS"):
        check_config(TrainConfig(sequence_parallel_size=2, seq_len=64),
                     replace(resolve_model("tiny-llama"), implementation="builtin"), TWO)


def test_cli_exit_code_2(capsys):
    code = main(["estimate", "--model", "gpt2", "--gpus", "2xcpu", "--sequence-parallel-size", "2", "--seq-len", "64"])
    assert code == 2 and "num_key_value_heads" in capsys.readouterr().err


def test_a_rank_is_the_whole_model_at_seq_over_sp_plus_the_all_to_alls():
    """ZeRO shards over the whole world (the sequence-data-parallel group); the activations are those of seq / sp;
    Ulysses adds o_proj's own input per saved layer, the live all-to-all gradient, and at ZeRO-0 bf16 the fp32
    all-reduce copy (memory/sequence_parallel.py, each measured)."""
    spec = spec_of("llama")
    cfg = TrainConfig(sequence_parallel_size=2, zero_stage=0, micro_batch=2, seq_len=128)
    model, cluster, local = local_view(spec, TWO, cfg)
    assert (model, cluster, local.seq_len, local.sequence_parallel_size) == (spec, TWO, 64, 1)
    q = 2 * 64 * 8 * 16 * 2
    terms = all_to_all_terms(spec, cfg)
    assert terms["forward"] == {"sp_attention_output": 4 * q, "sp_all_to_all_grad": q}
    assert terms["backward (end)"]["sp_fp32_allreduce"] == 4 * spec.num_params
    plain, sp = estimate(spec, TWO, replace(cfg, seq_len=64, sequence_parallel_size=1)), estimate(spec, TWO, cfg)
    assert sp.phases["forward"] == plain.phases["forward"] + 5 * q
    assert sp.num_params == plain.num_params


@pytest.mark.slow   # 22 traced estimates, ~1 min on 2 cores
def test_recorded_runs_meet_the_bar():
    """benchmarks/data/parallel_memory_runs.csv's Ulysses rows against today's estimate (issue 31's bar): the median
    over all of them; worst and worst under over all but the rows parallel_memory.OPEN lists with why (each still
    checked: no worse than recorded in docs/parallelism.md)."""
    import parallel_memory

    report = parallel_memory.report(sp_only=True)
    s, closed = report["sp"], report["sp_closed"]
    assert s["n"] >= 8 and s["median"] <= 1, s
    assert closed["n"] >= s["n"] - len(parallel_memory.OPEN)
    assert closed["max"] <= 3 and closed["under"] <= 1, closed
    assert s["under"] <= 6, s


def test_zero1_fp32_reduction_and_gloo_allgather_are_priced_as_measured():
    """The two phases that closed the last open rows (docs/parallelism.md), against the tensors measured at each
    peak: Mistral sp 2 x dp 2, ZeRO-1 bf16, rank 2 at the LM head's reduction (its slices of ranks 2 and 3
    flattened, 172,800 x 2 B, and cast to fp32, x 4 B; rank 2's whole-parameter partition, 672,192 B); Llama sp 2 x
    dp 2, ZeRO-2 fp32, gloo's all-gather output after the step (c10d::_allgather_base_, P x 4 B = 4,821,504 B),
    which NCCL does not allocate (priced on CPU ranks only)."""
    mistral = spec_of("mistral")
    cfg = TrainConfig(sequence_parallel_size=2, zero_stage=1, precision="bf16", micro_batch=2, seq_len=64)
    est = estimate(mistral, FOUR, cfg)
    assert est.phase == "backward (end, fp32 reduce)"
    vh = mistral.vocab_size * mistral.hidden_size
    assert (est.terms["sp_fp32_reduce"], est.terms["reduce_flatten"], est.terms["gradient_partition"]) == \
        (4 * vh, 2 * vh, 672_192)
    assert abs(est.tensor_peak_bytes / 5_984_060 - 1) < 0.01   # measured (parallel_memory_runs.csv)
    assert "backward (end, fp32 reduce)" not in estimate(mistral, FOUR, replace(cfg, sequence_parallel_size=1)).phases

    llama = spec_of("llama")
    cfg = TrainConfig(sequence_parallel_size=2, zero_stage=2, precision="fp32", micro_batch=1, ckpt_layers=1,
                      seq_len=96)
    est = estimate(llama, FOUR, cfg)
    assert est.phase == "optimizer (all-gather)" and est.terms["gloo_allgather_output"] == 4 * llama.num_params
    assert abs(est.tensor_peak_bytes / 13_259_228 - 1) < 0.01
    assert "optimizer (all-gather)" not in estimate(llama, parse_gpus("4xH100"), cfg).phases


def test_max_seq_len_with_sp_is_a_multiple_of_sp_and_grows():
    from autotune.memory.limits import largest_fitting

    spec, cluster = spec_of("llama"), parse_gpus("2xcpu")
    cfg = TrainConfig(zero_stage=1, micro_batch=2, seq_len=64)
    cluster = replace(cluster, gpu=replace(cluster.gpu, memory_bytes=64 * 2**20))
    plain = largest_fitting(spec, cluster, cfg, "seq_len")
    sp = largest_fitting(spec, cluster, replace(cfg, sequence_parallel_size=2), "seq_len")
    assert sp % 2 == 0 and sp > plain > 0


@pytest.mark.slow
def test_real_sp2_trial_matches_the_estimate(tmp_path):
    """Llama at sp 2, ZeRO-1 bf16, on 2 gloo ranks: it trains (the loss falls), every rank holds the whole model,
    samples/s counts one micro batch per sp group, and the estimate meets the bar against the steady peak."""
    from steady import steady_peak

    from autotune.trial import run_trials
    from autotune.trial.record import TrialRequest

    spec, cfg = spec_of("llama"), TrainConfig(sequence_parallel_size=2, zero_stage=1, micro_batch=2, seq_len=128)
    check_config(cfg, spec, TWO)
    [res] = run_trials([TrialRequest(model=spec, cluster=TWO, config=cfg, steps=2, warmup_steps=1, timeout_s=300,
                                     out_dir=tmp_path / "sp2")])
    assert res.status == "ok", res.reason + res.log_tail
    assert res.losses[-1] < res.losses[0]
    assert res.samples_per_s == pytest.approx(2 * 1 / res.step_time_s)   # micro batch x dp 1 x grad accum
    assert res.param_bytes_per_rank == [2 * spec.num_params] * 2
    err = estimate(spec, TWO, cfg).tensor_peak_bytes / steady_peak(res) - 1
    assert -0.01 <= err <= 0.03, err


@pytest.mark.slow
def test_sp2_trains_as_one_rank_does(tmp_path):
    """The same batch and weights (ZeRO-0 fp32, the Llama of benchmarks/hf_memory.py) at sp 2 on 2 ranks and
    without sp on 1 rank give the same loss at every step (measured 7.6445, 7.4634, 7.3348 on both): each rank's
    share of the token-weighted loss, summed by DeepSpeed over the sp ranks, is the plain step's loss and gradient."""
    from autotune.trial import run_trial
    from autotune.trial.record import TrialRequest

    spec, cfg = spec_of("llama"), TrainConfig(zero_stage=0, precision="fp32", micro_batch=2, seq_len=64)
    one, sp = (run_trial(TrialRequest(model=spec, cluster=parse_gpus(f"{w}xcpu"), config=c, steps=2, warmup_steps=1,
                                      timeout_s=300, out_dir=tmp_path / str(w)))
               for w, c in ((1, cfg), (2, replace(cfg, sequence_parallel_size=2))))
    assert one.status == sp.status == "ok", one.reason + sp.reason + sp.log_tail
    assert sp.losses == pytest.approx(one.losses, abs=1e-4) and sp.losses[-1] < sp.losses[0]
