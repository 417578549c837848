"""The knobs of issue #14 against the real components: 2-rank DeepSpeed trials on CPU (gloo) for
grad_accum_dtype, reduce_bucket_size and overlap_comm, all in ONE process group (run_trials), the
measured peak against the memory model (the stand-in's code, whose analytic activation terms are
exact, so the knobs' own terms are what is judged); DeepSpeed's own config parser where a knob
cannot run here.
"""

from __future__ import annotations

import pytest
from steady import per_rank_steps, timing_allowance, worst_peak

from autotune.deepspeed_config import deepspeed_config
from autotune.errors import SpecError
from autotune.hardware import parse_gpus
from autotune.memory import estimate
from autotune.memory.buffers import TIMING_TERMS
from autotune.models import resolve_model
from autotune.train_config import TrainConfig

CLUSTER = parse_gpus("2xcpu")
BIG = 4_000_000
"""A reduce bucket larger than tiny-llama (1.26M parameters): the bucket then dominates backward, so
its bytes (and overlap_comm's second one) are what the peak measures."""

KNOBS = (
    [
        dict(zero_stage=z, precision="bf16", **kw)
        for z in (1, 2)
        for kw in (
            {"overlap_comm": True},
            {"grad_accum_dtype": "fp32"},
            {"reduce_bucket_size": 50_000},
            {"reduce_bucket_size": 50_000, "overlap_comm": True},
            {"reduce_bucket_size": BIG},
            {"reduce_bucket_size": BIG, "overlap_comm": True},
            {"reduce_bucket_size": BIG, "grad_accum_dtype": "fp32"},
            {"reduce_bucket_size": BIG, "grad_accum_dtype": "fp32", "overlap_comm": True},
        )
    ]
    + [
        dict(zero_stage=3, precision="bf16", grad_accum_dtype="fp32"),
        dict(zero_stage=3, precision="bf16", reduce_bucket_size=BIG),
        dict(zero_stage=1, precision="fp32", reduce_bucket_size=BIG, overlap_comm=True),
        dict(zero_stage=2, precision="fp32", reduce_bucket_size=BIG, overlap_comm=True),
        dict(zero_stage=3, precision="bf16", offload_param="cpu"),
        dict(zero_stage=3, precision="fp32", offload_param="cpu", ckpt_layers=2),
        dict(zero_stage=3, precision="bf16", stage3_param_persistence_threshold=1),
        dict(zero_stage=3, precision="bf16", stage3_param_persistence_threshold=1_000_000),
    ]
    + [
        dict(zero_stage=3, precision="bf16", **kw)
        for kw in (
            {},
            {"stage3_prefetch_bucket_size": 1},
            {"stage3_prefetch_bucket_size": 500_000},
            {"stage3_prefetch_bucket_size": BIG},
            {"stage3_max_live_parameters": 1},
            {"stage3_prefetch_bucket_size": BIG, "stage3_max_live_parameters": 600_000},
        )
    ]
    + [
        dict(zero_stage=z, precision="bf16", bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
        for z in (1, 2, 3)
    ]
)
IDS = ["-".join(f"{k}={v}" for k, v in kw.items()) for kw in KNOBS]

UNDER, OVER = 0.01, 0.03
"""tests/test_trial.py's tolerance: at most 1% under the measured peak, at most 3% over."""


def unpriced_late_copy(model, cfg: TrainConfig, worst: int) -> float:
    """The one late free that is not priced, as a fraction of `worst`: DeepSpeed's BF16_Optimizer (ZeRO-1 bf16 with fp32
    accumulation) all-reduces the gradients through a bf16 copy (engine.py allreduce_bucket), which gloo's worker thread
    held into the step's peak in one step of 30 on one rank of the stand-in (+P x 2 B) and in one CI run, and in none
    of 64 steps of issue 51's case 2, whose estimate would read +9.6% with it (docs/memory.md, "Known open errors")."""
    from autotune.memory.buffers import bf16_optimizer
    from autotune.train_config import dtype_bytes

    return dtype_bytes(cfg.precision) * model.num_params / worst if bf16_optimizer(cfg) else 0.0


JITTER = 256
"""Two runs of one program: the same peak but for the few bytes of scalars that gloo's threads free a
moment earlier or later (trial/launch.py LEAK_TOLERANCE_BYTES: up to ~100 B measured)."""


def _cfg(kw: dict) -> TrainConfig:
    return TrainConfig(**{"micro_batch": 1, "seq_len": 32, **kw})


@pytest.fixture(scope="module")
def knob_runs(tmp_path_factory):
    """Every real trial of this module in ONE process group (run_trials): the stand-in's knob trials
    (`measured`), then those of transformers' code (`measured_on_hf`), which had a group of their own:
    torch and DeepSpeed are imported and gloo set up once instead of twice. Each config is still
    measured on its own (launch.run_trials: peaks relative to the live bytes before its model is
    built, worker.release between configs), and the stand-in's run before transformers' ones, as
    when `measured` ran first in its own group. (measured requests, results), (measured_on_hf's)."""
    from autotune.trial import run_trials

    own, on_hf = _measured_requests(tmp_path_factory), _measured_on_hf_requests(tmp_path_factory)
    results = run_trials([*own, *(r for _, r in on_hf)])
    return (own, results[: len(own)]), (on_hf, results[len(own) :])


@pytest.fixture(scope="module")
def measured(knob_runs):
    reqs, results = knob_runs[0]
    return dict(zip(IDS, zip(reqs, results)))


def _measured_requests(tmp_path_factory):
    from autotune.trial.record import TrialRequest

    root = tmp_path_factory.mktemp("knobs")
    # The knob terms were measured on the stand-in, whose activations the analytic model prices
    # exactly. With transformers' Llama (the default code) 1 of these misses, +14.3% over (the
    # persistence threshold; benchmarks/knobs_on_hf.py; docs/memory.md, "Known open errors"): open,
    # stated there, not hidden by a wider tolerance here.
    model = resolve_model("tiny-llama", implementation="builtin")
    return [
        TrialRequest(
            model=model, cluster=CLUSTER, config=_cfg(kw), out_dir=root / str(i), steps=2, warmup_steps=1, timeout_s=300
        )
        for i, kw in enumerate(KNOBS)
    ]


@pytest.mark.slow
@pytest.mark.parametrize("key", IDS)
def test_knob_measured_peak_matches_estimate(measured, key):
    req, res = measured[key]
    assert res.status == "ok", f"{res.reason}\n{res.log_tail}"
    est = estimate(req.model, req.cluster, req.config)
    # against the worst step (the estimate prices the worst timing, issue 51); a run none of whose steps met it reads
    # over by the terms priced for it (steady.timing_allowance)
    worst = worst_peak(res)
    err = est.tensor_peak_bytes / worst - 1
    assert -UNDER - unpriced_late_copy(req.model, req.config, worst) <= err <= OVER + timing_allowance(est, worst), (
        f"estimate {est.tensor_peak_bytes:,} ({est.phase}) vs measured "
        f"{per_rank_steps(res)} {res.phase_peak_bytes}: {100 * err:+.2f}%"
    )


@pytest.mark.slow
def test_overlap_comm_adds_one_bucket(measured):
    """overlap_comm's second bucket, measured: the backward peak grows by one reduce bucket (4e6 bf16)."""
    for z in (1, 2):
        one = measured[f"zero_stage={z}-precision=bf16-reduce_bucket_size={BIG}"][1]
        two = measured[f"zero_stage={z}-precision=bf16-reduce_bucket_size={BIG}-overlap_comm=True"][1]
        # + a few KB of gloo scalars; and the run-to-run third partition (late_freed_partition) in either run
        diff = two.phase_peak_bytes["backward"] - one.phase_peak_bytes["backward"]
        part = 2 * resolve_model("tiny-llama", implementation="builtin").num_params // 2  # bf16, 2 ranks
        assert min(abs(diff - 2 * BIG - k * part) for k in (-1, 0, 1)) < 16384, diff


@pytest.mark.slow
def test_fp32_accumulation_at_stage_1_keeps_fp32_gradients(measured):
    """bf16 + grad_accum_dtype fp32 at ZeRO-1 runs BF16_Optimizer: 4 B/param of fp32 gradients for the
    whole run (the forward peak grows by 4P), and the reduce bucket is not used (same peak with 4e6)."""
    model = resolve_model("tiny-llama", implementation="builtin")  # the code the trials ran
    p = model.num_params
    fp32 = measured["zero_stage=1-precision=bf16-grad_accum_dtype=fp32"][1]
    big = measured[f"zero_stage=1-precision=bf16-reduce_bucket_size={BIG}-grad_accum_dtype=fp32"][1]
    base = estimate(model, CLUSTER, _cfg(dict(zero_stage=1, precision="bf16")))
    assert fp32.phase_peak_bytes["forward"] - base.phases["forward"] == pytest.approx(4 * p, abs=4096)
    # the same peak but for 2P more at the step in one step of one CI run (25,254,436 against 22,728,996 B on
    # 2026-12-01; not seen since: docs/measurements/memory.md, "Issue 51")
    diff = big.peak_bytes - fp32.peak_bytes
    assert min(abs(diff - k * 2 * p) for k in (-1, 0, 1)) < 16384, diff


S3 = [k for k in IDS if k.startswith("zero_stage=3-precision=bf16") and ("stage3_prefetch" in k or "stage3_max" in k)]


@pytest.mark.slow
@pytest.mark.parametrize("key", S3)
def test_stage3_prefetch_forward_peak_matches_estimate(measured, key):
    """The prefetch's peak is in forward, before the LM head (model_states.zero3_prefetch), under the
    optimizer's on this model: the measured forward peak against the estimate's forward points."""
    req, res = measured[key]
    assert res.status == "ok", f"{res.reason}\n{res.log_tail}"
    est = estimate(req.model, req.cluster, req.config).phases
    fwd = max(est["forward"], est.get("forward (prefetch)", 0))
    err = fwd / res.phase_peak_bytes["forward"] - 1
    assert -UNDER <= err <= OVER, (fwd, res.phase_peak_bytes, f"{100 * err:+.2f}%")


@pytest.mark.slow
@pytest.mark.parametrize(
    "bucket",
    [
        BIG,
        pytest.param(
            200_000,
            marks=pytest.mark.xfail(
                reason="open: transformers' tiny-llama with a 2e5 bucket measured +0.24%, +0.59% and -1.16% against the "
                "estimate in three runs (14,521,753 B the highest): several prefetch buffers in flight at once, as with 5e5 "
                "(docs/memory.md)",
                strict=False,
            ),
        ),
        pytest.param(
            500_000,
            marks=pytest.mark.xfail(
                reason="open: transformers' tiny-llama with a 5e5 bucket measured 14,917,273 to 15,270,681 B over seven runs "
                "(-2.08% to +0.24% against the estimate): at the forward's start gloo's own all-gather output is "
                "live in some runs (docs/memory.md)",
                strict=False,
            ),
        ),
    ],
)
def test_stage3_prefetch_on_transformers_code_matches_the_traced_tier(measured_on_hf, bucket):
    """transformers' Llama (the traced tier): its top modules own no parameters, so the embedding is
    prefetched with the rest; the forward peak against the traced forward points (measured: -0.29% with
    4e6, where one buffer holds every parameter; with smaller buckets the error varies from run to run)."""
    req, res = measured_on_hf[f"z3-prefetch-{bucket}"]
    model, cfg = req.model, req.config
    assert res.status == "ok", f"{res.reason}\n{res.log_tail}"
    est = estimate(model, CLUSTER, cfg).phases
    err = est["forward (prefetch)"] / res.phase_peak_bytes["forward"] - 1
    assert -UNDER <= err <= OVER, (est, res.phase_peak_bytes, f"{100 * err:+.2f}%")


ON_HF = {
    # stage 2's first reduction (partition, bucket, a second partition, the fp32 extras) happens at the
    # LM head's gradient with every activation saved, a moment DeepSpeed makes and the trace cannot
    # see (traced._with_head_phase); without it these were 7.4% and 11.8% under
    "z2-one-bucket": dict(zero_stage=2, precision="bf16", reduce_bucket_size=BIG),
    "z2-one-bucket-fp32-accumulation": dict(
        zero_stage=2, precision="bf16", reduce_bucket_size=BIG, grad_accum_dtype="fp32"
    ),
    # the update's temporaries in the master weights' dtype (traced._trace_step); priced in fp32 this
    # was 25% over
    "z2-bf16-master-and-states": dict(
        zero_stage=2, precision="bf16", bf16_master_weights_and_grads=True, bf16_optimizer_states=True
    ),
    # on CPU ranks the host is the device: the offloaded fp32 partition, moments and fp32 gradients
    # are in the measured memory (model_states.states); left out, this was 45% under
    "z3-offload-optimizer": dict(zero_stage=3, precision="bf16", offload_optimizer=True),
    # stage 1 reduces only at the accumulation boundary: whole gradients between micro batches
    # (buffers.accumulated_gradients); priced as the partition, GPT-2 was 7.1% under
    "z1-grad-accum-2": dict(zero_stage=1, precision="fp32", grad_accum=2),
    # ZeRO-Offload carries the gradients between micro steps in host buffers, one per parameter of
    # the partition, kept for the run (model_states.offload_accumulates_on_host); without them the
    # step was 6.24% under on GPT-2
    "z2-offload-grad-accum-2": dict(zero_stage=2, precision="bf16", offload_optimizer=True, grad_accum=2),
    # stage 2 with grad_accum > 1 holds a second partition at the end of backward
    # (buffers.backward_end_extra), where a tied GPT-2 peaks (its embedding's gradient): 2.1% under without it
    "z2-grad-accum-2-gpt2": dict(zero_stage=2, precision="fp32", grad_accum=2, model="tiny-gpt2"),
    # stage 1 keeps its reduce bucket between micro steps (buffers.carried_reduce_bucket): 4.6% under
    # without it with this bucket
    "z1-grad-accum-2-bucket": dict(
        zero_stage=1,
        precision="fp32",
        grad_accum=2,
        reduce_bucket_size=300_000,
        micro_batch=2,
        seq_len=64,
        ckpt_layers=1,
    ),
    # offload with fp32 accumulation reduces into a compact fp32 partition on the device, kept through
    # the step (buffers.offload_fp32_partition): 4.07% under without it (a random draw's case)
    "z2-offload-fp32-accumulation-gpt2": dict(
        zero_stage=2,
        precision="bf16",
        offload_optimizer=True,
        grad_accum_dtype="fp32",
        reduce_bucket_size=50_000,
        micro_batch=1,
        seq_len=32,
        ckpt_layers=2,
        model="tiny-gpt2",
    ),
    # at stages 2-3 the LM head's weight gradient is live beside the logits' gradient before DeepSpeed's
    # hook takes it (traced._stage_terms, head_gradient); where the logits are small that moment is the
    # peak: 2.54% under without it
    "z3-head-gradient-small-logits": dict(zero_stage=3, precision="fp32", micro_batch=1, seq_len=64, ckpt_layers=2),
    # stage 1 with overlap_comm reduces during backward: partition and two buckets beside the saved
    # activations, the embedding's transient beside them (buffers.stage1_reduces_in_backward); 2.21% under
    # without it
    "z1-overlap-small-bucket-gpt2": dict(
        zero_stage=1,
        precision="fp32",
        overlap_comm=True,
        reduce_bucket_size=50_000,
        micro_batch=2,
        seq_len=32,
        ckpt_layers=1,
        model="tiny-gpt2",
    ),
    # one bucket larger than the model (issue 30): stage 1 allocates its buckets at the first gradient,
    # reduced or not, and with overlap_comm the gradients are views of them (buffers.buckets_in_backward,
    # stage1_gradients_in_bucket); Llama's shape was 2.27% under without that, the peak in the layers'
    # backward. Stage 2 allocates its partition only at the end there (buffers.stage2_reduces_at_end):
    # priced from the head's gradient on it was 2.31% over
    "z1-overlap-one-big-bucket": dict(
        zero_stage=1, precision="fp32", overlap_comm=True, reduce_bucket_size=20_000_000, micro_batch=2, seq_len=64
    ),
    "z2-overlap-one-big-bucket": dict(
        zero_stage=2,
        precision="bf16",
        overlap_comm=True,
        reduce_bucket_size=20_000_000,
        micro_batch=2,
        seq_len=64,
        ckpt_layers=1,
    ),
}
PHASE_ONLY = {
    # stage 1 in 16 bits with offload and fp32 accumulation holds its whole gradients in fp32
    # (buffers.stage1_grad_bytes): the second micro step's forward was 11.5% under in bf16. Its
    # backward peak varies by 524,288 B between runs (22,403,172 or 22,927,460), so only the forward
    # is checked (test_stage1_fp32_accumulation_carries_fp32_gradients)
    "z1-offload-fp32-accumulation-gpt2": dict(
        zero_stage=1,
        precision="bf16",
        offload_optimizer=True,
        grad_accum_dtype="fp32",
        grad_accum=2,
        reduce_bucket_size=50_000,
        micro_batch=1,
        seq_len=32,
        ckpt_layers=2,
        model="tiny-gpt2",
    ),
}


@pytest.fixture(scope="module")
def measured_on_hf(knob_runs):
    named, results = knob_runs[1]
    return {name: (req, res) for (name, req), res in zip(named, results)}


def _measured_on_hf_requests(tmp_path_factory):
    from autotune.trial.record import TrialRequest

    root = tmp_path_factory.mktemp("knobs-hf")
    # transformers' code, the default; tiny-llama where a case names no other model
    # with the stage-3 prefetch cases of the test above: every trial of transformers' code in one group
    runs = {
        **ON_HF,
        **PHASE_ONLY,
        **{
            f"z3-prefetch-{b}": dict(zero_stage=3, precision="bf16", stage3_prefetch_bucket_size=b)
            for b in (BIG, 200_000, 500_000)
        },
    }
    return [
        (
            name,
            TrialRequest(
                model=resolve_model(kw.get("model", "tiny-llama")),
                cluster=CLUSTER,
                config=_cfg({k: v for k, v in kw.items() if k != "model"}),
                out_dir=root / name,
                steps=2,
                warmup_steps=1,
                timeout_s=300,
            ),
        )
        for name, kw in runs.items()
    ]


@pytest.mark.slow
@pytest.mark.parametrize("name", ON_HF)
def test_knobs_on_transformers_code_match_the_traced_tier(measured_on_hf, name):
    """Knobs whose terms the traced tier composes with transformers' Llama (the default code), real
    trials in one process group: the measured peak within the test's tolerance."""
    req, res = measured_on_hf[name]
    model, cfg = req.model, req.config
    assert res.status == "ok", f"{res.reason}\n{res.log_tail}"
    est = estimate(model, CLUSTER, cfg)
    worst = worst_peak(res)
    err = est.tensor_peak_bytes / worst - 1
    assert -UNDER - unpriced_late_copy(model, cfg, worst) <= err <= OVER + timing_allowance(est, worst), (
        est.phases,
        res.phase_peak_bytes,
        f"{100 * err:+.2f}%",
    )


@pytest.mark.slow
def test_stage1_fp32_accumulation_carries_fp32_gradients(measured_on_hf):
    """The forward of the second micro step holds the first's gradients, in fp32 (measured phase)."""
    req, res = measured_on_hf["z1-offload-fp32-accumulation-gpt2"]
    assert res.status == "ok", f"{res.reason}\n{res.log_tail}"
    est = estimate(req.model, CLUSTER, req.config).phases["forward"]
    err = est / res.phase_peak_bytes["forward"] - 1
    assert -UNDER <= err <= OVER, (est, res.phase_peak_bytes, f"{100 * err:+.2f}%")


@pytest.mark.slow
def test_max_live_parameters_releases_nothing_and_a_big_bucket_costs_memory(measured):
    """stage3_max_live_parameters caps the prefetch only: 1 element (no prefetch at all) keeps the
    default's forward peak (to the byte when measured; JITTER here), and so does a one-parameter
    bucket. A larger bucket gathers more ahead into one flat buffer live until the head (4e6: every
    parameter after the embedding), unless max_live (6e5) stops the prefetch first (test above: the
    bytes)."""
    base = measured["zero_stage=3-precision=bf16"][1]
    peaks = {k.removeprefix("zero_stage=3-precision=bf16-"): measured[k][1].phase_peak_bytes["forward"] for k in S3}
    same = pytest.approx(base.phase_peak_bytes["forward"], abs=JITTER)
    assert peaks["stage3_max_live_parameters=1"] == same and peaks["stage3_prefetch_bucket_size=1"] == same
    assert peaks[f"stage3_prefetch_bucket_size={BIG}-stage3_max_live_parameters=600000"] == same
    assert (
        peaks[f"stage3_prefetch_bucket_size={BIG}"]
        > peaks["stage3_prefetch_bucket_size=500000"]
        > base.phase_peak_bytes["forward"]
    )


def test_knobs_write_deepspeed_keys():
    model = resolve_model("tiny-llama")
    ds = deepspeed_config(
        TrainConfig(
            zero_stage=2,
            precision="bf16",
            grad_accum_dtype="fp32",
            overlap_comm=True,
            reduce_bucket_size=1000,
            allgather_bucket_size=2000,
        ),
        model,
        CLUSTER,
    )
    z = ds["zero_optimization"]
    assert (z["overlap_comm"], z["reduce_bucket_size"], z["allgather_bucket_size"]) == (True, 1000, 2000)
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}
    auto = deepspeed_config(TrainConfig(zero_stage=2), model, CLUSTER)
    assert "data_types" not in auto and auto["zero_optimization"]["reduce_bucket_size"] == model.hidden_size**2
    z3 = deepspeed_config(
        TrainConfig(zero_stage=3, stage3_prefetch_bucket_size=123, stage3_max_live_parameters=456), model, CLUSTER
    )["zero_optimization"]
    assert (z3["stage3_prefetch_bucket_size"], z3["stage3_max_live_parameters"]) == (123, 456)
    z3 = deepspeed_config(TrainConfig(zero_stage=3), model, CLUSTER)["zero_optimization"]  # 0: today's values
    assert (z3["stage3_prefetch_bucket_size"], z3["stage3_max_live_parameters"], z3["stage3_max_reuse_distance"]) == (
        int(0.9 * model.hidden_size**2),
        int(1e9),
        int(1e9),
    )


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(zero_stage=0, precision="bf16", grad_accum_dtype="fp32"), "unsupported mix"),
        (dict(zero_stage=1, precision="fp32", grad_accum_dtype="fp32"), "default"),
        (dict(zero_stage=3, overlap_comm=True), "stage 3 always overlaps"),
        (dict(zero_stage=0, reduce_bucket_size=10), "stage 1-3"),
        (dict(zero_stage=3, allgather_bucket_size=10), "stages 1-2"),
        (dict(zero_stage=1, allgather_bucket_size=11), "even"),
        (dict(zero_stage=2, stage3_prefetch_bucket_size=10), "stage 3 only"),
        (dict(zero_stage=1, stage3_max_live_parameters=10), "stage 3 only"),
    ],
)
def test_knob_combinations_deepspeed_refuses_or_ignores_are_refused(kw, why):
    with pytest.raises(SpecError, match=why):
        TrainConfig(**kw)


def test_bf16_optimizer_steps_beside_the_bf16_gradients_once():
    """Issue 51: ZeRO-1 bf16 with fp32 accumulation (BF16_Optimizer) holds at its step the states, the bf16
    gradients until the engine's zero_grad (engine.py _take_model_step) and AdamW's two temporaries; its fp32
    partition's gradient is a view of the fp32 gradients (bf16_optimizer.py step). The model added 4P/N more,
    +9.6% over the issue's Llama (156,895,004 B measured, the loss's backward). After the update gloo gathers the
    bf16 flat group through a whole copy of it (update_lp_params), the bf16 gradients still live."""
    from autotune.memory.analytic import phases as analytic_phases
    from autotune.memory.buffers import allgather_phase

    model = resolve_model("tiny-llama", implementation="builtin")
    p, pb = model.num_params, 2
    cfg = _cfg(dict(zero_stage=1, precision="bf16", grad_accum_dtype="fp32"))
    for gpus in ("2xcpu", "8xcpu"):
        cluster = parse_gpus(gpus)
        terms = allgather_phase(model, cluster, cfg, p, analytic_phases(model, cluster, cfg))
        step, gathered = terms["optimizer"], terms["optimizer (all-gather)"]
        assert step["gradients"] == pb * p and step["optimizer_temporaries"] == 8 * p // cluster.world_size
        assert gathered["gradients"] == pb * p and "optimizer_temporaries" not in gathered
        assert gathered["gloo_allgather_output"] >= pb * p  # the whole bf16 group, padded
        # 2P against the update's 8P/N: the all-gather is the step's peak from 4 ranks on
        est = estimate(model, cluster, cfg).phases
        assert (est["optimizer (all-gather)"] > est["optimizer"]) == (cluster.world_size >= 4)


def test_stage_2_with_fp32_accumulation_reduces_into_a_compact_fp32_partition():
    """Issue 51: ZeRO-2 in 16 bits with fp32 accumulation adds each reduction into a compact fp32 partition (the
    padded flat share; stage_1_and_2.py _build_compact_grad_partition_buffer) and copy_grads_in_partition returns
    before it makes the 16-bit one: the LM head's reduction holds that partition and a fp32 copy of the head's
    gradient, not a 16-bit partition beside it (+6.5% over the issue's Llama before)."""
    from autotune.memory.buffers import _padded_partition, head_gradient_bytes
    from autotune.memory.layout import Layout

    model = resolve_model("tiny-llama", implementation="builtin")
    cfg = _cfg(dict(zero_stage=2, precision="bf16", grad_accum_dtype="fp32", reduce_bucket_size=5_000))
    head = head_gradient_bytes(model, CLUSTER, cfg, Layout.of(model, CLUSTER, cfg))
    assert head["gradient_partition"] == 4 * _padded_partition(model.num_params, 2)
    assert head["reduced_fp32_head"] == 4 * model.vocab_size * model.hidden_size


def test_stage_2_allocates_its_partition_at_the_first_reduction_not_at_the_head():
    """Issue 51: ZeRO-2 reduces a gradient only once the gradients that arrived exceed the bucket
    (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads), and the first reduction allocates the
    partition (copy_grads_in_partition). A head gradient larger than the bucket is reduced at once (at the next
    gradient); one the bucket holds waits for more: the head's backward holds the bucket, not the partition (a 2e6
    bucket on the issue's Llama was +6.2% over, the partition priced at the head)."""
    from autotune.memory.buffers import head_gradient_bytes, reduces_first_at_head
    from autotune.memory.layout import Layout

    model = resolve_model("tiny-llama", implementation="builtin")
    vh = model.vocab_size * model.hidden_size
    for bucket, at_head in ((vh - 2, True), (vh + 2, False)):
        cfg = _cfg(dict(zero_stage=2, precision="fp32", reduce_bucket_size=bucket))
        layout = Layout.of(model, CLUSTER, cfg)
        assert reduces_first_at_head(model, cfg, layout) == at_head
        head = head_gradient_bytes(model, CLUSTER, cfg, layout)
        assert ("gradient_partition" in head) == at_head and head["comm_buffers"] == 4 * bucket


def test_bigger_bucket_and_overlap_cost_memory_in_the_model():
    """A bucket larger than needed costs memory: with 4e6 elements the estimate grows by the bucket's
    bytes, and overlap_comm by one more bucket, at stages 1 and 2 (at stage 1 with overlap_comm the
    whole gradients, P x 2 B, become views of the bucket and the epilogue's second partition stands
    for them, P/2 x 2 B and a little more: buffers.stage2_end_of_one_bucket)."""
    model = resolve_model("tiny-llama")
    for z in (1, 2):
        one = estimate(model, CLUSTER, _cfg(dict(zero_stage=z, precision="bf16", reduce_bucket_size=BIG)))
        two = estimate(
            model, CLUSTER, _cfg(dict(zero_stage=z, precision="bf16", reduce_bucket_size=BIG, overlap_comm=True))
        )
        # without the terms priced at their worst timing (stage 1 with overlap_comm reduces through the same
        # epilogue as stage 2's one bucket, whose third partition gloo may free late: buffers.TIMING_TERMS)
        timing = [sum(e.terms.get(t, 0) for t in TIMING_TERMS) for e in (one, two)]
        assert abs(two.tensor_peak_bytes - timing[1] - one.tensor_peak_bytes + timing[0] - 2 * BIG) < model.num_params


def test_prefetch_bucket_costs_memory_as_deepspeeds_code_says():
    """model_states.zero3_prefetch on the stand-in: the head's bucket is min(bucket, max_live) + one
    parameter, at most every parameter after the embedding, and none once max_live is below what
    the forward holds; one rank gathers nothing. A 13B's peak is the head's gradients, larger than
    any bucket below V x h elements, so 5e7 (DeepSpeed's default) leaves its peak where it was."""
    from autotune.memory.model_states import largest_param

    model = resolve_model("tiny-llama", implementation="builtin")
    after = model.num_params - 1152 - model.vocab_size * model.hidden_size  # 1152: the norms, kept whole

    def bucket(cluster=CLUSTER, **kw):
        return estimate(model, cluster, _cfg(dict(zero_stage=3, precision="bf16", **kw))).phases.get(
            "forward (prefetch)", 0
        )

    assert bucket(stage3_prefetch_bucket_size=500_000) - bucket(stage3_prefetch_bucket_size=1) == 2 * (500_000 - 1)
    assert bucket(stage3_prefetch_bucket_size=BIG) - bucket(stage3_prefetch_bucket_size=1) == 2 * (
        after - 1 - largest_param(model)
    )
    held = model.num_params - 1152
    assert bucket(stage3_max_live_parameters=held - largest_param(model)) == bucket()
    assert bucket(stage3_max_live_parameters=held - largest_param(model) - 1) == 0
    assert bucket(parse_gpus("1xcpu"), stage3_prefetch_bucket_size=BIG) == 0
    big, cluster = resolve_model("13b", implementation="builtin"), parse_gpus("4xA100")
    peaks = [
        estimate(big, cluster, TrainConfig(zero_stage=3, stage3_prefetch_bucket_size=b)).tensor_peak_bytes
        for b in (0, 5 * 10**7)
    ]
    assert peaks[0] == peaks[1]


@pytest.mark.usefixtures("shipped_traces")
def test_max_live_below_the_gathered_set_exposes_gathers():
    """A max_live below what ZeRO-3 holds gathered stops the prefetch part way: that share of the
    gathers is waited for (costmodel.stage3_prefetched). Above it, and for any bucket, the time is the
    default's."""
    from autotune.costmodel import simulate, stage3_prefetched
    from autotune.memory.layout import Layout
    from autotune.memory.model_states import zero3_held

    model, cluster = resolve_model("13b"), parse_gpus("2x8xH100")
    base = simulate(model, cluster, TrainConfig(zero_stage=3))
    low = TrainConfig(zero_stage=3, stage3_max_live_parameters=10**8)
    layout = Layout.of(model, cluster, low)  # persistence threshold 10 h
    assert stage3_prefetched(model, low, layout) == pytest.approx(10**8 / zero3_held(model, layout))
    assert simulate(model, cluster, low).step_time_s > base.step_time_s
    for kw in (dict(stage3_max_live_parameters=3 * 10**9), dict(stage3_prefetch_bucket_size=1)):
        assert simulate(model, cluster, TrainConfig(zero_stage=3, **kw)).step_time_s == base.step_time_s


@pytest.mark.slow  # the whole 13B space, traced
def test_max_seq_len_and_micro_batch_are_the_largest_that_fit(capsys):
    """`autotune estimate --max-seq-len/--max-micro-batch`: the answer fits and one more does not."""
    import dataclasses
    import json
    import time

    from autotune.cli import main
    from autotune.memory.limits import largest_fitting

    model, cluster = resolve_model("13b"), parse_gpus("4xA100")
    cfg = TrainConfig(zero_stage=3, precision="bf16", seq_len=2048)
    for name in ("seq_len", "micro_batch"):
        v = largest_fitting(model, cluster, cfg, name)
        assert v >= 1 and estimate(model, cluster, dataclasses.replace(cfg, **{name: v})).fits
        assert not estimate(model, cluster, dataclasses.replace(cfg, **{name: v + 1})).fits
    t = time.perf_counter()
    assert (
        main(
            [
                "estimate",
                "--model",
                "13b",
                "--gpus",
                "4xA100",
                "--zero",
                "3",
                "--max-seq-len",
                "--max-micro-batch",
                "--json",
            ]
        )
        == 0
    )
    assert time.perf_counter() - t < 30  # a generous bound, not a timing claim (shared CPUs)
    out = json.loads(capsys.readouterr().out)
    assert out["max_seq_len"] == largest_fitting(model, cluster, cfg, "seq_len")
    tiny = resolve_model("tiny-gpt2")  # learned positions: never past the model's own maximum
    assert largest_fitting(tiny, parse_gpus("2xH100"), TrainConfig(seq_len=32), "seq_len") == tiny.max_seq_len
    llama = resolve_model("tiny-llama")  # traced: no probe fits, nor does 1
    assert largest_fitting(llama, parse_gpus("1xcpu@1MiB"), TrainConfig(seq_len=32), "seq_len") == 0


PARSE = r"""
import json, os, sys, tempfile
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed, deepspeed.ops
deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False   # skip the shm comm op's compile
import torch.distributed as dist
from deepspeed.runtime.config import DeepSpeedConfig

dist.init_process_group("gloo", store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)
deepspeed.init_distributed(dist_backend="gloo")


class DataParallel:
    def get_data_parallel_world_size(self):
        return int(sys.argv[2])

    def get_data_parallel_rank(self):
        return 0


c = DeepSpeedConfig(sys.argv[1], mpu=DataParallel())
z = c.zero_config
print(json.dumps({"stage": c.zero_optimization_stage, "qw": z.zero_quantized_weights, "qg": z.zero_quantized_gradients,
                  "hpz": z.zero_hpz_partition_size, "overlap": z.overlap_comm, "reduce": z.reduce_bucket_size,
                  "accum": str(c.grad_accum_dtype), "bf16_master": c.bfloat16_config.bf16_master_weights_and_grads,
                  "bf16_states": c.bfloat16_config.bf16_optimizer_states, "prefetch": z.prefetch_bucket_size,
                  "max_live": z.max_live_parameters}))
"""


@pytest.mark.slow
def test_zeropp_config_is_accepted_by_deepspeeds_parser(tmp_path):
    """ZeRO++ cannot run on CPU ranks (CUDA quantizer kernels): its JSON is checked by DeepSpeed's parser."""
    import json
    import os
    import subprocess
    import sys

    cluster = parse_gpus("2x8xH100")
    cfg = TrainConfig(
        zero_stage=3,
        precision="bf16",
        zero_quantized_weights=True,
        zero_quantized_gradients=True,
        zero_hpz_partition_size=8,
        grad_accum_dtype="fp32",
        reduce_bucket_size=1 << 20,
        bf16_master_weights_and_grads=True,
        bf16_optimizer_states=True,
        stage3_prefetch_bucket_size=5 * 10**7,
        stage3_max_live_parameters=3 * 10**8,
    )
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(deepspeed_config(cfg, resolve_model("7b"), cluster)))
    run = subprocess.run(
        [sys.executable, "-c", PARSE, str(path), "16"],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    parsed = json.loads(run.stdout.strip().splitlines()[-1])
    assert parsed == {
        "stage": 3,
        "qw": True,
        "qg": True,
        "hpz": 8,
        "overlap": True,
        "reduce": 1 << 20,
        "accum": "fp32",
        "bf16_master": True,
        "bf16_states": True,
        "prefetch": 5 * 10**7,
        "max_live": 3 * 10**8,
    }


@pytest.mark.usefixtures("shipped_traces")
def test_zeropp_is_refused_on_cpu_and_priced_on_gpus():
    from autotune.costmodel import simulate
    from autotune.train_config import check_config

    model = resolve_model("13b")
    with pytest.raises(SpecError, match="CUDA quantizer"):
        check_config(TrainConfig(zero_stage=3, zero_quantized_weights=True), resolve_model("tiny-llama"), CLUSTER)
    with pytest.raises(SpecError, match="several nodes"):
        check_config(TrainConfig(zero_stage=3, zero_hpz_partition_size=4), model, parse_gpus("8xH100"))
    cluster = parse_gpus("2x8xH100")
    base = simulate(model, cluster, TrainConfig(zero_stage=3)).breakdown_s
    qw = simulate(model, cluster, TrainConfig(zero_stage=3, zero_quantized_weights=True)).breakdown_s
    qg = simulate(model, cluster, TrainConfig(zero_stage=3, zero_quantized_gradients=True)).breakdown_s
    hpz = TrainConfig(zero_stage=3, zero_hpz_partition_size=8)
    assert qw["stage3_gather"] == pytest.approx(0.75 * base["stage3_gather"])  # the forward half at 1/2
    assert qg["grad_reduce"] == pytest.approx(base["grad_reduce"] / 4)
    assert simulate(model, cluster, hpz).breakdown_s["stage3_gather"] < base["stage3_gather"]
    grown = (
        estimate(model, cluster, hpz).tensor_peak_bytes
        - estimate(model, cluster, TrainConfig(zero_stage=3)).tensor_peak_bytes
    )
    assert grown == 2 * model.num_params // 8  # the secondary partition: bf16 weights over 8 GPUs


SEQ_SPACE = """
zero_stage: [3]
micro_batch: [1, 2]
ckpt_layers: [L]
seq_len: [1024, 2048, 4096]
"""


def simulated_search(tmp_path, monkeypatch, space: str, gpus: str = "4xA100", **kw):
    """A simulated search of 13B over `space` (YAML text) in its own trials folder: the study."""
    from autotune.search import study as st
    from autotune.search.session import open_search

    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path))
    (tmp_path / "space.yaml").write_text(space)
    with open_search(model="13b", gpus=gpus, executor="simulated", space=tmp_path / "space.yaml", **kw) as s:
        s.run(progress=False)
        name = s.study.study_name
    return st.load_study(name)


@pytest.mark.slow  # the whole 13B space, traced
@pytest.mark.parametrize("objective", ["samples", "tokens"])
def test_seq_len_axis_and_objective(tmp_path, monkeypatch, objective):
    """seq_len is searched like any axis; the objective decides the ranking and is recorded (every
    length run: --exhaustive, as the stopping rule may end the search once the prior's best is in)."""
    from autotune import report

    study = simulated_search(tmp_path, monkeypatch, SEQ_SPACE, objective=objective, exhaustive=True)
    df = report.trials_frame(study)
    ok = df[df["status"] == "ok"]
    assert set(ok["seq_len"]) == {1024, 2048, 4096}
    key = "tokens_per_s" if objective == "tokens" else "samples_per_s"
    best = ok.loc[ok[key].idxmax()]
    assert study.best_value == pytest.approx(best[key])
    table = report.ranked(df, objective=report.objective(study))
    assert table.iloc[0]["trial"] == best["trial"]
    assert f"ranked by {objective}/s" in report.header(study)[1] and "seq len searched" in report.header(study)[1]
    if objective == "samples":
        assert best["seq_len"] == 1024  # shorter sequences are more samples per second
    from autotune.report import page as report_page
    from autotune.report import pictures as report_pictures

    why = report_page.why_lines(study, report_pictures.pictures(study))[0]  # the page's winner is the same
    assert f"Winner #{best['trial']}**:" in why and f"{objective}/s" in why and f"seq len {best['seq_len']}" in why


@pytest.mark.usefixtures("shipped_traces")
def test_offload_param_moves_the_partition_to_host_and_host_ram_prunes():
    """On a GPU the stage-3 partition leaves the device for the host; a node without the host RAM
    for it is pruned with that reason (here: 13B with ZeRO-Infinity on nodes of 64 GiB)."""
    from autotune.costmodel import simulate
    from autotune.memory.host import RUNTIME_BYTES_PER_RANK

    model, cluster = resolve_model("13b"), parse_gpus("8xH100")
    base = TrainConfig(zero_stage=3, precision="bf16", ckpt_layers=40)
    off = TrainConfig(zero_stage=3, precision="bf16", ckpt_layers=40, offload_param="cpu")
    e0, e1 = estimate(model, cluster, base), estimate(model, cluster, off)
    part = int(2 * model.num_params / 8)
    assert e0.terms.get("parameters", 0) - e1.terms.get("parameters", 0) == pytest.approx(part, abs=8)
    assert e1.host_bytes == 8 * (part + RUNTIME_BYTES_PER_RANK) and e1.host_capacity_bytes == 2048 << 30
    assert simulate(model, cluster, off).step_time_s > simulate(model, cluster, base).step_time_s
    both = TrainConfig(zero_stage=3, precision="bf16", ckpt_layers=40, offload_param="cpu", offload_optimizer=True)
    small = estimate(model, parse_gpus("8xH100@host=64GiB"), both)
    assert not small.host_fits and not small.fits and "host memory" in small.verdict()
    assert estimate(model, cluster, both).host_fits
    with pytest.raises(SpecError, match="stage 3"):
        TrainConfig(zero_stage=2, offload_param="cpu")


def test_host_memory_prunes_in_a_search(tmp_path, monkeypatch):
    from autotune import report

    space = (
        "zero_stage: [3]\nmicro_batch: [1]\nckpt_layers: [L]\n"
        "offload_param: [none, cpu]\noffload_optimizer: [false, true]\n"
    )
    df = report.trials_frame(simulated_search(tmp_path, monkeypatch, space, gpus="8xH100@host=64GiB"))
    host = df[df["pruned_by"] == "host-memory"]
    # the optimizer offloaded (16 B/param over 8 GPUs, ~26 GB per GPU) does not fit 64 GiB a node; the
    # 16-bit partition alone (~3.3 GB per GPU) does
    assert len(host) == 2 and all("host RAM per node" in r for r in host["reason"])
    assert set(host["offload_optimizer"]) == {True}
    assert set(df[df["status"] == "ok"]["offload_param"]) == {"none"}  # it fits, so offload is not run:
    assert set(df[df["pruned_by"] == "dominated"]["offload_param"]) == {"cpu"}  # dominated (search_order.speed_order)


def test_bf16_optimizer_states_halve_the_static_memory_and_are_flagged(tmp_path, monkeypatch):
    """Master weights 4 -> 2 B and moments 8 -> 4 B per partition element; the report warns."""
    from autotune import report

    model, cluster = resolve_model("13b"), parse_gpus("4xA100")
    fp32 = estimate(model, cluster, TrainConfig(zero_stage=3, ckpt_layers=40)).terms
    bf16 = estimate(
        model,
        cluster,
        TrainConfig(zero_stage=3, ckpt_layers=40, bf16_master_weights_and_grads=True, bf16_optimizer_states=True),
    ).terms
    assert bf16["master_weights"] * 2 == pytest.approx(fp32["master_weights"], abs=2)
    assert bf16["optimizer_states"] * 2 == pytest.approx(fp32["optimizer_states"], abs=2)
    with pytest.raises(SpecError, match="needs offload_optimizer"):
        TrainConfig(zero_stage=3, bf16_master_weights_and_grads=True)
    space = (
        "zero_stage: [3]\nmicro_batch: [1]\nckpt_layers: [L]\n"
        "bf16_master_weights_and_grads: [true]\nbf16_optimizer_states: [true]\n"
    )
    text = report.render(simulated_search(tmp_path, monkeypatch, space))
    assert "WARNING: rank" in text and "stability risk" in text


@pytest.mark.usefixtures("shipped_traces")  # a search's decisions on 13B's estimates
def test_bf16_states_run_where_they_save_recomputation(tmp_path, monkeypatch):
    """A space listing bf16_optimizer_states [false, true] accepts them: in a group (search_order), fewer
    checkpointed layers come before fp32 states, so 13B at ZeRO-3, micro batch 2 on 4 x A100 runs bf16
    states with no layer checkpointed (fp32 states need 20 to fit), the faster of the two by the cost model;
    where fp32 states fit with as few layers (micro batch 1), they run and bf16 states are dominated."""
    from autotune import report
    from autotune.costmodel import simulate

    model, cluster = resolve_model("13b"), parse_gpus("4xA100")
    fp32_0, fp32_20, bf16_0 = (
        TrainConfig(zero_stage=3, micro_batch=2, ckpt_layers=k, **kw)
        for k, kw in ((0, {}), (20, {}), (0, dict(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)))
    )
    assert not estimate(model, cluster, fp32_0).fits and estimate(model, cluster, fp32_20).fits
    assert estimate(model, cluster, bf16_0).fits
    assert simulate(model, cluster, bf16_0).samples_per_s > simulate(model, cluster, fp32_20).samples_per_s
    space = (
        "zero_stage: [3]\nmicro_batch: [1, 2]\nckpt_layers: [0, 20, 40]\n"
        "bf16_master_weights_and_grads: [false, true]\nbf16_optimizer_states: [false, true]\n"
    )
    df = report.trials_frame(simulated_search(tmp_path, monkeypatch, space, exhaustive=True))
    ok = df[df["status"] == "ok"].set_index("micro_batch")
    assert sorted(ok.index) == [1, 2]
    assert ok.loc[2, "ckpt_layers"] == 0 and bool(ok.loc[2, "bf16_optimizer_states"])
    assert ok.loc[1, "ckpt_layers"] == 0 and not bool(ok.loc[1, "bf16_optimizer_states"])


@pytest.mark.slow  # the whole 13B space estimated
def test_full_space_knobs_do_not_multiply_the_trials(shipped_traces):
    """search_spaces/full.yaml searches every knob; 13B on 4 x A100: its 48,996 candidates fall into 48
    groups (search_order.MEMORY_FOR_SPEED), of which 34 have a member that fits (36 when this was first
    measured, with an earlier memory model): at most 36 trials run (the
    simulated search ran exactly 34 on 2026-12-02, in 2.2 min with its 48,962 pruned candidates written
    in bulk, study.add_finished; one Optuna trial at a time it had not finished writing them after 10
    minutes). Its estimates read the shipped traces (the shipped_traces fixture; the pack traces this
    space's search for 13B x 4 x A100): 16 s here where tracing every program took 60 s (2026-12-07)."""
    import collections

    from autotune.search.loop import Candidate
    from autotune.search.order import MEMORY_FOR_SPEED
    from autotune.search.space import SPACES_DIR, expand, load_space
    from autotune.trace_cache import in_parallel
    from autotune.train_config import searched_fields

    space = load_space(SPACES_DIR / "full.yaml")
    assert {f.name for f in searched_fields()} <= set(space.values)
    flags_only = ("allgather_bucket_size",)
    assert all(len(space.values[n]) > 1 for n in MEMORY_FOR_SPEED if n not in flags_only)
    model, cluster = resolve_model("13b"), parse_gpus("4xA100")
    cands = expand(space, model, cluster, seq_len=2048).candidates
    groups = collections.defaultdict(list)
    for c in cands:
        groups[Candidate(c, None).group].append(c)  # a group is read off the config alone
    # a group runs if any member fits: its members are estimated until one does. Traced first on two
    # cores (trace_cache.in_parallel, the fork `autotune estimate` uses): every other group in a forked
    # process that hands its traces over through the trace cache, the rest here; the line after
    # estimates every group again in this process, with the same code, reading those traces back.
    in_parallel(
        [_first_fitting(model, cluster, list(groups.values())[::2])],
        [_first_fitting(model, cluster, list(groups.values())[1::2])],
    )
    runs = sum(any(estimate(model, cluster, c).fits for c in g) for g in groups.values())
    assert len(cands) > 5000 and len(groups) <= 48 and runs <= 36, (len(cands), len(groups), runs)


def _first_fitting(model, cluster, groups):
    """A call that estimates each group's members until one fits, as the test's own line does."""
    return lambda: [any(estimate(model, cluster, c).fits for c in g) for g in groups]


def _issue51_rows(**want):
    """issue 51's matrix rows (benchmarks/knobs_on_hf.py) whose CSV columns equal `want` (as strings)."""
    import json

    from cases import ISSUE51_LLAMA, benchmark

    knobs = benchmark("knobs_on_hf")
    shape = json.dumps(ISSUE51_LLAMA, sort_keys=True)
    rows = [r for r in knobs.load() if r["hf_config"] == shape and all(r[k] == str(v) for k, v in want.items())]
    return knobs, rows


def test_stage_1_frees_the_first_buckets_whole_gradients_before_it_allocates_the_partition():
    """Issue 51's matrix: ZeRO-1 without overlap_comm reduces at the boundary in parameter order, each gradient copied
    into the bucket and then a view of it (its whole copy freed), and allocates the partition at the first reduction
    (stage_1_and_2.py reduce_gradients, reduce_independent_p_g_buckets_and_remove_grads, copy_grads_in_partition): the
    peak holds the partition and the bucket but not the first bucket's whole gradients. The recorded runs of this kind
    on the issue's Llama (benchmarks/knobs_on_hf.py) against today's estimate; the fp32 2e6 one read +5.6% before."""
    import dataclasses

    from cases import ISSUE51_LLAMA, spec_of

    from autotune.memory.buffers import backward_buffers, stage1_first_bucket_elements
    from autotune.memory.code_trace import param_numels
    from autotune.memory.layout import Layout

    spec = spec_of("llama", ISSUE51_LLAMA)
    knobs, rows = _issue51_rows(zero_stage=1, overlap_comm=False, grad_accum_dtype="auto")
    rows = [r for r in rows if int(r["reduce_bucket_size"]) < spec.num_params]
    assert any(r["precision"] == "fp32" for r in rows), "the matrix's ZeRO-1 fp32 run with a small bucket"
    for r in rows:
        cfg = knobs.train_config(r)
        err = estimate(spec, CLUSTER, cfg).tensor_peak_bytes / int(r["largest_step_bytes"]) - 1
        assert -UNDER <= err <= 0.001, (cfg.short(), f"{100 * err:+.3f}%")
    # the first bucket: the leading parameters that fit it (the embedding, then layer 0's until its down_proj)
    cfg = TrainConfig(zero_stage=1, precision="fp32", reduce_bucket_size=2_000_000, seq_len=128)
    layout = Layout.of(spec, CLUSTER, cfg)
    first = stage1_first_bucket_elements(spec, cfg, layout)
    order = param_numels(spec)
    k = next(i for i in range(len(order)) if sum(order[: i + 1]) > 2_000_000)
    assert first == sum(order[:k]) and k > 1
    overlap = dataclasses.replace(cfg, overlap_comm=True)
    assert stage1_first_bucket_elements(spec, overlap, Layout.of(spec, CLUSTER, overlap)) == 0
    assert backward_buffers(spec, CLUSTER, cfg, layout) < 4 * (spec.num_params // 2 + 2_000_000)


def test_stage_2_prices_the_partition_where_its_first_reduction_allocates_it():
    """Issue 51's matrix: ZeRO-2 with a bucket between the LM head's gradient and the model reduces first when an
    arriving gradient would overflow the bucket (stage_1_and_2.py reduce_independent_p_g_buckets_and_remove_grads), and
    that reduction allocates the partition on the rank owning the last parameters (copy_grads_in_partition), inside the
    last layer's backward with most activations live: the traced tier's 'backward (first reduction)' at the trace's
    moment of that gradient's arrival (code_trace's `bwd.grad.N`). The recorded runs of this kind on the issue's Llama
    (benchmarks/knobs_on_hf.py) against today's estimate; before, fp32 read -1.35%, with overlap_comm -6.70%, bf16 with
    bf16 master weights and states -3.14% (the partition left out)."""
    from cases import ISSUE51_LLAMA, spec_of

    from autotune.memory.traced import trace

    spec = spec_of("llama", ISSUE51_LLAMA)
    knobs, rows = _issue51_rows(zero_stage=2, reduce_bucket_size=2_000_000)
    rows = [r for r in rows if r["precision"] == "fp32" or r["bf16_master_weights_and_grads"] == "True"]
    assert len(rows) == 3, "the matrix's ZeRO-2 fp32 (with and without overlap_comm) and bf16-master 2e6 runs"
    for r in rows:
        cfg = knobs.train_config(r)
        est = estimate(spec, CLUSTER, cfg)
        err = est.tensor_peak_bytes / int(r["largest_step_bytes"]) - 1
        assert -UNDER <= err <= OVER, (cfg.short(), f"{100 * err:+.3f}%")
        if cfg.precision == "fp32":
            assert est.phase == "backward (first reduction)", (cfg.short(), est.phases)
    # the moment: the head (V h), the final norm, the last layer's down_proj and up_proj fit the 2e6 bucket; its
    # gate_proj, the fifth gradient to arrive, overflows it
    fp32 = next(r for r in rows if r["precision"] == "fp32" and r["overlap_comm"] == "False")
    t = trace(spec, CLUSTER, knobs.train_config(fp32))
    assert t.phases["backward (first reduction)"]["unreduced_gradient"] == 4 * spec.hidden_size * spec.ffn_hidden_size
    arrived = [t.points[f"bwd.grad.{n}"]["gradients"] for n in range(1, 6)]
    assert arrived[0] == 4 * spec.vocab_size * spec.hidden_size
    assert arrived[3] <= 4 * 2_000_000 < arrived[4], arrived
    # with grad_accum 2 the partition made at the first micro step's first reduction is the one carried after it
    import dataclasses

    two = trace(spec, CLUSTER, dataclasses.replace(knobs.train_config(fp32), grad_accum=2))
    carried = two.phases["backward (first reduction)"]
    assert carried["accumulated_gradients"] and "gradient_partition" not in carried


def test_stage_1_with_overlap_comm_prices_the_partition_where_its_first_reduction_allocates_it():
    """ZeRO-1 with overlap_comm reduces during backward as stage 2 does, and its first reduction allocates the partition
    the same way (stage_1_and_2.py reduce_ipg_grads -> copy_grads_in_partition, at stage 1 too): with a bucket that
    holds the LM head's gradient, inside the last layer's backward (`backward (first reduction)`), not at the head.
    Issue 51's Llama fp32 with a 2e6 bucket read +5.303% with the partition priced from the head on."""
    from cases import ISSUE51_LLAMA, spec_of

    spec = spec_of("llama", ISSUE51_LLAMA)
    knobs, rows = _issue51_rows(zero_stage=1, overlap_comm=True, reduce_bucket_size=2_000_000, precision="fp32")
    assert len(rows) == 1
    cfg = knobs.train_config(rows[0])
    assert spec.vocab_size * spec.hidden_size < cfg.reduce_bucket_size < spec.num_params
    est = estimate(spec, CLUSTER, cfg)
    err = est.tensor_peak_bytes / int(rows[0]["largest_step_bytes"]) - 1
    assert est.phase == "backward (first reduction)", est.phases
    assert -UNDER <= err <= 0.005, f"{100 * err:+.3f}%"
    assert "gradient_partition" not in est.phases and est.phases["backward (head)"] < est.tensor_peak_bytes


def test_late_freed_partition_at_stage_1_without_overlap_comm_and_not_with_a_compact_fp32_partition():
    """One bucket holding every gradient: stage 1 without overlap_comm holds, at its worst timing, one more partition
    at the end of backward (`late_freed_partition`; issue 51's Llama bf16 with 5e7: one step of four, -2.52% before it
    was priced); stage 2 adding into the compact fp32 partition (16-bit with fp32 accumulation) held none in two runs
    of 16 steps with a 5e7 bucket and one with 5e8.
    Each recorded run against today's estimate at its largest step."""
    from cases import ISSUE51_LLAMA, spec_of

    spec = spec_of("llama", ISSUE51_LLAMA)
    knobs, stage1 = _issue51_rows(zero_stage=1, overlap_comm=False, grad_accum_dtype="auto")
    stage1 = [r for r in stage1 if int(r["reduce_bucket_size"]) >= spec.num_params]
    knobs, compact = _issue51_rows(zero_stage=2, precision="bf16", grad_accum_dtype="fp32")
    compact = [r for r in compact if int(r["reduce_bucket_size"]) >= spec.num_params]
    assert len(stage1) >= 4 and len(compact) == 2
    for r in stage1 + compact:
        cfg = knobs.train_config(r)
        est, largest = estimate(spec, CLUSTER, cfg), int(r["largest_step_bytes"])
        late = est.terms.get("late_freed_partition", 0)
        assert bool(late) == (cfg.zero_stage == 1), (cfg.short(), est.terms)
        err = est.tensor_peak_bytes / largest - 1
        assert -UNDER <= err <= OVER + timing_allowance(est, largest), (cfg.short(), f"{100 * err:+.3f}%")
    met = [r for r in stage1 if int(r["largest_step_bytes"]) > int(r["measured_bytes"])]
    assert met, "a recorded stage-1 run whose largest step met the late partition"
