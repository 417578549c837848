"""An export that drops in (issue 50, part 3): the Hugging Face Trainer's JSON ("auto" where the Trainer fills the
value, the tuned keys numbers), `--into` a user's own DeepSpeed config (only the tuned keys change, listed),
`--concrete` for a plain deepspeed.initialize loop, DeepSpeed's progress log at its default, and the accelerate YAML
naming the JSON by a path relative to its own folder. The Trainer and DeepSpeed themselves judge every file: in
process (transformers' HfTrainerDeepSpeedConfig, the check that refused the old export) and trained on 2 CPU ranks.

Run as a script, this file is one rank of that training:

    accelerate launch --config_file ACCELERATE.yaml tests/test_export_dropin.py trainer CONFIG_DIR ARGS_JSON OUT_DIR
    python -m torch.distributed.run --nproc_per_node 2 tests/test_export_dropin.py plain CONFIG_DIR OUT_DIR DS_JSON...

and writes OUT_DIR/rank<r>.json (the Trainer) or OUT_DIR/plain<r>.json (the plain loop, one record per JSON).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_export_parallel import DATA, _trials_dir, make_study  # one measured trial of the tiny Llama

# the winner of the studies here: ZeRO-2 bf16, micro batch 2, grad accum 2, no tp (2 CPU ranks, dp 2)
WIN = dict(autotp_size=1, zero_stage=2, precision="bf16", micro_batch=2, grad_accum=2, seq_len=64)

# Hugging Face's own ZeRO-3 example config (transformers docs, "DeepSpeed" > "ZeRO-3 example"), as users copy it
HF_ZERO3 = {
    "fp16": {
        "enabled": "auto",
        "loss_scale": 0,
        "loss_scale_window": 1000,
        "initial_scale_power": 16,
        "hysteresis": 2,
        "min_loss_scale": 1,
    },
    "bf16": {"enabled": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
    },
    "scheduler": {
        "type": "WarmupLR",
        "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}

# a plain DeepSpeed user's config: numbers everywhere, its own lr, weight decay and clipping, ZeRO-3 with offload
PLAIN_USER = {
    "train_batch_size": 64,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "weight_decay": 0.01}},
    "gradient_clipping": 0.5,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "stage3_max_live_parameters": 1e8},
    "fp16": {"enabled": True},
    "steps_per_print": 5,
    "comms_logger": {"enabled": False},
}


@pytest.fixture
def study(tmp_path, monkeypatch):
    _trials_dir(tmp_path, monkeypatch)
    return make_study("win", **WIN)


@pytest.fixture
def hf_state():
    """TrainingArguments(deepspeed=...) in this process: transformers keeps its config in a module global and
    accelerate its state; both are cleared after the test."""
    yield
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(True)


def _export(capsys, *args: str) -> str:
    from autotune.cli import main

    assert main(["export", "--study", "win", *args]) == 0
    return capsys.readouterr().out


def _trainer_checks(ds_path: Path, printed: dict, **own):
    """What the Trainer does with the JSON before training, in this process: TrainingArguments runs
    HfTrainerDeepSpeedConfig.trainer_config_process, and trainer_config_finalize (the model's hidden size, the
    step count) raises on any mismatch. Returns the config as the Trainer hands it to DeepSpeed."""
    from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments

    args = TrainingArguments(
        **{**printed, "deepspeed": str(ds_path)},
        output_dir=str(ds_path.parent / "o"),
        use_cpu=True,
        report_to=[],
        **own,
    )
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DATA / "hf-llama"))
    args.hf_deepspeed_config.trainer_config_finalize(args, model, 2)
    return args.hf_deepspeed_config.config


def test_styles_of_the_one_function(study):
    """deepspeed_config(style="trainer") is the concrete JSON with "auto" at exactly TRAINER_AUTO; the concrete one is
    what the trials run; neither sets steps_per_print (DeepSpeed's own default: no progress line in 0.19.8)."""
    from deepspeed.runtime.constants import STEPS_PER_PRINT_DEFAULT

    from autotune.deepspeed_config import TRAINER_AUTO, deepspeed_config, leaves

    model, cluster, cfg = study
    concrete = deepspeed_config(cfg, model, cluster)
    trainer = deepspeed_config(cfg, model, cluster, style="trainer")
    assert concrete == deepspeed_config(cfg, model, cluster, style="concrete")
    c, t = leaves(concrete), leaves(trainer)
    assert c.keys() == t.keys()
    autos = {p for p, v in t.items() if v == "auto"}
    assert autos == set(TRAINER_AUTO)  # all eight present at dp: batch sizes, clipping, four optimizer values
    assert all(t[p] == c[p] for p in c if p not in autos)  # ZeRO, buckets, precision, optimizer type: numbers
    assert c["optimizer.params.lr"] == 3e-4 and c["train_micro_batch_size_per_gpu"] == 2
    assert "steps_per_print" not in concrete and "steps_per_print" not in trainer
    assert STEPS_PER_PRINT_DEFAULT is None  # what DeepSpeed then does: no progress line (runtime/engine.py)
    with pytest.raises(ValueError, match="style"):
        deepspeed_config(cfg, model, cluster, style="auto")
    tp = make_study("tp2", autotp_size=2)  # tp: no train_batch_size in either style (DeepSpeed derives it)
    assert "train_batch_size" not in deepspeed_config(tp[2], tp[0], tp[1], style="trainer")


def test_trainer_accepts_the_export_with_its_own_hyperparameters(study, tmp_path, capsys, hf_state):
    """The done-when's TrainingArguments(learning_rate=1e-5, weight_decay=0.0) with the printed arguments and the
    export: the Trainer fills in its own values and keeps the tuned ones. The old export (lr 3e-4, betas, eps and
    weight decay fixed) was refused here with a list of mismatches; the concrete file still is."""
    from hf_trainer_run import printed_arguments

    out = tmp_path / "ds.json"
    text = _export(capsys, "--out", str(out))
    printed = printed_arguments(text)
    # only what autotune tuned: no hyperparameter
    assert printed == {
        "deepspeed": str(out),
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "gradient_checkpointing": False,
        "bf16": True,
    }
    assert "--concrete" in text and "no scheduler section, so the Trainer's own runs" in text  # which file, which loop
    ds = _trainer_checks(out, printed, learning_rate=1e-5, weight_decay=0.0)
    assert ds["optimizer"]["params"] == {
        "lr": 1e-5,
        "betas": [0.9, 0.999],  # the Trainer's defaults, not autotune's 0.95
        "eps": 1e-8,
        "weight_decay": 0.0,
        "torch_adam": True,
    }
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (2, 2)
    assert ds["zero_optimization"]["stage"] == 2 and ds["bf16"] == {"enabled": True}
    concrete = tmp_path / "concrete.json"
    text = _export(capsys, "--out", str(concrete), "--concrete")
    assert "learning_rate=0.0003" in text  # the Trainer would need autotune's values with it
    with pytest.raises(ValueError, match="ds optimizer.params.lr=0.0003 vs hf learning_rate=1e-05"):
        _trainer_checks(concrete, printed, learning_rate=1e-5, weight_decay=0.0)


def test_into_keeps_hf_example_config_and_the_trainer_accepts_it(study, tmp_path, capsys, hf_state):
    """`--into` Hugging Face's ZeRO-3 example: the tuned keys change (stage 3 -> 2, offload removed since the winner
    runs without it, fp16 switched off), the user's other keys stay (scheduler, sub_group_size, steps_per_print,
    the stage-3 save flag), each change is listed old -> new; the Trainer then accepts it with its own lr."""
    from hf_trainer_run import printed_arguments

    mine = tmp_path / "my_ds_config.json"
    mine.write_text(json.dumps(HF_ZERO3, indent=2))
    text = _export(capsys, "--into", str(mine))
    got = json.loads(mine.read_text())  # in place
    z = got["zero_optimization"]
    assert z["stage"] == 2 and "offload_optimizer" not in z and "offload_param" not in z
    assert not any(k.startswith("stage3_") and k != "stage3_gather_16bit_weights_on_model_save" for k in z)
    assert z["sub_group_size"] == 1e9 and z["stage3_gather_16bit_weights_on_model_save"] is True  # the user's
    assert z["reduce_bucket_size"] == 128 * 128 and z["overlap_comm"] is False  # tuned (hidden^2; the trial's)
    assert got["scheduler"] == HF_ZERO3["scheduler"] and got["steps_per_print"] == 2000
    assert got["fp16"] == {**HF_ZERO3["fp16"], "enabled": False} and got["bf16"] == {"enabled": True}
    assert got["optimizer"]["params"] == {**HF_ZERO3["optimizer"]["params"], "torch_adam": True}
    assert got["train_micro_batch_size_per_gpu"] == "auto" and got["gradient_accumulation_steps"] == "auto"
    assert f"--into {mine}: your config kept, updated in place" in text
    assert "  zero_optimization.stage: 3 -> 2" in text
    assert '  zero_optimization.offload_optimizer.device: "cpu" -> (absent)  (removed: the tuned configuration ' in text
    assert '  fp16.enabled: "auto" -> false  (switched off: the tuned configuration runs bf16)' in text
    assert '  bf16.enabled: "auto" -> true' in text
    assert "zero_optimization.stage3_max_live_parameters: 1000000000.0 -> (absent)" in text
    assert "scheduler" not in text.split("kept as you wrote them")[0]  # listed as kept, not changed
    assert "no scheduler section" not in text  # the user's WarmupLR runs
    ds = _trainer_checks(
        mine, printed_arguments(text), learning_rate=1e-5, weight_decay=0.0, warmup_steps=1, max_steps=2
    )
    assert ds["scheduler"]["params"] == {"warmup_min_lr": 0, "warmup_max_lr": 1e-5, "warmup_num_steps": 1}
    assert ds["optimizer"]["params"]["lr"] == 1e-5 and ds["train_micro_batch_size_per_gpu"] == 2


def test_into_conflicts_and_bad_input(study, tmp_path, capsys):
    """The rules at the edges: `--out` leaves the user's file alone; a user's optimizer of another type gives way to
    the AdamW the trials measured (its lr kept); an offload the winner has is added; a user's fixed lr is named
    with the TrainingArguments the Trainer then demands; `--concrete` resolves "auto" hyperparameters with autotune's
    values and refuses any other "auto" it has no value for; a missing, non-JSON or non-object file is exit 2."""
    from autotune.cli import main

    mine = tmp_path / "mine.json"
    user = {"optimizer": {"type": "Lion", "params": {"lr": 1e-4, "betas": [0.9, 0.99], "use_triton": True}}}
    mine.write_text(json.dumps(user))
    out = tmp_path / "merged.json"
    text = _export(capsys, "--into", str(mine), "--out", str(out))
    assert json.loads(mine.read_text()) == user and f"written to {out}, {mine} untouched" in text
    got = json.loads(out.read_text())
    assert got["optimizer"]["type"] == "AdamW" and got["optimizer"]["params"]["lr"] == 1e-4
    assert got["optimizer"]["params"]["betas"] == [0.9, 0.99] and "use_triton" not in got["optimizer"]["params"]
    assert '  optimizer.type: "Lion" -> "AdamW"  (the trials measured AdamW' in text
    assert "Your config fixes optimizer.params.lr=0.0001, optimizer.params.betas=[0.9, 0.99]" in text
    assert "pass learning_rate=0.0001, adam_beta1=0.9, adam_beta2=0.99," in text

    make_study("off", **{**WIN, "zero_stage": 3, "offload_optimizer": True})
    mine.write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": "auto"}))
    assert main(["export", "--study", "off", "--into", str(mine), "--out", str(out), "--concrete"]) == 0
    got = json.loads(out.read_text())
    assert got["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert got["gradient_clipping"] == 1.0  # "auto" is not DeepSpeed's: autotune's value
    assert 'gradient_clipping: "auto" -> 1.0  (DeepSpeed resolves no "auto"' in capsys.readouterr().out

    mine.write_text(json.dumps(HF_ZERO3))  # its scheduler's "auto" values: only the Trainer has them
    assert main(["export", "--study", "win", "--into", str(mine), "--out", str(out), "--concrete"]) == 2
    err = capsys.readouterr().err
    assert 'DeepSpeed resolves no "auto"' in err and "scheduler.params.warmup_max_lr" in err
    for bad, why in (("[1, 2]", "a JSON object, not list"), ("{oops", "not JSON"), (None, "no such file")):
        path = tmp_path / "bad.json"
        path.unlink(missing_ok=True)
        if bad is not None:
            path.write_text(bad)
        assert main(["export", "--study", "win", "--into", str(path)]) == 2
        assert why in capsys.readouterr().err
    assert main(["export", "--study", "win"]) == 2 and "--out FILE, or --into" in capsys.readouterr().err


def test_yaml_names_the_json_relative_to_its_folder(study, tmp_path, capsys, monkeypatch):
    """The YAML names the JSON relative to its own folder, and `accelerate launch` passes that string on as it is
    (the rank opens it from the launch's working directory): from the YAML's folder it is found after both files
    moved together, which an absolute path would not be."""
    from accelerate.commands.config.config_args import load_config_from_file
    from test_export_parallel import _launch_env

    from autotune.report.export import json_path_for_yaml

    (tmp_path / "a").mkdir()
    out, acc = tmp_path / "a" / "conf" / "ds.json", tmp_path / "a" / "accelerate.yaml"
    text = _export(capsys, "--out", str(out), "--accelerate-config", str(acc))
    assert load_config_from_file(str(acc)).deepspeed_config["deepspeed_config_file"] == "conf/ds.json"
    assert f"accelerate launch --config_file {acc} train.py, in {acc.parent}" in text
    shutil.move(tmp_path / "a", tmp_path / "b")
    monkeypatch.chdir(tmp_path / "b")
    env = _launch_env(Path("accelerate.yaml"), Path("train.py"))
    assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == "conf/ds.json"
    assert json.loads(Path(env["ACCELERATE_DEEPSPEED_CONFIG_FILE"]).read_text())["zero_optimization"]["stage"] == 2
    assert json_path_for_yaml(tmp_path / "ds.json", tmp_path / "y" / "a.yaml") == "../ds.json"


def _ranks(out_dir: Path, prefix: str, run) -> dict:
    records = sorted(out_dir.glob(f"{prefix}*.json"))
    assert run.returncode == 0 and len(records) == 2, run.stdout[-3000:] + run.stderr[-3000:]
    return {r["rank"]: r for r in (json.loads(f.read_text()) for f in records)}


# the loss of a randomly initialised model on random tokens: ln(vocab size) of the tiny Llama
LN_VOCAB = math.log(json.loads((DATA / "hf-llama" / "config.json").read_text())["vocab_size"])
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "LOCAL_SIZE": "2", "HF_HUB_OFFLINE": "1"}


@pytest.mark.slow
def test_trainer_trains_2_steps_with_its_own_lr_and_the_moved_export(study, tmp_path, capsys):
    """The done-when: `autotune export --accelerate-config`, both files moved together to another folder, then
    `accelerate launch --config_file` there starts the Hugging Face Trainer on 2 CPU ranks with
    TrainingArguments(learning_rate=1e-5, weight_decay=0.0) and the printed arguments, no deepspeed= (the JSON the
    YAML names): 2 steps of grad accum 2, trained with the Trainer's lr, weight decay and betas. The old export
    fails here twice over: its lr 3e-4 (and betas, eps, weight decay) are refused by the Trainer, and its absolute
    path no longer exists after the move."""
    from hf_trainer_run import printed_arguments

    from autotune.trial.launch import free_port

    a = tmp_path / "a"
    a.mkdir()
    text = _export(capsys, "--out", str(a / "ds.json"), "--accelerate-config", str(a / "accelerate.yaml"))
    printed = printed_arguments(text)
    del printed["deepspeed"]  # the Trainer takes the JSON accelerate launch names
    (a / "args.json").write_text(json.dumps(printed))
    shutil.move(a, tmp_path / "b")
    b = tmp_path / "b"
    cmd = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file", "accelerate.yaml"]
    cmd += ["--main_process_port", str(free_port()), __file__, "trainer", str(DATA / "hf-llama"), "args.json", "out"]
    run = subprocess.run(cmd, env={**os.environ, **ENV}, cwd=b, capture_output=True, text=True, timeout=300)
    ranks = _ranks(b / "out", "rank", run)
    for r in ranks.values():
        assert r["world"] == 2 and r["steps"] == 2 and r["json"] == "ds.json"
        # each micro step's loss is its tokens' summed loss over the tokens of the whole grad accum window of all
        # ranks, times the ranks (transformers trainer.py _get_num_items_in_batch, compute_loss): ln(vocab) / accum
        assert len(r["losses"]) == 4 and all(math.isfinite(x) and abs(2 * x - LN_VOCAB) < 0.3 for x in r["losses"])
        assert r["total_batch"] == 8  # micro 2 x dp 2 x grad accum 2
        assert (r["micro"], r["accum"], r["clip"], r["stage"]) == (2, 2, 1.0, 2)
        for g in r["groups"]:  # the optimizer DeepSpeed built, with the Trainer's values
            assert g["initial_lr"] == 1e-5 and g["weight_decay"] == 0.0 and g["betas"] == [0.9, 0.999]


@pytest.mark.slow
def test_plain_deepspeed_loop_trains_the_concrete_export_and_into(study, tmp_path, capsys):
    """`--concrete` (numbers) and `--into` a plain DeepSpeed user's config with `--concrete`, each trained 2 steps by
    a plain deepspeed.initialize loop on 2 CPU ranks: the first with autotune's values and DeepSpeed's default
    progress log (no steps_per_print), the second with the user's lr, weight decay, clipping and steps_per_print,
    and the tuned batch, stage and precision (the user's offload and fp16 gone)."""
    from autotune.trial.launch import free_port

    plain, mine, merged = tmp_path / "plain.json", tmp_path / "mine.json", tmp_path / "merged.json"
    _export(capsys, "--out", str(plain), "--concrete")
    mine.write_text(json.dumps(PLAIN_USER))
    text = _export(capsys, "--into", str(mine), "--out", str(merged), "--concrete")
    assert "  train_batch_size: 64 -> 8" in text and "  gradient_accumulation_steps: 4 -> 2" in text
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    cmd += [__file__, "plain", str(DATA / "hf-llama"), str(tmp_path / "out"), str(plain), str(merged)]
    run = subprocess.run(cmd, env={**os.environ, **ENV}, capture_output=True, text=True, timeout=300)
    ranks = _ranks(tmp_path / "out", "plain", run)
    for r in ranks.values():
        ours, theirs = r["runs"]
        for x in (ours, theirs):
            assert x["global_steps"] == 2 and (x["micro"], x["accum"], x["stage"]) == (2, 2, 2)
            assert x["bf16"] and not x["fp16"] and not x["offload"]
            assert len(x["losses"]) == 4 and all(math.isfinite(v) and abs(v - LN_VOCAB) < 0.3 for v in x["losses"])
        assert ours["steps_per_print"] is None  # DeepSpeed's default: no progress line
        assert (ours["clip"], ours["lr"], ours["weight_decay"], ours["betas"]) == (1.0, 3e-4, 0.1, [0.9, 0.95])
        assert theirs["steps_per_print"] == 5  # the user's own
        assert (theirs["clip"], theirs["lr"], theirs["weight_decay"]) == (0.5, 2e-5, 0.01)


def trainer_rank(config_dir: str, args_path: str, out_dir: str) -> None:
    """One rank of the Trainer run: the printed arguments, the script's own lr and weight decay, and the JSON that
    accelerate launch names (TrainingArguments without deepspeed=)."""
    import torch
    from hf_trainer_run import exit_rank, train_recording, trainer_args, write_rank
    from transformers import AutoConfig, AutoModelForCausalLM

    ds_path = os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"]  # as the YAML names it, opened from here
    printed = json.loads(Path(args_path).read_text())
    args = trainer_args(ds_path, out_dir, printed, deepspeed=None, learning_rate=1e-5, weight_decay=0.0)
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as the trial worker does
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    gen = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": ids, "labels": ids} for ids in torch.randint(0, model.config.vocab_size, (32, 64), generator=gen)
    ]
    trainer, result, losses = train_recording(model, args, data)
    engine = trainer.model_wrapped
    groups = [
        {"initial_lr": g.get("initial_lr"), "weight_decay": g["weight_decay"], "betas": list(g["betas"])}
        for g in engine.optimizer.param_groups
    ]
    write_rank(
        out_dir,
        args,
        trainer,
        result,
        losses,
        json=ds_path,
        groups=groups,
        micro=engine.train_micro_batch_size_per_gpu(),
        accum=engine.gradient_accumulation_steps(),
        clip=engine.gradient_clipping(),
        stage=engine.zero_optimization_stage(),
    )
    exit_rank()


def plain_rank(config_dir: str, out_dir: str, *ds_paths: str) -> None:
    """One rank of the plain loop: for each JSON, deepspeed.initialize and 2 optimizer steps, nothing else."""
    import deepspeed
    import deepspeed.ops
    import torch
    from hf_trainer_run import exit_rank
    from transformers import AutoConfig, AutoModelForCausalLM

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as the trial worker does
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank = torch.distributed.get_rank()
    runs = []
    for path in ds_paths:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=path)
        gen = torch.Generator().manual_seed(rank)
        losses = []
        for _ in range(2 * engine.gradient_accumulation_steps()):
            ids = torch.randint(
                0, model.config.vocab_size, (engine.train_micro_batch_size_per_gpu(), 64), generator=gen
            )
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.float().item())
        group = engine.optimizer.param_groups[0]
        runs.append(
            {
                "global_steps": engine.global_steps,
                "micro": engine.train_micro_batch_size_per_gpu(),
                "accum": engine.gradient_accumulation_steps(),
                "stage": engine.zero_optimization_stage(),
                "bf16": engine.bfloat16_enabled(),
                "fp16": engine.fp16_enabled(),
                "offload": bool(engine.zero_offload_optimizer()),
                "steps_per_print": engine.steps_per_print(),
                "clip": engine.gradient_clipping(),
                "lr": group["lr"],
                "weight_decay": group["weight_decay"],
                "betas": list(group["betas"]),
                "losses": losses,
            }
        )
        engine.destroy()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"plain{rank}.json").write_text(json.dumps({"rank": rank, "runs": runs}))
    exit_rank()


if __name__ == "__main__":
    {"trainer": trainer_rank, "plain": plain_rank}[sys.argv[1]](*sys.argv[2:])
