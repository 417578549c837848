"""`autotune export` of a Ulysses sequence-parallel configuration: the JSON's sequence_parallel_size, the
ParallelismConfig lines printed for the Hugging Face Trainer (built here by the installed accelerate), the
`--accelerate-config` file's parallelism_config section, read by accelerate's own loader and launch code, and the
Trainer training 2 steps at sp 2 on 2 CPU ranks with them (docs/parallelism.md, "Export").

Run as a script, this file is one rank of that training:

    accelerate launch --config_file ACCELERATE.yaml tests/test_export_sp.py CONFIG_DIR DS_JSON CODE_FILE OUT_DIR ARGS_JSON

CODE_FILE holds the ParallelismConfig lines export printed, ARGS_JSON the TrainingArguments it printed; the rank
writes OUT_DIR/rank<r>.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_export_parallel import DATA, _trials_dir, make_study  # the tiny Llama study (4 heads, 2 KV heads)

SP2 = dict(autotp_size=1, sequence_parallel_size=2, zero_stage=1, seq_len=64)


def _printed_code(text: str) -> str:
    """The ParallelismConfig lines export printed (indented by two spaces), as Python source."""
    lines = [
        line[2:]
        for line in text.splitlines()
        if line.startswith(("  from accelerate.utils import", "  parallelism_config = ParallelismConfig("))
    ]
    assert len(lines) == 2, text
    return "\n".join(lines)


def test_export_prints_a_parallelism_config_that_accelerate_builds(tmp_path, monkeypatch, capsys):
    from accelerate.utils import DeepSpeedSequenceParallelConfig, ParallelismConfig

    from autotune.cli import main
    from autotune.deepspeed_config import deepspeed_config

    _trials_dir(tmp_path, monkeypatch)
    model, cluster, cfg = make_study("sp", gpus="4xcpu", **SP2)
    out = tmp_path / "ds.json"
    assert main(["export", "--study", "sp", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    ds = json.loads(out.read_text())
    assert ds == deepspeed_config(cfg, model, cluster, style="trainer") and ds["sequence_parallel_size"] == 2
    assert "Ulysses 2, dp = 4 / 2 = 2" in text and "parallelism_config=parallelism_config" in text
    assert "= 2 x 2 x 1 = 4 sequences of 64 tokens" in text and "position_ids" in text
    scope: dict = {}
    exec(_printed_code(text), scope)  # the installed accelerate (1.16) builds it
    pc = scope["parallelism_config"]
    assert isinstance(pc, ParallelismConfig) and isinstance(pc.sp_handler, DeepSpeedSequenceParallelConfig)
    assert (pc.sp_backend, pc.sp_size, pc.dp_shard_size, pc.sp_enabled) == ("deepspeed", 2, 2, True)
    assert pc.data_parallel_size * pc.sp_size == 4  # what accelerate's batch rewrite uses
    h = pc.sp_handler
    assert (h.sp_seq_length, h.sp_seq_length_is_variable, h.sp_attn_implementation) == (None, True, "sdpa")
    assert pc.build_device_mesh("cpu") is None  # DeepSpeed makes its own groups
    assert "Tensor parallelism" not in text


def test_export_without_sp_prints_no_parallelism_config(tmp_path, monkeypatch, capsys):
    from autotune.cli import main

    _trials_dir(tmp_path, monkeypatch)
    make_study("dp", autotp_size=1)
    out, acc = tmp_path / "ds.json", tmp_path / "a.yaml"
    assert main(["export", "--study", "dp", "--out", str(out), "--accelerate-config", str(acc)]) == 0
    assert "ParallelismConfig" not in capsys.readouterr().out and "parallelism_config" not in acc.read_text()
    assert "sequence_parallel_size" not in json.loads(out.read_text())


def test_accelerate_reads_the_files_parallelism_config(tmp_path, monkeypatch, capsys):
    """The YAML's parallelism_config section, as accelerate's loader reads it and as `accelerate launch` passes it
    to a rank (commands/launch.py _validate_launch_command, utils/launch.py prepare_deepspeed_cmd_env); in that
    environment Accelerator's own ParallelismConfig() (what it builds without one) is the printed one."""
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    from autotune.cli import main

    _trials_dir(tmp_path, monkeypatch)
    make_study("sp", gpus="4xcpu", **SP2)
    out, acc = tmp_path / "ds.json", tmp_path / "accelerate.yaml"
    assert main(["export", "--study", "sp", "--out", str(out), "--accelerate-config", str(acc)]) == 0
    text = capsys.readouterr().out
    conf = load_config_from_file(str(acc))
    assert isinstance(conf, ClusterConfig)
    p = "parallelism_config_"
    assert conf.parallelism_config == {
        p + "sp_backend": "deepspeed",
        p + "sp_size": 2,
        p + "dp_shard_size": 2,
        p + "sp_seq_length_is_variable": True,
        p + "sp_attn_implementation": "sdpa",
    }
    args = launch_command_parser().parse_args(["--config_file", str(acc), "--main_process_port", "0", "train.py"])
    args, defaults, mp_from_config_flag = _validate_launch_command(args)
    assert args.use_deepspeed and args.use_parallelism_config
    args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
    _, env = prepare_deepspeed_cmd_env(args)
    assert env["ACCELERATE_USE_PARALLELISM_CONFIG"] == "true" and env["PARALLELISM_CONFIG_SP_SIZE"] == "2"
    for k, v in env.items():
        if k.startswith(("PARALLELISM_CONFIG_", "ACCELERATE_USE_PARALLELISM_CONFIG")):
            monkeypatch.setenv(k, v)
    from_env = ParallelismConfig()
    scope: dict = {}
    exec(_printed_code(text), scope)
    printed = scope["parallelism_config"]
    for name in ("sp_backend", "sp_size", "dp_shard_size", "dp_replicate_size", "tp_size", "cp_size"):
        assert getattr(from_env, name) == getattr(printed, name), name
    assert vars(from_env.sp_handler) == vars(printed.sp_handler)


@pytest.mark.parametrize("sp, gpus, dp", [(2, "2xcpu", 1), (4, "8xH100", 2)])
def test_yaml_counts_data_parallel_ranks(tmp_path, sp, gpus, dp):
    import yaml

    from autotune.hardware import parse_gpus
    from autotune.report.export import accelerate_config_yaml
    from autotune.train_config import TrainConfig

    cfg = TrainConfig(sequence_parallel_size=sp, zero_stage=3, seq_len=4096)
    conf = yaml.safe_load(accelerate_config_yaml(cfg, parse_gpus(gpus), tmp_path / "ds.json", tmp_path / "a.yaml"))
    assert conf["parallelism_config"]["parallelism_config_dp_shard_size"] == dp
    assert conf["parallelism_config"]["parallelism_config_sp_size"] == sp


@pytest.mark.slow
@pytest.mark.parametrize(
    "json_as",
    [
        # deepspeed_config leaves train_batch_size out under sp, as for tp (the Trainer's fill_match wanted world x micro
        # x accum: 'ds train_batch_size=2 vs hf train_batch_size (calculated)=4'), so the exported JSON trains as it is
        "exported",
        "without train_batch_size",
    ],
)
def test_trainer_trains_2_steps_at_sp2_with_the_export(tmp_path, monkeypatch, capsys, json_as):
    """`autotune export --accelerate-config` of an sp 2 trial (tiny Llama, ZeRO-1 bf16, 2 CPU ranks, dp 1), then
    `accelerate launch --config_file` with that file starts the Hugging Face Trainer with the printed
    ParallelismConfig: accelerate registers Ulysses and cuts each batch along the sequence, and both ranks report
    the group's token-weighted loss (equal on both) for 2 steps of a total batch of 2 sequences."""
    import math

    from autotune.cli import main
    from autotune.trial.launch import free_port

    _trials_dir(tmp_path, monkeypatch)
    make_study("sp", **SP2)
    out, acc = tmp_path / "ds.json", tmp_path / "accelerate.yaml"
    assert main(["export", "--study", "sp", "--out", str(out), "--accelerate-config", str(acc)]) == 0
    from hf_trainer_run import printed_arguments

    text = capsys.readouterr().out
    code, printed = tmp_path / "pc.py", tmp_path / "args.json"
    code.write_text(_printed_code(text))
    printed.write_text(json.dumps(printed_arguments(text)))
    if json_as != "exported":
        ds = json.loads(out.read_text())
        ds.pop("train_batch_size", None)
        out.write_text(json.dumps(ds))
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
        str(code),
        str(tmp_path / "out"),
        str(printed),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    records = sorted((tmp_path / "out").glob("rank*.json"))
    assert run.returncode == 0 and len(records) == 2, run.stdout[-3000:] + run.stderr[-3000:]
    ranks = {r["rank"]: r for r in (json.loads(f.read_text()) for f in records)}
    for r in ranks.values():
        assert r["world"] == 2 and r["steps"] == 2 and r["sp"] == 2
        assert len(r["losses"]) == 2 and all(math.isfinite(x) and abs(x - 7.62) < 0.3 for x in r["losses"])
        assert r["total_batch"] == 2 and r["ds_train_batch"] == 2  # micro 2 x dp 1 x grad accum 1
    assert ranks[0]["losses"] == ranks[1]["losses"]


def rank_main(config_dir: str, ds_path: str, code_path: str, out_dir: str, args_path: str) -> None:
    """One rank: the Trainer with the exported JSON, the TrainingArguments export prints and the printed
    ParallelismConfig."""
    import torch
    from hf_trainer_run import (
        exit_rank,
        train_recording,
        trainer_args,
        write_rank,
    )  # a sibling: the script's folder is on sys.path
    from transformers import AutoConfig, AutoModelForCausalLM

    scope: dict = {}
    exec(Path(code_path).read_text(), scope)
    args = trainer_args(ds_path, out_dir, json.loads(Path(args_path).read_text()))
    args.parallelism_config = scope["parallelism_config"]
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as the trial worker does
    # On CPU accelerate joins torch.distributed but not DeepSpeed's comm, which register_with_transformers
    # asserts (parallel_state_sp.initialize_sequence_parallel); on GPUs accelerate's DeepSpeed state does it
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), attn_implementation="sdpa")
    gen = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": ids, "labels": ids, "position_ids": torch.arange(ids.shape[0])}  # Ulysses needs them
        for ids in torch.randint(0, model.config.vocab_size, (16, 64), generator=gen)
    ]
    trainer, result, losses = train_recording(model, args, data)
    write_rank(
        out_dir,
        args,
        trainer,
        result,
        losses,
        sp=trainer.get_sp_size(),
        ds_train_batch=trainer.accelerator.deepspeed_config.get("train_batch_size"),
    )
    exit_rank()


if __name__ == "__main__":
    rank_main(*sys.argv[1:6])
