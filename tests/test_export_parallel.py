"""`autotune export` of a tensor-parallel (AutoTP) configuration: the DeepSpeed JSON's tensor_parallel section,
the Hugging Face lines printed for it (and for DeepCompile: who calls engine.compile()), the `--accelerate-config`
file (loaded and launch-checked by accelerate's own code), and the Hugging Face Trainer training 2 steps on 2 CPU
ranks with exactly what was exported, started by `accelerate launch --config_file` with that file
(docs/parallelism.md, "Export").

Run as a script, this file is one rank of that training:

    accelerate launch --config_file ACCELERATE.yaml tests/test_export_parallel.py CONFIG_DIR DS_JSON OUT_DIR ARGS_JSON

and writes OUT_DIR/rank<r>.json: its own losses, steps, shard shapes and the Trainer's total batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"
TP2 = dict(autotp_size=2, zero_stage=1, precision="bf16", micro_batch=2, grad_accum=1, seq_len=64)


def make_study(name: str, gpus: str = "2xcpu", **over):
    """One successful measured trial of the tiny Llama of tests/data/hf-llama (4 heads, 2 KV heads)."""
    import optuna
    from optuna.trial import TrialState

    from autotune.hardware import parse_gpus
    from autotune.models import resolve_model
    from autotune.search import study as st
    from autotune.train_config import TrainConfig

    model, cluster = resolve_model(str(DATA / "hf-llama")), parse_gpus(gpus)
    cfg = TrainConfig(**{**TP2, **over})
    attrs = st.study_attrs(
        model, cluster, seq_len=64, global_batch=None, space_text="", space_path="t", source="measured"
    )
    study = st.create_study(name, None, attrs, sampler=None)
    dists = st.distributions([cfg])
    res = {
        "status": "ok",
        "source": "measured",
        "samples_per_s": 3.0,
        "tokens_per_s": 192.0,
        "peak_bytes": 10**7,
        "log_tail": "",
    }
    ua = {
        "config": cfg.to_dict(),
        "status": "ok",
        "source": "measured",
        "reason": "",
        "result": res,
        "estimate": {
            "tensor_bytes": 10**7,
            "total_bytes": 10**7,
            "capacity_bytes": 10**9,
            "dominant_term": "activations",
        },
    }
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.COMPLETE, value=3.0, params=st.params_of(cfg, dists), distributions=dists, user_attrs=ua
        )
    )
    return model, cluster, cfg


def _trials_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    monkeypatch.chdir(tmp_path)


def test_export_of_tp2_writes_tensor_parallel_and_the_trainer_lines(tmp_path, monkeypatch, capsys):
    from autotune.cli import main
    from autotune.deepspeed_config import deepspeed_config

    _trials_dir(tmp_path, monkeypatch)
    model, cluster, cfg = make_study("tp")
    out = tmp_path / "ds.json"
    assert main(["export", "--study", "tp", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    ds = json.loads(out.read_text())
    assert ds == deepspeed_config(cfg, model, cluster, style="trainer")
    assert ds["tensor_parallel"] == {"autotp_size": 2} and "train_batch_size" not in ds
    assert (
        f'TrainingArguments(deepspeed="{out}", per_device_train_batch_size=2, gradient_accumulation_steps=1, '
        "gradient_checkpointing=False, bf16=True"
    ) in text
    assert "AutoTP 2, dp = 2 / 2 = 1" in text and "deepspeed.tp_model_init(model, tp_size=2" in text
    assert "= 2 x 1 x 1 = 2 sequences" in text and "rank r // 2" in text
    assert "accelerate launch" not in text  # no --accelerate-config: no line for it
    assert main(["export", "--study", "tp", "--out", str(out), "--trial", "0"]) == 0


def test_export_without_tp_prints_no_tp_lines(tmp_path, monkeypatch, capsys):
    from autotune.cli import main

    _trials_dir(tmp_path, monkeypatch)
    make_study("dp", autotp_size=1)
    out = tmp_path / "ds.json"
    assert main(["export", "--study", "dp", "--out", str(out)]) == 0
    assert "Tensor parallelism" not in capsys.readouterr().out
    assert "tensor_parallel" not in json.loads(out.read_text())


def test_accelerate_config_loads_with_accelerates_own_loader(tmp_path, monkeypatch, capsys):
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.utils import DistributedType

    from autotune.cli import main

    _trials_dir(tmp_path, monkeypatch)
    make_study("tp", zero_stage=3)
    out, acc = tmp_path / "ds.json", tmp_path / "acc" / "accelerate.yaml"
    assert main(["export", "--study", "tp", "--out", str(out), "--accelerate-config", str(acc)]) == 0
    text = capsys.readouterr().out
    assert f"wrote {acc}" in text and f"accelerate launch --config_file {acc} train.py" in text
    conf = load_config_from_file(str(acc))
    assert isinstance(conf, ClusterConfig) and conf.distributed_type == DistributedType.DEEPSPEED
    assert conf.num_processes == 2 and conf.num_machines == 1 and conf.use_cpu
    # relative to the YAML's folder (accelerate_config_yaml): ../ds.json from acc/
    assert conf.deepspeed_config == {"deepspeed_config_file": "../ds.json", "zero3_init_flag": True}
    assert conf.mixed_precision is None  # the JSON's bf16 section decides


def test_accelerate_config_for_two_nodes(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    from autotune.hardware import parse_gpus
    from autotune.report.export import accelerate_config_yaml
    from autotune.train_config import TrainConfig

    acc = tmp_path / "a.yaml"
    acc.write_text(accelerate_config_yaml(TrainConfig(**TP2), parse_gpus("16xH100"), tmp_path / "ds.json", acc))
    assert "set main_process_ip" in acc.read_text()
    conf = load_config_from_file(str(acc))
    assert (conf.num_machines, conf.num_processes, conf.use_cpu) == (2, 16, False)
    assert conf.deepspeed_config["deepspeed_multinode_launcher"] == "standard"  # torchrun on each node


def _launch_env(yaml_path: Path, script: Path) -> dict:
    """The environment `accelerate launch --config_file yaml_path script` gives a GPU rank
    (accelerate/commands/launch.py launch_command, deepspeed branch; utils/launch.py prepare_deepspeed_cmd_env)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    args = launch_command_parser().parse_args(
        ["--config_file", str(yaml_path), "--main_process_port", "0", str(script)]
    )
    args, defaults, mp_from_config_flag = _validate_launch_command(args)
    assert args.use_deepspeed and not args.cpu
    fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mp_from_config_flag else [])
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)
    _, env = prepare_deepspeed_cmd_env(args)
    return env


def test_accelerate_launch_accepts_the_file_for_gpus_and_would_refuse_mixed_precision(tmp_path, monkeypatch):
    """For a GPU cluster (8 x H100, one node): what `accelerate launch` builds from the file is accepted by
    DeepSpeedPlugin, the check a rank runs (utils/dataclasses.py _deepspeed_config_checks); the same file
    with a mixed_precision key is refused, which is why export leaves it out."""
    import yaml
    from accelerate.utils import DeepSpeedPlugin
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from autotune.deepspeed_config import deepspeed_config
    from autotune.hardware import parse_gpus
    from autotune.models import resolve_model
    from autotune.report.export import accelerate_config_yaml
    from autotune.train_config import TrainConfig

    cluster, cfg = parse_gpus("8xH100"), TrainConfig(**{**TP2, "zero_stage": 3})
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(deepspeed_config(cfg, resolve_model(str(DATA / "hf-llama")), cluster)))
    acc = tmp_path / "accelerate.yaml"
    acc.write_text(accelerate_config_yaml(cfg, cluster, ds, acc))
    monkeypatch.chdir(tmp_path)  # the YAML's folder, where the relative path it names resolves
    env = _launch_env(acc, tmp_path / "train.py")
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "ds.json"
    assert env["ACCELERATE_DEEPSPEED_ZERO3_INIT"] == "true"
    for k, v in env.items():
        if k.startswith("ACCELERATE_"):
            monkeypatch.setenv(k, v)
    try:
        plugin = DeepSpeedPlugin()
        assert plugin.deepspeed_config["tensor_parallel"] == {"autotp_size": 2}
        assert plugin.zero_stage == 3 and plugin.zero3_init_flag
        conf = yaml.safe_load(acc.read_text())
        conf["mixed_precision"] = "bf16"
        acc.write_text(yaml.safe_dump(conf))
        monkeypatch.setenv(
            "ACCELERATE_CONFIG_DS_FIELDS", _launch_env(acc, tmp_path / "train.py")["ACCELERATE_CONFIG_DS_FIELDS"]
        )
        with pytest.raises(ValueError, match="will be ignored"):
            DeepSpeedPlugin()
    finally:
        unset_hf_deepspeed_config()


def test_export_of_deepcompile_prints_who_calls_engine_compile(tmp_path, monkeypatch, capsys):
    """A deepcompile configuration (8 x H100, ZeRO-1): the JSON's compile section, and the lines saying who must call
    engine.compile(): the script after deepspeed.initialize, the Trainer only with torch_compile=True, accelerate
    with a dynamo backend, and never an accelerate config file's dynamo_config."""
    from autotune.cli import main

    _trials_dir(tmp_path, monkeypatch)
    make_study("dc", gpus="8xH100", autotp_size=1, deepcompile=True)
    out, acc = tmp_path / "ds.json", tmp_path / "accelerate.yaml"
    assert main(["export", "--study", "dc", "--out", str(out), "--accelerate-config", str(acc)]) == 0
    text = capsys.readouterr().out
    assert json.loads(out.read_text())["compile"] == {"deepcompile": True}
    assert "the JSON alone does not turn it on" in text
    assert "deepspeed.initialize(...), then engine.compile() before the first forward" in text
    assert "TrainingArguments(..., as above, torch_compile=True)" in text
    assert (
        "Without torch_compile=True (and no ACCELERATE_DYNAMO_BACKEND in the environment) the Trainer does not "
        "call it" in text
    )
    assert 'Accelerator(dynamo_backend="inductor")' in text
    assert "accelerate launch does not call it" in text and "the file written above has none" in text
    assert "# deepcompile: this file cannot turn it on" in acc.read_text()
    assert "dynamo" not in acc.read_text().split("in this file's folder\n")[1]  # no dynamo_config section
    capsys.readouterr()
    make_study("plain", gpus="8xH100", autotp_size=1)
    assert main(["export", "--study", "plain", "--out", str(out)]) == 0
    assert "DeepCompile" not in capsys.readouterr().out


def test_the_deepcompile_lines_against_transformers_and_accelerate(tmp_path, monkeypatch):
    """What the printed lines say, checked on the installed code without a GPU:
    - TrainingArguments(torch_compile=True) gives the TorchDynamoPlugin the Trainer builds (trainer.py) backend
      inductor, no regional compilation: accelerate's _prepare_deepspeed then calls engine.compile(backend="inductor"),
      a backend DeepCompile takes; without torch_compile the plugin's backend is "no" and nothing calls it.
    - `accelerate launch --config_file` with a dynamo_config section gives a DeepSpeed rank no ACCELERATE_DYNAMO_*
      variable (utils/launch.py prepare_deepspeed_cmd_env), so the file cannot turn DeepCompile on."""
    import yaml
    from accelerate.state import AcceleratorState
    from accelerate.utils import DynamoBackend, TorchDynamoPlugin
    from transformers import TrainingArguments

    from autotune.deepspeed_config import deepspeed_config
    from autotune.hardware import parse_gpus
    from autotune.models import resolve_model
    from autotune.report.export import accelerate_config_yaml
    from autotune.train_config import TrainConfig

    for k in [k for k in os.environ if k.startswith("ACCELERATE_DYNAMO_")]:
        monkeypatch.delenv(k)
    try:
        for compile_flag, backend in ((True, "inductor"), (False, None)):
            args = TrainingArguments(
                output_dir=str(tmp_path / "o"), torch_compile=compile_flag, use_cpu=True, report_to=[]
            )
            assert args.torch_compile_backend == backend
            plugin = TorchDynamoPlugin(
                backend=args.torch_compile_backend, mode=args.torch_compile_mode, dynamic=None
            )  # as trainer.py builds it
            assert (plugin.backend != DynamoBackend.NO) is compile_flag
            if compile_flag:
                assert plugin.to_kwargs()["backend"] == "inductor" and not plugin.use_regional_compilation
        monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "inductor")  # the environment route the lines name
        assert TorchDynamoPlugin(backend=None).to_kwargs()["backend"] == "inductor"
        monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND")
    finally:
        AcceleratorState._reset_state(True)

    cluster, cfg = parse_gpus("8xH100"), TrainConfig(zero_stage=1, deepcompile=True, seq_len=64)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(deepspeed_config(cfg, resolve_model(str(DATA / "hf-llama")), cluster)))
    acc = tmp_path / "accelerate.yaml"
    conf = yaml.safe_load(accelerate_config_yaml(cfg, cluster, ds, acc))
    conf["dynamo_config"] = {"dynamo_backend": "INDUCTOR"}
    acc.write_text(yaml.safe_dump(conf))
    monkeypatch.chdir(tmp_path)
    env = _launch_env(acc, tmp_path / "train.py")
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
    assert not [k for k in env if k.startswith("ACCELERATE_DYNAMO_")], env


@pytest.mark.slow
def test_trainer_trains_2_steps_with_the_exported_tp2_config(tmp_path, monkeypatch, capsys):
    """The done-when of issue 31's Export item: `autotune export` of a tp 2 trial (tiny random-init Llama,
    ZeRO-1 bf16, 2 CPU ranks), then the Hugging Face Trainer on 2 gloo ranks, started by `accelerate launch
    --config_file` with the exported YAML, trains 2 steps with that exact JSON and the TrainingArguments
    export prints; each rank holds the tp shards and both see equal, finite losses."""
    import math

    from autotune.cli import main

    _trials_dir(tmp_path, monkeypatch)
    make_study("tp")
    out, acc = tmp_path / "ds.json", tmp_path / "accelerate.yaml"
    assert main(["export", "--study", "tp", "--out", str(out), "--accelerate-config", str(acc)]) == 0
    text = capsys.readouterr().out
    assert "per_device_train_batch_size=2, gradient_accumulation_steps=1" in text
    from hf_trainer_run import printed_arguments

    from autotune.trial.launch import free_port

    printed = tmp_path / "args.json"
    printed.write_text(json.dumps(printed_arguments(text)))  # the ranks' TrainingArguments: what export printed

    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "LOCAL_SIZE": "2", "HF_HUB_OFFLINE": "1"}
    accelerate = Path(sys.executable).with_name("accelerate")
    cmd = [
        str(accelerate),
        "launch",
        "--config_file",
        str(acc),
        "--main_process_port",
        str(free_port()),
        __file__,
        str(DATA / "hf-llama"),
        str(out),
        str(tmp_path / "out"),
        str(printed),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    # each rank writes its record to a file (the two ranks' stdout interleaves)
    records = sorted((tmp_path / "out").glob("rank*.json"))
    assert run.returncode == 0 and len(records) == 2, run.stdout[-3000:] + run.stderr[-3000:]
    ranks = {r["rank"]: r for r in (json.loads(f.read_text()) for f in records)}
    assert sorted(ranks) == [0, 1]
    for r in ranks.values():
        assert r["world"] == 2 and r["steps"] == 2 and r["engine"] == "DeepSpeedEngine"
        assert len(r["losses"]) == 2 and all(math.isfinite(x) for x in r["losses"])
        assert all(abs(x - 7.62) < 0.3 for x in r["losses"])  # ~ln(2048): random init
        # the tp shards: q_proj (4 heads x 32) column-wise, the untied head V / tp x h
        assert r["shapes"] == {"model.layers.0.self_attn.q_proj.weight": [64, 128], "lm_head.weight": [1024, 128]}
        assert r["total_batch"] == 2  # micro 2 x dp 1 x grad accum 1
    assert ranks[0]["losses"] == ranks[1]["losses"]


def rank_main(config_dir: str, ds_path: str, out_dir: str, args_path: str) -> None:
    """One rank: the Trainer with the exported JSON and the TrainingArguments `autotune export` printed (ARGS_JSON)."""
    import torch
    from hf_trainer_run import (
        exit_rank,
        train_recording,
        trainer_args,
        write_rank,
    )  # a sibling: the script's folder is on sys.path
    from transformers import AutoConfig, AutoModelForCausalLM

    args = trainer_args(ds_path, out_dir, json.loads(Path(args_path).read_text()))
    import deepspeed.ops

    # As the trial worker does: skip compiling DeepSpeed's shared-memory comm op (not used by the JSON)
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    torch.manual_seed(0)  # the same random weights on both ranks, as from_pretrained would load
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    gen = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": ids, "labels": ids} for ids in torch.randint(0, model.config.vocab_size, (8, 64), generator=gen)
    ]
    trainer, result, losses = train_recording(model, args, data)
    shapes = {
        n: list(p.shape)
        for n, p in trainer.model_wrapped.module.named_parameters()
        if n in ("model.layers.0.self_attn.q_proj.weight", "lm_head.weight")
    }
    write_rank(out_dir, args, trainer, result, losses, engine=type(trainer.model_wrapped).__name__, shapes=shapes)
    exit_rank()


if __name__ == "__main__":
    rank_main(*sys.argv[1:5])
