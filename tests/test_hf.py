"""Hugging Face models and the model-code seam (autotune/impl/hf.py, autotune/impl/): configs from files,
directories and the local hub cache; exact counts from the meta-device model; checkpointing the first
k layers through transformers' mechanism; the user's own module; real trials of all three codes."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from autotune.hardware import parse_gpus
from autotune.impl import hf, impl_for
from autotune.models import ModelSpec, SpecError, hf_config, presets, published_params, resolve_model
from autotune.train_config import TrainConfig, check_config

DATA = Path(__file__).parent / "data"
TINY = ["hf-llama", "hf-gpt2", "hf-gpt-neox", "hf-qwen2", "hf-mistral"]


@pytest.mark.parametrize("name", sorted(published_params()))
def test_preset_meta_count_is_published(name):
    """A preset becomes its family's transformers config; the model built from it on the meta
    device has exactly the published count (and the shape formula's)."""
    spec = resolve_model(name)
    assert spec.implementation == "hf" and spec.hf_config["model_type"] in ("llama", "mistral", "gpt2", "mpt")
    n = sum(p.numel() for p in hf_config.meta_model(hf_config.config_object(spec)).parameters())
    assert n == published_params()[name] == presets()[name].shape_params


@pytest.mark.parametrize("name", TINY)
def test_tiny_configs_count_from_meta(name):
    spec = resolve_model(str(DATA / name))  # a directory holding config.json
    assert spec.param_count == sum(
        p.numel() for p in hf_config.meta_model(hf_config.load_config(str(DATA / name))).parameters()
    )
    if name == "hf-qwen2":
        # Qwen2 has biases on q, k, v but not on o or the MLP: the meta count is the truth, and it
        # differs from the bias-free shape formula by exactly those biases.
        assert spec.num_params - spec.shape_params == spec.num_layers * (spec.q_dim + 2 * spec.kv_dim)
    else:
        assert spec.num_params == spec.shape_params
    assert 0.5e6 < spec.num_params < 5e6
    # JSON-able and rebuilt as the study does (dataclasses.asdict -> ModelSpec(**d))
    d = json.loads(json.dumps(dataclasses.asdict(spec)))
    assert ModelSpec(**d) == spec and hash(ModelSpec(**d)) == hash(spec)


def test_llama_gqa_shape_and_code_name():
    spec = resolve_model(str(DATA / "hf-llama" / "config.json"))
    assert (spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (4, 128, 4, 2)
    assert spec.code_name == "hf:LlamaForCausalLM" and not spec.tied_embeddings
    assert resolve_model(str(DATA / "hf-gpt2")).tied_embeddings
    assert resolve_model("tiny-llama", implementation="builtin").code_name == "builtin"


def test_hub_id_is_read_from_the_local_cache_only(tmp_path, monkeypatch):
    from huggingface_hub import constants

    with pytest.raises(SpecError, match="not in the local Hugging Face cache .*never downloads"):
        resolve_model("someone/not-a-cached-model-xyz")
    # A cache laid out as huggingface_hub writes it: models--org--name/{refs/main, snapshots/<rev>/}
    repo = tmp_path / "models--acme--tiny-llama"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (snap / "config.json").write_text((DATA / "hf-llama" / "config.json").read_text())
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = resolve_model("acme/tiny-llama")
    assert spec.num_params == resolve_model(str(DATA / "hf-llama")).num_params


@pytest.mark.parametrize("impl", ["hf", "builtin", "factory"])
def test_seam_builds_every_code_on_meta_with_fewer_layers(impl):
    spec = resolve_model("tiny-llama", implementation=impl, factory="tiny_factory:make" if impl == "factory" else None)
    code = impl_for(spec)
    with torch.device("meta"):
        model = code.build(spec, dtype=torch.bfloat16, attention="sdpa", num_layers=2)
    assert len(code.layers(model)) == 2 and model.training
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def _saved_bytes(code, model, tokens) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd keeps for backward in one forward (saved_tensors_hooks sees every saved tensor),
    and the gradients of the backward that follows."""
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = code.loss(model, tokens)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return total, grads


# the factory's in the full suite (~5 s); quick loop: its checkpointed layer against a real step (test_memory_hf)
@pytest.mark.parametrize("impl", ["hf", pytest.param("factory", marks=pytest.mark.slow)])
def test_checkpointing_first_layers_saves_less_and_keeps_gradients(impl):
    spec = resolve_model(
        str(DATA / "hf-llama"), implementation=impl, factory="tiny_factory:make" if impl == "factory" else None
    )
    code = impl_for(spec)
    torch.manual_seed(0)
    model = code.build(spec, dtype=torch.float32, attention="sdpa")
    tokens = torch.randint(0, spec.vocab_size, (2, 65), generator=torch.Generator().manual_seed(0))
    saved, grads = {}, {}
    for k in (0, 2, 4, 0):
        code.checkpoint_first(model, k)
        saved[k], g = _saved_bytes(code, model, tokens)
        grads.setdefault(k, g)
    # Each checkpointed layer keeps only its input instead of its internals.
    assert saved[0] > saved[2] > saved[4] > 0
    # the same saving per layer: layers 3-4 free what layers 1-2 free
    assert saved[2] - saved[4] == pytest.approx(saved[0] - saved[2], rel=0.05)
    for n, g in grads[0].items():  # recomputing changes no gradient (no dropout in this config)
        torch.testing.assert_close(grads[4][n], g)
        torch.testing.assert_close(grads[2][n], g)
    if impl == "hf":
        layers = hf.decoder_layers(model)
        hf.checkpoint_first_layers(model, 1)
        assert [layer.gradient_checkpointing for layer in layers] == [True, False, False, False]
        with pytest.raises(SpecError, match="0..4"):
            hf.checkpoint_first_layers(model, 5)


def test_gpt2_dropout_is_on_in_training():
    spec = resolve_model(str(DATA / "hf-gpt2"))
    model = impl_for(spec).build(spec, dtype=torch.float32, attention="eager")
    assert spec.hf_config["resid_pdrop"] == 0.1 and model.training
    tokens = torch.randint(0, spec.vocab_size, (1, 33), generator=torch.Generator().manual_seed(0))
    code = impl_for(spec)
    assert code.loss(model, tokens).item() != code.loss(model, tokens).item()  # dropout masks differ


def test_flash_attention_refused_on_cpu_and_outside_hf():
    m, cpu, a100 = resolve_model("tiny-llama"), parse_gpus("2xcpu"), parse_gpus("2xA100")
    with pytest.raises(SpecError, match="CUDA kernels only"):
        check_config(TrainConfig(attention="flash_attention_2", seq_len=64), m, cpu)
    with pytest.raises(SpecError, match="transformers attn_implementation"):
        check_config(
            TrainConfig(attention="flash_attention_2", seq_len=64),
            resolve_model("tiny-llama", implementation="builtin"),
            a100,
        )
    check_config(TrainConfig(attention="flash_attention_2", seq_len=64), m, a100)


def test_attention_a_class_lacks_is_refused_with_what_it_runs(tmp_path, capsys):
    """transformers has no sdpa for some classes (Bloom, Gemma2): by default autotune takes what
    transformers picks for the class (eager; the traced step of a Bloom in eager attention is the real
    one within 128 B: benchmarks/hf_families.py), and asked for sdpa it says which the class runs (exit
    2, no traceback)."""
    from transformers import AutoConfig

    from autotune.cli import main

    AutoConfig.for_model("bloom", n_layer=2, hidden_size=64, n_head=4, vocab_size=300).save_pretrained(tmp_path)
    spec = resolve_model(str(tmp_path))
    assert hf_config.attentions(spec) == ("eager",)
    assert hf_config.attentions(resolve_model("tiny-llama"))[:2] == ("sdpa", "eager")
    assert hf_config.attentions(resolve_model("tiny-llama", implementation="builtin")) is None
    args = ["estimate", "--model", str(tmp_path), "--gpus", "2xcpu", "--seq-len", "32"]
    assert main(args) == 0 and "attention eager" in capsys.readouterr().out
    assert main([*args, "--attention", "sdpa"]) == 2
    assert "BloomForCausalLM has no sdpa attention" in capsys.readouterr().err


def test_mixtral_is_traced_in_fp32_as_its_cpu_kernel_runs():
    """transformers' Mixtral experts run torch._grouped_mm, whose fake-tensor (meta) function takes bf16
    only while its CPU kernel runs fp32 too: fp32 was refused ("Expected inputs of BF16 type") though
    a real step runs. Traced now (tracer._GroupedMmAnyDtype), it is the real CPU step to the byte, and
    the cost model prices the experts' grouped GEMMs as GEMMs (2 x rows x K x N), not as memory
    traffic."""
    from cpu_step import measure_cpu
    from transformers import AutoConfig

    from autotune import costops
    from autotune.memory.traced import trace

    conf = AutoConfig.for_model(
        "mixtral",
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=300,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    spec = hf_config.spec_from_config(conf, name="test-mixtral", source="test")
    cfg = TrainConfig(precision="fp32", micro_batch=2, seq_len=32)
    got, real = trace(spec, parse_gpus("1xcpu@8GiB"), cfg).raw_peaks, measure_cpu(spec, cfg)
    for phase in ("forward", "backward", "optimizer"):
        assert 0 <= real[phase] - got[phase] <= 128, (phase, got, real)
    profile = costops.profile_for(spec, "hf", "bf16", "sdpa", 2, 32)
    experts = sum(n * op.flops for op, n in profile.layer if op.name == "_grouped_mm" and op.phase == "fwd")
    # gate+up (64 -> 2 x 128) and down (128 -> 64) for 64 tokens x 2 experts each
    assert {op.cls for op, _ in profile.layer if op.name == "_grouped_mm"} == {"gemm"}
    assert experts == 2 * (64 * 2) * 64 * 256 + 2 * (64 * 2) * 128 * 64


def test_a_sequence_past_the_position_table_is_one_clear_line(capfd):
    """MPT's ALiBi table is max_seq_len long: a longer sequence cannot step, and the estimate says so
    in one line with the reason, without torch's own traceback of the failed fake op on stderr."""
    from transformers import AutoConfig

    from autotune.memory import estimate

    conf = AutoConfig.for_model("mpt", d_model=64, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=300)
    spec = hf_config.spec_from_config(conf, name="test-mpt", source="test")
    with pytest.raises(SpecError, match="longer than the config's max_seq_len 64"):
        estimate(spec, parse_gpus("2xA100"), TrainConfig(seq_len=128, attention="eager"))
    assert "failed while attempting to run meta" not in capfd.readouterr().err
    assert estimate(spec, parse_gpus("2xA100"), TrainConfig(seq_len=64, attention="eager")).fits


@pytest.mark.slow  # ~16 s of traces; quick loop: the refusal (test_a_sequence_past_the_position_table_is_one_clear_line)
# and --max-seq-len (test_parallel's sp 8, test_memory_hf's first estimate)
def test_the_largest_sequence_stops_where_the_models_code_refuses_longer_ones():
    """`--max-seq-len` of MPT on GPUs with room for longer sequences: its code's ALiBi table bounds
    the answer at the config's max_seq_len (it raised the refusal before), and memory below it."""
    from transformers import AutoConfig

    from autotune.memory.limits import largest_fitting

    conf = AutoConfig.for_model("mpt", d_model=64, n_heads=4, n_layers=2, max_seq_len=300, vocab_size=300)
    spec = hf_config.spec_from_config(conf, name="test-mpt", source="test")
    cfg = TrainConfig(attention="eager")
    assert largest_fitting(spec, parse_gpus("2xA100"), cfg, "seq_len") == 300
    tight = largest_fitting(spec, parse_gpus("1xcpu@6MiB"), cfg, "seq_len")
    assert 0 < tight < 300
    assert estimate_fits(spec, "1xcpu@6MiB", cfg, tight) and not estimate_fits(spec, "1xcpu@6MiB", cfg, tight + 1)


def estimate_fits(spec, gpus, cfg, seq_len) -> bool:
    from autotune.memory import estimate

    return estimate(spec, parse_gpus(gpus), dataclasses.replace(cfg, seq_len=seq_len)).fits


def test_factory_errors_say_what_is_allowed():
    with pytest.raises(SpecError, match="--model-factory"):
        resolve_model("tiny-llama", implementation="factory")
    spec = resolve_model("tiny-llama", factory="no_such_module_xyz:make")
    assert spec.implementation == "factory"
    with pytest.raises(SpecError, match="cannot import 'no_such_module_xyz'"):
        impl_for(spec).build(spec, dtype=torch.float32, attention="sdpa")


@pytest.mark.slow
def test_real_trials_of_hf_and_factory_code(tmp_path, monkeypatch):
    """2 gloo ranks, one process group: the Hugging Face Llama at ZeRO-3 then ZeRO-0 (the second must
    not be built under zero.Init: the HfDeepSpeedConfig of the first is unset), GPT-2 with its dropout
    at ZeRO-3 with 2 of 4 layers checkpointed, the user's module and the builtin stand-in at ZeRO-3
    with checkpointing."""
    from autotune.trial import run_trials
    from autotune.trial.record import TrialRequest

    # The ranks import the factory by name, as a user's would be: from their PYTHONPATH.
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    )
    cluster = parse_gpus("2xcpu")
    llama, gpt2 = resolve_model(str(DATA / "hf-llama")), resolve_model(str(DATA / "hf-gpt2"))
    factory = resolve_model(str(DATA / "hf-llama"), factory="tiny_factory:make")
    builtin = resolve_model(str(DATA / "hf-llama"), implementation="builtin")
    runs = [
        (llama, 3, "bf16", 2),
        (llama, 0, "bf16", 0),
        (gpt2, 3, "fp32", 2),
        (factory, 3, "bf16", 1),
        (builtin, 3, "bf16", 2),
    ]
    reqs = [
        TrialRequest(
            model=m,
            cluster=cluster,
            out_dir=tmp_path / f"t{i}",
            steps=3,
            warmup_steps=1,
            timeout_s=240,
            config=TrainConfig(zero_stage=z, precision=p, ckpt_layers=k, micro_batch=2, seq_len=64),
        )
        for i, (m, z, p, k) in enumerate(runs)
    ]
    results = run_trials(reqs)
    for req, res in zip(reqs, results):
        assert res.status == "ok", f"{res.reason}\n{res.log_tail}"
        assert res.losses[-1] < res.losses[0], res.losses  # a fixed batch: the loss falls
        assert abs(res.losses[0] - 7.62) < 0.3, res.losses  # small random init: ~ln(2048) at start
        assert res.implementation == req.model.code_name
    assert [r.implementation for r in results] == ["hf:LlamaForCausalLM"] * 2 + [
        "hf:GPT2LMHeadModel",
        "factory:tiny_factory:make",
        "builtin",
    ]
    n = llama.num_params
    assert results[1].param_bytes_per_rank == [2 * n] * 2  # ZeRO-0: the whole bf16 model per rank
    assert max(results[0].param_bytes_per_rank) < 2 * n * 0.6  # ZeRO-3: about half of it


@pytest.mark.slow
def test_trainer_runs_the_exported_json(tmp_path):
    """The Hugging Face Trainer, 2 gloo ranks, trains 2 steps with the DeepSpeed JSON `autotune export`
    writes (deepspeed_config, ZeRO-3), the TrainingArguments it prints, and the first 2 of 4 layers
    checkpointed by autotune.impl.hf.checkpoint_first_layers (tests/hf_trainer_run.py)."""
    import subprocess
    import sys

    from autotune.deepspeed_config import deepspeed_config
    from autotune.trial.launch import free_port

    model = resolve_model(str(DATA / "hf-llama"))
    cfg = TrainConfig(zero_stage=3, micro_batch=2, seq_len=64, ckpt_layers=2)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(deepspeed_config(cfg, model, parse_gpus("2xcpu"))))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "LOCAL_SIZE": "2", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(Path(__file__).parent / "hf_trainer_run.py"),
            str(DATA / "hf-llama"),
            str(ds),
            "2",
            str(tmp_path / "out"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    line = [x for x in run.stdout.splitlines() if x.startswith("AUTOTUNE_TRAINER ")]
    assert run.returncode == 0 and line, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads(line[0].split(" ", 1)[1])
    assert out["steps"] == 2 and out["engine"] == "DeepSpeedEngine" and out["zero3"]
    assert out["flags"] == [True, True, False, False]
    assert all(abs(loss - 7.62) < 0.3 for loss in out["losses"])  # ~ln(2048): random init, as the trials


@pytest.mark.parametrize(
    "model_type,shape,said",
    [
        # a multimodal model: its language model is one part of it
        (
            "gemma3",
            dict(
                text_config=dict(
                    num_hidden_layers=2,
                    hidden_size=64,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    head_dim=16,
                    intermediate_size=128,
                    vocab_size=512,
                )
            ),
            "multimodal model whose language model is its 'gemma3_text' part",
        ),
        # several text parts, so transformers' get_text_config() itself refuses to choose
        ("musicgen", dict(decoder=dict(vocab_size=4096)), "has several text parts"),
        # the class's own constructor refuses the config (an AssertionError of transformers)
        ("reformer", dict(is_decoder=False), "cannot build model_type 'reformer' from this config (AssertionError"),
        # a config class's validation (huggingface_hub's StrictDataclassClassValidationError, not a ValueError)
        ("qwen2", dict(num_hidden_layers=2, layer_types=["full_attention"] * 3), "cannot read it"),
        # a state-space model: no attention heads to price
        ("mamba", dict(num_hidden_layers=2, hidden_size=64, vocab_size=512), "names no num_attention_heads"),
    ],
)
def test_a_config_autotune_cannot_price_is_one_clear_line(tmp_path, capsys, model_type, shape, said):
    """Configs from across transformers' model types that once ended in a traceback (exit 1): each is
    now `error: ...` with exit code 2 and what to do, found by estimating every AutoModelForCausalLM
    type's default config."""
    from transformers import AutoConfig
    from transformers.utils import logging as hf_logging

    from autotune.cli import main

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # MusicGen's default config warns of its own token ids
    try:
        d = AutoConfig.for_model(model_type).to_dict()
    finally:
        hf_logging.set_verbosity(verbosity)
    d.update(shape)
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert main(["estimate", "--model", str(tmp_path), "--gpus", "1xA100"]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_parameter_the_loss_does_not_reach_is_traced_without_a_gradient():
    """A trained parameter the forward never uses gets no gradient (an encoder-decoder's cross-attention
    in its decoder-only causal LM): the trace once failed on its missing .grad. The step is the real
    one but for that parameter's two AdamW states: the trace's first step gives every trained
    parameter its states, as DeepSpeed's flat partition does; torch's AdamW makes none for a
    parameter that never had a gradient."""
    from cpu_step import measure_cpu

    from autotune.memory.traced import trace
    from autotune.models import from_shape

    spec = dataclasses.replace(
        from_shape(
            "test-unused",
            "gpt2",
            num_layers=2,
            hidden_size=64,
            num_heads=4,
            ffn_hidden_size=128,
            vocab_size=300,
            max_seq_len=128,
        ),
        implementation="factory",
        factory="tiny_factory:make_with_an_unused_layer",
    )
    cfg = TrainConfig(micro_batch=2, seq_len=32)
    got, real = trace(spec, parse_gpus("1xcpu@8GiB"), cfg).raw_peaks, measure_cpu(spec, cfg)
    states = 2 * (64 * 64 + 64) * 2  # exp_avg and exp_avg_sq of the unused bf16 Linear(64, 64)
    for phase in ("forward", "backward", "optimizer"):
        # the trace also counts the unused parameter's 8-byte step count, which torch's AdamW lacks too
        assert -8 <= real[phase] + states - got[phase] <= 128, (phase, got, real)


def test_a_causal_lm_whose_num_hidden_layers_is_another_stack_is_refused():
    """BART's causal LM is its decoder, but its config's num_hidden_layers is the encoder's depth:
    autotune sizes a model by that number, so it says so instead of tracing the wrong depth."""
    from transformers import AutoConfig

    conf = AutoConfig.for_model(
        "bart",
        d_model=64,
        decoder_layers=3,
        encoder_layers=2,
        decoder_attention_heads=4,
        encoder_attention_heads=4,
        decoder_ffn_dim=128,
        encoder_ffn_dim=128,
        vocab_size=300,
        max_position_embeddings=128,
    )
    with pytest.raises(SpecError, match="num_hidden_layers 2 is not the 3 decoder layers"):
        hf_config.spec_from_config(conf, name="test-bart", source="test")


@pytest.mark.slow  # several configs traced (~5 s)
def test_every_per_layer_list_of_a_config_follows_the_depth_traced():
    """transformers 5 configs list more than `layer_types` per layer: `mlp_layer_types` (dense or
    sparse: EXAONE-MoE, DeepSeek-V3.2, Kimi-Linear and more). Only layer_types followed the programs'
    depths, so the trace of one layer more than the config refused the model with transformers'
    validation error ("num_hidden_layers (4) must be equal to the number of mlp_layer_types (3)").
    Each list now follows, continued as a deeper model of the config has it, and the step is the real one."""
    from cpu_step import measure_cpu
    from transformers import AutoConfig

    from autotune.memory.traced import trace

    assert hf_config.continued(["dense", "sparse", "sparse"], 5) == ["dense"] + ["sparse"] * 4
    assert hf_config.continued(["full", "sliding"] * 2, 5) == ["full", "sliding", "full", "sliding", "full"]
    assert hf_config.continued(["a", "b", "c"], 2) == ["a", "b"]
    conf = AutoConfig.for_model(
        "exaone_moe",
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        mlp_layer_types=["dense", "sparse", "sparse"],
        sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    )
    spec = hf_config.spec_from_config(conf, name="test-exaone-moe", source="test")
    assert not spec.uniform_blocks
    cfg = TrainConfig(micro_batch=2, seq_len=48, precision="bf16", attention="eager", ckpt_layers=1)
    got, real = trace(spec, parse_gpus("1xcpu@8GiB"), cfg).raw_peaks, measure_cpu(spec, cfg)
    for phase in ("forward", "backward", "optimizer"):
        assert 0 <= real[phase] - got[phase] <= 128, (phase, got, real)
