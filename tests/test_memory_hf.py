"""The memory model on code other than the stand-in (memory/code_trace.py): Hugging Face models traced
on fake tensors against real CPU runs of the same code, single-process (fast) and in DeepSpeed on 2
CPU ranks (slow), the cache, and the micro-batch fit the grid relies on.

Shapes here are the tests' own (tests/cases.py TEST_FAMILIES); benchmarks/hf_memory.py judges the model on others.
"""

import dataclasses
import json

import numpy as np
import pytest
from cases import spec
from conftest import quick
from cpu_step import measure_cpu
from steady import per_rank_steps, steady_peak, timing_allowance

from autotune.hardware import parse_gpus
from autotune.memory import _phases, code_trace, estimate
from autotune.memory.grid import grid_total_bytes
from autotune.memory.traced import trace
from autotune.models import SpecError
from autotune.train_config import TrainConfig

CPU = parse_gpus("1xcpu@8GiB")
REAL = [
    ("gpt2", "fp32", "sdpa", 0),
    ("gpt2", "bf16", "eager", 2),
    ("llama", "bf16", "sdpa", 1),
    ("llama", "fp32", "eager", 0),
    ("qwen2", "bf16", "sdpa", 0),
    ("gpt_neox", "bf16", "sdpa", 3),
    ("factory", "bf16", "sdpa", 1),
]


@pytest.mark.parametrize(
    "family,precision,attention,ckpt",
    # the quick loop's transformers steps against real ones: test_hf's EXAONE-MoE and Mixtral
    quick(REAL, fast=set()),  # each a real CPU step (~5 s)
)
def test_traced_hf_step_matches_a_real_cpu_run(family, precision, attention, ckpt):
    s = spec(family)
    cfg = TrainConfig(micro_batch=2, seq_len=48, precision=precision, attention=attention, ckpt_layers=ckpt)
    real = measure_cpu(s, cfg)
    got = trace(s, CPU, cfg).raw_peaks
    for phase in ("forward", "backward", "optimizer"):
        # to the byte but for 0-dim CPU tensors c10 makes from Python scalars, which never reach a
        # dispatch mode (a scale or dropout's 1/(1-p) per layer, AdamW's step scalars)
        assert 0 <= real[phase] - got[phase] <= 128, (phase, got, real)


@pytest.mark.slow  # five families traced (~5 s)
def test_estimate_prices_the_code_and_leaves_the_builtin_alone():
    s = spec("llama")
    cfg = TrainConfig(micro_batch=2, seq_len=48, precision="bf16", zero_stage=3, ckpt_layers=1)
    gpus = parse_gpus("2xcpu@4GiB")
    ours, t = estimate(s, gpus, cfg), trace(s, gpus, cfg)
    assert ours.tensor_peak_bytes == t.tensor_peak_bytes and ours.phases == t.totals
    stand_in = dataclasses.replace(s, implementation="builtin")
    analytic = {n: sum(v.values()) for n, v in _phases(stand_in, gpus, cfg).items()}
    assert estimate(stand_in, gpus, cfg).phases == analytic  # the builtin path is the analytic model
    assert ours.tensor_peak_bytes != estimate(stand_in, gpus, cfg).tensor_peak_bytes
    # ZeRO-3 keeps parameters under 10 h elements whole: counted on the module (Qwen2's q, k, v biases)
    q = spec("qwen2")
    small = sum(n for n in code_trace.param_numels(q) if n < 10 * q.hidden_size)
    assert code_trace.persistent_params(q, 10 * q.hidden_size) == small
    assert small == (2 * q.num_layers + 1) * q.hidden_size + q.num_layers * (q.q_dim + 2 * q.kv_dim)


def test_traces_are_cached_per_program():
    s = spec("gpt_neox")
    cfg = TrainConfig(micro_batch=1, seq_len=40, precision="bf16", ckpt_layers=0)
    estimate(s, CPU, cfg)
    n = len(code_trace._PROGRAMS)
    for z in range(4):  # the stage, the cluster and grad_accum do not change the program
        estimate(s, parse_gpus("2xcpu@4GiB"), dataclasses.replace(cfg, zero_stage=z, grad_accum=2))
    assert len(code_trace._PROGRAMS) == n


@pytest.mark.slow
@pytest.mark.parametrize("family,precision,attention", [("gpt2", "bf16", "eager"), ("llama", "fp32", "sdpa")])
def test_grid_fit_in_micro_batch_and_k_matches_pointwise(family, precision, attention):
    """The grid prices every micro batch and k from traces at micro batch 1, 2 and k 0, 1, 2: check
    it against traces at the exact micro batch and k."""
    s, gpus = spec(family), parse_gpus("2xcpu@4GiB")
    base = TrainConfig(seq_len=64, precision=precision, attention=attention, zero_stage=1)
    mbs, ks = np.array([1, 3, 5]), np.array([0, 2, 3])
    grid = grid_total_bytes(s, gpus, base, mbs, ks)
    for i, mb in enumerate(mbs):
        for j, k in enumerate(ks):
            exact = estimate(s, gpus, dataclasses.replace(base, micro_batch=int(mb), ckpt_layers=int(k))).total_bytes
            assert abs(grid[i, j] - exact) <= 1e-3 * exact, (mb, k, grid[i, j], exact)


def hybrid_spec():
    from transformers import AutoConfig

    from autotune.models import hf_config as hf

    d = dict(HYBRID)
    return hf.spec_from_config(AutoConfig.for_model(d.pop("model_type"), **d), name="test-hybrid", source="test")


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """The real DeepSpeed runs of this module's slow tests (2 CPU ranks, 1 warm-up and 2 measured steps
    each), in ONE process group (run_trials, as tests/test_trial.py's matrix does): torch, DeepSpeed and
    transformers are imported and gloo set up once instead of twice; each config is still measured on
    its own (launch.run_trials: peaks relative to the live bytes before its model is built).
    {name: (request, result)}; each test reads its own."""
    from autotune.trial.launch import run_trials
    from autotune.trial.record import TrialRequest

    root, gpus = tmp_path_factory.mktemp("hf-runs"), parse_gpus("2xcpu")
    runs = {
        # test_deepspeed_runs_of_hf_models_match_the_estimate
        "gpt2": (spec("gpt2"), TrainConfig(zero_stage=2, precision="bf16", micro_batch=2, seq_len=96, ckpt_layers=1)),
        "qwen2": (
            spec("qwen2"),
            TrainConfig(zero_stage=3, precision="fp32", micro_batch=3, seq_len=64, attention="eager"),
        ),
        # test_a_hybrid_stack_at_zero_2_is_priced_as_it_runs
        "hybrid": (
            hybrid_spec(),
            TrainConfig(zero_stage=2, precision="bf16", micro_batch=2, seq_len=48, ckpt_layers=1),
        ),
    }
    reqs = [
        TrialRequest(model=m, cluster=gpus, config=c, steps=2, warmup_steps=1, out_dir=root / name)
        for name, (m, c) in runs.items()
    ]
    return dict(zip(runs, zip(reqs, run_trials(reqs))))


@pytest.mark.slow
def test_deepspeed_runs_of_hf_models_match_the_estimate(real_runs):
    """Real DeepSpeed trials on 2 CPU ranks (the issue's 'done when': within 5%; it is far closer)."""
    gpus = parse_gpus("2xcpu")
    for req, res in (real_runs["gpt2"], real_runs["qwen2"]):
        assert res.status == "ok", res.reason
        est = estimate(req.model, gpus, req.config).tensor_peak_bytes
        assert abs(est / steady_peak(res) - 1) <= 0.01, (req.model.name, req.config.short(), est, per_rank_steps(res))


def test_traces_are_kept_on_disk_except_a_users_module(tmp_path, monkeypatch):
    """A later process reads a program back instead of tracing it (autotune/trace_cache.py): with the
    in-memory cache cleared and tracing made to fail, the estimate is the same; a user's module
    (factory) is traced every time, and a corrupt entry is traced again."""
    from autotune import trace_cache

    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(code_trace, "_PROGRAMS", {})
    s = spec("llama")
    cfg = TrainConfig(micro_batch=1, seq_len=24, precision="bf16", ckpt_layers=1)
    first = estimate(s, CPU, cfg)
    entries = sorted((tmp_path / "traces" / trace_cache.fingerprint()).glob("*.json"))
    # the programs (beside them, what else a later run reads: the parameter sizes, the optimizer step's peak)
    files = [f for f in entries if json.loads(f.read_text())["key"].startswith("('{")]
    assert len(files) == len(code_trace._PROGRAMS) >= 2

    def refuse(*a, **k):
        raise AssertionError("traced again")

    monkeypatch.setattr(code_trace, "_PROGRAMS", {})
    monkeypatch.setattr(code_trace, "_run", refuse)
    again = estimate(s, CPU, cfg)
    assert again.phases == first.phases and again.terms == first.terms
    files[0].write_text("{not json")
    monkeypatch.setattr(code_trace, "_PROGRAMS", {})
    with pytest.raises(SpecError, match="traced again"):
        estimate(s, CPU, cfg)
    monkeypatch.undo()

    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "factory"))
    estimate(spec("factory"), CPU, cfg)
    assert not (tmp_path / "factory").exists()


TRACED_BY = r"""
import os, sys
from autotune.cli import main
from autotune.memory import code_trace
run = code_trace._run
def logged(spec, cfg, **kw):   # which process traces which program
    with open(sys.argv[1], "a") as f:
        f.write(f"{os.getpid()} {kw.get('vary') is not None} {kw['ckpt']} {kw['full']}\n")
    return run(spec, cfg, **kw)
code_trace._run = logged
sys.exit(main(sys.argv[2:]))
"""


WITHOUT_TORCH = r"""
import sys
class Refuse:   # any import of these fails the run
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("torch", "transformers", "peft", "deepspeed", "ray", "optuna", "pandas"):
            raise ImportError(f"{name} imported by a run that should find everything in the trace cache")
sys.meta_path.insert(0, Refuse())
from autotune.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # two fresh processes tracing at once (~13 s); quick loop: test_traces_are_kept_on_disk_except_a_users_module
def test_a_first_estimate_traces_in_two_processes_and_answers_as_one_does(tmp_path, monkeypatch, capsys):
    """`autotune estimate --max-seq-len` of transformers' code, as a first run: its last program is
    traced in a forked process (cli/estimate._trace_ahead, trace_cache.in_parallel) and read back
    from the disk cache, each program traced once, by one of two processes; the answer is the one
    a single process gives. A later run gives it again without importing torch or transformers
    (everything it needs is in the trace cache: what makes it answer in a fraction of a second)."""
    import os
    import subprocess
    import sys

    from autotune import trace_cache
    from autotune.cli import main

    # a GPU (the cost model's profile is traced here meanwhile) small enough for the answer to lie
    # in the range the two builds are stepped over
    args = ["estimate", "--model", "tiny-llama", "--gpus", "1xH100@1GiB", "--max-seq-len", "--json"]
    log = tmp_path / "traced_by"
    run = subprocess.run(
        [sys.executable, "-c", TRACED_BY, str(log), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "AUTOTUNE_CACHE_DIR": str(tmp_path / "two")},
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    two = json.loads(run.stdout)
    traced = [line.split() for line in log.read_text().splitlines()]
    assert two["max_seq_len"] and all(vary == "True" for _, vary, *_ in traced)
    assert len({pid for pid, *_ in traced}) == len(traced) == len({tuple(t[2:]) for t in traced}) == 2
    later = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *args],
        capture_output=True,
        text=True,
        env={**os.environ, "AUTOTUNE_CACHE_DIR": str(tmp_path / "two")},
        timeout=300,
    )
    assert later.returncode == 0, later.stderr[-2000:]
    assert json.loads(later.stdout) == two

    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "one"))
    monkeypatch.setattr(code_trace, "_PROGRAMS", {})
    monkeypatch.setattr(code_trace, "_FAMILIES", {})
    monkeypatch.setattr(trace_cache, "in_parallel", lambda here, there: [call() for call in here + there])
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == two


def test_a_child_that_fails_or_hangs_costs_only_time(tmp_path, monkeypatch):
    """trace_cache.in_parallel: what the child stores is read here; a child that raises or outlives
    the timeout leaves the calls here done, and no process behind."""
    import time

    import psutil

    from autotune import trace_cache

    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    here = []
    trace_cache.in_parallel([lambda: here.append(1)], [lambda: trace_cache.store(("k",), {"v": 2})])
    assert here == [1] and trace_cache.load(("k",)) == {"v": 2}
    trace_cache.in_parallel([lambda: here.append(3)], [lambda: 1 / 0])
    before = {p.pid for p in psutil.Process().children()}
    t = time.monotonic()
    trace_cache.in_parallel([lambda: here.append(4)], [lambda: time.sleep(60)], timeout_s=0.5)
    assert here == [1, 3, 4] and time.monotonic() - t < 30
    assert {p.pid for p in psutil.Process().children()} <= before


@pytest.mark.parametrize("zero", [0, 3])
def test_registered_buffers_are_priced_whole_on_every_rank(zero):
    """A module's registered buffers (GPTBigCode's causal-mask table, here 256 x 256 bools per model)
    are neither parameters nor activations: ZeRO partitions parameters only, so every rank holds them
    whole in every phase. Missing from the estimate they left it 0.57-0.96% under three real DeepSpeed
    runs of such a model (`python benchmarks/hf_families.py --deepspeed gpt_bigcode`: now +0.01% to
    +0.02%)."""
    import torch
    from transformers import AutoConfig

    from autotune.models import hf_config as hf

    cfg_hf = AutoConfig.for_model("gpt_bigcode", n_layer=3, n_embd=64, n_head=4, n_positions=256, vocab_size=512)
    s = hf.spec_from_config(cfg_hf, name="test-bigcode", source="test")
    with torch.device("meta"):
        impl, module = code_trace.build(s, "bf16", "sdpa", s.num_layers)
        held = sum(b.numel() * b.element_size() for b in module.buffers())
    assert held > 0
    t = trace(s, parse_gpus("2xcpu@8GiB"), TrainConfig(zero_stage=zero, precision="bf16", micro_batch=1, seq_len=32))
    assert {phase: terms.get("module_buffers") for phase, terms in t.phases.items()} == dict.fromkeys(t.phases, held)


MIXED = dict(
    model_type="deepseek_v3",
    num_hidden_layers=8,
    first_k_dense_replace=3,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=4,
    intermediate_size=256,
    vocab_size=512,
    max_position_embeddings=128,
    n_routed_experts=4,
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


@pytest.mark.slow  # ~10 s each; quick loop: a mixed stack's step against the real one in test_hf
@pytest.mark.parametrize("ckpt", [0, 2])  # (test_every_per_layer_list_of_a_config_follows_the_depth_traced)
def test_a_stack_of_mixed_layers_is_traced_whole_and_matches_a_real_cpu_run(ckpt):
    """DeepSeek-V3's code with 3 dense layers before 5 MoE ones: extrapolated from its first layers,
    as a uniform stack is, k = 0 read 11.6% over a real run (the dense MLP's activations are not the
    routed experts'); traced whole, it is the real step to the byte."""
    from transformers import AutoConfig

    from autotune.memory.traced import mixed_blocks_note
    from autotune.models import hf_config as hf

    d = dict(MIXED)
    s = hf.spec_from_config(AutoConfig.for_model(d.pop("model_type"), **d), name="test-mixed", source="test")
    assert not s.uniform_blocks and spec("llama").uniform_blocks
    assert mixed_blocks_note(s) == "" and "approximate" in mixed_blocks_note(dataclasses.replace(s, num_layers=61))
    cfg = TrainConfig(micro_batch=2, seq_len=48, precision="bf16", attention="sdpa", ckpt_layers=ckpt)
    real = measure_cpu(s, cfg)
    got = trace(s, CPU, cfg).raw_peaks
    for phase in ("forward", "backward", "optimizer"):
        assert 0 <= real[phase] - got[phase] <= 128, (phase, got, real)


@pytest.mark.slow
def test_the_grid_prices_each_k_of_a_mixed_stack():
    """Checkpointing one of DeepSeek's dense layers saves other bytes than an MoE layer: a mixed stack
    is not affine in k, so the grid prices each k (bilinear in the micro batch only). Fitted on k = 1, 2
    as a uniform stack is, k = 5 read 3.2% and k = 8 5.3% under the estimate at micro batch 4."""
    from transformers import AutoConfig

    from autotune.models import hf_config as hf

    d = dict(MIXED)
    s = hf.spec_from_config(AutoConfig.for_model(d.pop("model_type"), **d), name="test-mixed", source="test")
    gpus, base = parse_gpus("2xcpu@4GiB"), TrainConfig(seq_len=128, precision="bf16", zero_stage=1)
    mbs, ks = np.array([1, 4]), np.array([0, 5, 8])
    grid = grid_total_bytes(s, gpus, base, mbs, ks)
    for i, mb in enumerate(mbs):
        for j, k in enumerate(ks):
            exact = estimate(s, gpus, dataclasses.replace(base, micro_batch=int(mb), ckpt_layers=int(k))).total_bytes
            assert abs(grid[i, j] - exact) <= 1e-3 * exact, (mb, k, grid[i, j], exact)


HYBRID = dict(
    model_type="jamba",
    num_hidden_layers=3,
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
)


@pytest.mark.slow  # ~12 s (a Jamba traced at ZeRO-2); quick loop: a mixed stack's step (test_hf, above)
def test_the_head_phase_of_a_mixed_stack_holds_what_its_layers_saved():
    """ZeRO-2's head phase prices the layers' saved activations beside DeepSpeed's first reduction.
    They were a k + b m from the slopes of one layer more, which for a mixed stack is a layer of
    another kind: a 4-layer Jamba (Mamba, attention, Mamba, attention) read 7.3 MB at k = 1 where its
    layers hold 2.7 MB, 58% over a real 2-rank ZeRO-2 run. They are now the trace's own moment after
    the last layer, which equals a k + b m on a uniform stack."""
    from transformers import AutoConfig

    from autotune.models import hf_config as hf

    d = dict(HYBRID)
    s = hf.spec_from_config(AutoConfig.for_model(d.pop("model_type"), **d), name="test-hybrid", source="test")
    assert not s.uniform_blocks
    from autotune.memory.buffers import reduces_first_at_head
    from autotune.memory.layout import Layout

    for model in (s, spec("llama")):
        cfg = TrainConfig(zero_stage=2, precision="bf16", micro_batch=2, seq_len=48, ckpt_layers=1)
        gpus = parse_gpus("2xcpu@8GiB")
        t = trace(model, gpus, cfg)
        head = t.phases["backward (head)"]
        # where the head's gradient bypasses the bucket, the reduction runs as the final norm's gradient arrives
        # (issue 51): what is saved then, the final norm's inputs too
        at = "bwd.reduce" if reduces_first_at_head(model, cfg, Layout.of(model, gpus, cfg)) else "fwd.layers"
        assert head["activations"] + head.get("checkpointed_inputs", 0) == t.points[at]["activations"]
        if model.uniform_blocks:
            lb = t.layer_bytes
            assert t.points["fwd.layers"]["activations"] == lb["checkpointed_layer"] + lb["full_layer"] * (
                model.num_layers - 1
            )


@pytest.mark.slow
def test_a_hybrid_stack_at_zero_2_is_priced_as_it_runs(real_runs):
    """A real ZeRO-2 bf16 run of a small Jamba (Mamba, attention, Mamba) on 2 CPU ranks, one layer
    checkpointed: 6,013,216 B measured, 6,337,624 B estimated (+5.4%) before the head phase read the
    trace's fwd.layers point, the tracer counted in-place gradient sums once and the layers'
    parameter sizes were read one by one; then 6,128,664 B (+1.9%), and 6,259,736 with the late-freed gradient
    priced at its worst timing (issue 51), which this run's steps did not meet. Over, never under: the 1.9% left
    is not analysed (docs/memory.md)."""
    s = hybrid_spec()  # the shape HYBRID
    gpus = parse_gpus("2xcpu")
    cfg = TrainConfig(zero_stage=2, precision="bf16", micro_batch=2, seq_len=48, ckpt_layers=1)
    req, res = real_runs["hybrid"]  # the run of cfg (real_runs)
    assert (req.model, req.cluster, req.config) == (s, gpus, cfg)
    assert res.status == "ok", res.reason
    full = estimate(s, gpus, cfg)
    est, measured = full.tensor_peak_bytes, steady_peak(res)
    # the gradient a collective's thread frees late is priced at its worst timing (issue 51, late_freed_gradient):
    # over by up to it in a run whose steps never met that timing, never under
    err = est / measured - 1
    assert 0 <= err and err - timing_allowance(full, measured) <= 0.03, (est, per_rank_steps(res))


@pytest.mark.slow  # ~12 s (a Jamba traced and run at two lengths); quick loop: a mixed stack's step (test_hf)
def test_gradients_the_real_engine_adds_in_place_are_counted_once():
    """Jamba's Mamba scan (transformers' torch path) slices its discretised A and B per token, and
    autograd adds each token's gradient into the one before it. The real engine adds in place where
    it holds the only reference to the first gradient; on fake tensors, a Tensor subclass, it never
    does, so the trace counted one (batch, channels, seq, state) sum too many at the backward's peak:
    4096 B per token here, over a real CPU step by 28,672 B at seq 8 and 126,976 B at seq 32
    (tracer.LiveBytes, accumulation_hooks). Now the real step to the byte at both."""
    from transformers import AutoConfig

    from autotune.models import hf_config as hf

    conf = AutoConfig.for_model(
        "jamba",
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        attn_layer_period=8,
        attn_layer_offset=7,
        expert_layer_period=8,
        expert_layer_offset=7,
        mamba_d_state=8,
        mamba_dt_rank=8,
    )
    s = hf.spec_from_config(conf, name="test-mamba-scan", source="test")
    for seq in (8, 32):
        cfg = TrainConfig(micro_batch=1, seq_len=seq, precision="fp32", attention="sdpa")
        got, real = trace(s, CPU, cfg).raw_peaks, measure_cpu(s, cfg)
        for phase in ("forward", "backward", "optimizer"):
            assert 0 <= real[phase] - got[phase] <= 128, (seq, phase, got, real)


def test_a_mixed_stack_has_each_of_its_parameters_sized():
    """DeepSpeed's partitions, ZeRO-3's persistent parameters and ZeRO-2's held gradient are priced
    from the module's parameter sizes. They were one layer's (read from a 2-layer model) times the
    depth: a Jamba's summed to 55% of its parameters and missed its experts' tensor, the largest
    gradient ZeRO-2 holds. A mixed stack's are now every layer's, and a uniform one's still sum to
    its count."""
    from transformers import AutoConfig

    from autotune.models import hf_config as hf

    d = dict(HYBRID)
    s = hf.spec_from_config(AutoConfig.for_model(d.pop("model_type"), **d), name="test-hybrid", source="test")
    experts = d["num_experts"] * 2 * d["intermediate_size"] * d["hidden_size"]  # gate and up, stacked
    for model in (s, spec("llama")):
        sizes = code_trace.param_numels(model)
        assert sum(sizes) == model.num_params
    assert max(code_trace.layer_numels(s)) == experts
