"""One rank of `test_trainer_runs_the_exported_json` (tests/test_hf.py), started by torch.distributed.run:
the Hugging Face Trainer trains a tiny Llama for 2 steps with a DeepSpeed JSON of numbers (deepspeed_config's
concrete style, what the trials run: the arguments repeat its values) and checkpointing of the first k layers by
autotune.impl.hf.

    python -m torch.distributed.run --nproc_per_node 2 tests/hf_trainer_run.py CONFIG_DIR DS_JSON K OUT_DIR
"""

import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

from autotune.impl.hf import checkpoint_first_layers, decoder_layers


def printed_arguments(text: str) -> dict:
    """The keyword arguments of the `TrainingArguments(deepspeed=..., ...)` line `autotune export` printed, evaluated
    as the Python it is (the first such line: the one for the file written)."""
    line = next(x.strip() for x in text.splitlines() if x.strip().startswith("TrainingArguments(deepspeed="))
    return eval(line, {"__builtins__": {}, "TrainingArguments": dict})


def trainer_args(
    ds_path: str, out_dir: str, printed: dict | None = None, max_steps: int = 2, checkpoint_all: bool = False, **own
) -> TrainingArguments:
    """TrainingArguments for `max_steps` logged CPU steps with the JSON at `ds_path` (also the export tests' ranks and
    benchmarks/user_loops.py; `checkpoint_all`: the gradient_checkpointing=True export prints when every layer is
    checkpointed):
    `printed`, the arguments `autotune export` printed for it (printed_arguments), else, for a JSON of numbers
    (deepspeed_config's concrete style), its batch sizes and precision; then the values the JSON fixes, repeated as
    the Trainer demands (fixed_for_trainer), and `own`, the script's own (learning_rate=..., deepspeed=None to take
    the JSON accelerate launch names)."""
    from autotune.report.export import fixed_for_trainer

    ds = json.loads(open(ds_path).read())
    if printed is None:
        printed = {
            "per_device_train_batch_size": ds["train_micro_batch_size_per_gpu"],
            "gradient_accumulation_steps": ds["gradient_accumulation_steps"],
            "bf16": ds.get("bf16", {}).get("enabled", False),
        }
    return TrainingArguments(
        **{
            **printed,
            **fixed_for_trainer(ds)[1],
            "output_dir": out_dir,
            "deepspeed": ds_path,
            "max_steps": max_steps,
            "gradient_checkpointing": checkpoint_all,
            "logging_steps": 1,
            "save_strategy": "no",
            "report_to": [],
            "use_cpu": True,
            "disable_tqdm": True,
            **own,
        }
    )


def train_recording(model, args: TrainingArguments, data: list) -> tuple[Trainer, object, list[float]]:
    """Train with the Trainer and keep each rank's own loss of each micro step (the Trainer logs only
    the mean over ranks): (trainer, train()'s result, losses). Used by the export tests' ranks."""
    losses: list[float] = []

    class RecordingTrainer(Trainer):
        def compute_loss(self, *a, **k):
            res = super().compute_loss(*a, **k)
            losses.append((res[0] if isinstance(res, tuple) else res).detach().float().item())
            return res

    trainer = RecordingTrainer(model=model, args=args, train_dataset=data)
    return trainer, trainer.train(), losses


def write_rank(out_dir: str, args: TrainingArguments, trainer: Trainer, result, losses: list[float], **extra) -> None:
    """OUT_DIR/rank<i>.json: what the export tests compare between ranks."""
    from pathlib import Path

    Path(out_dir).mkdir(parents=True, exist_ok=True)
    (Path(out_dir) / f"rank{args.process_index}.json").write_text(
        json.dumps(
            {
                "rank": args.process_index,
                "world": args.world_size,
                "steps": result.global_step,
                "losses": losses,
                "total_batch": trainer.get_total_train_batch_size(args),
                **extra,
            }
        )
    )


def exit_rank() -> None:
    """End an export test's rank once its record is written: the ranks wait for each other, then leave without the
    interpreter's teardown. In that teardown, after training had finished and the records were written, a rank
    aborted now and then on a loaded 2-core machine ("terminate called without an active exception", SIGABRT:
    threads of the process group still joinable at exit), and the launch failed although nothing under test had."""
    import os

    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(config_dir: str, ds_path: str, k: int, out_dir: str) -> None:
    # Before the model: with ZeRO-3 in the JSON, TrainingArguments keeps the HfDeepSpeedConfig that
    # makes from_config build under deepspeed.zero.Init (transformers' "non-Trainer integration" docs).
    args = trainer_args(ds_path, out_dir)
    # The Trainer's own device setup (accelerate) joins the process group; zero.Init below needs the
    # world size, and the Trainer would run this setup first too.
    print(f"rank {args.process_index}/{args.world_size} on {args.device}", flush=True)
    # On CPU, accelerate joins torch.distributed itself but not DeepSpeed's comm, whose world size
    # zero.Init reads (1 otherwise, and the JSON's train_batch_size then fails its check).
    import deepspeed
    import deepspeed.ops

    # As the trial worker does: DeepSpeed's shared-memory comm op is compiled at first use and, built
    # here, one rank once aborted at exit after training ("terminate called without an active
    # exception", SIGABRT) in a CI run; the JSON under test does not depend on it
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))
    checkpoint_first_layers(model, k)
    gen = torch.Generator().manual_seed(0)
    data = [
        {"input_ids": ids, "labels": ids} for ids in torch.randint(0, model.config.vocab_size, (8, 64), generator=gen)
    ]
    trainer = Trainer(model=model, args=args, train_dataset=data)
    result = trainer.train()
    if args.process_index == 0:
        flags = [layer.gradient_checkpointing for layer in decoder_layers(model)]
        print(
            "AUTOTUNE_TRAINER",
            json.dumps(
                {
                    "steps": result.global_step,
                    "loss": result.training_loss,
                    "zero3": hasattr(next(model.parameters()), "ds_id"),
                    "engine": type(trainer.model_wrapped).__name__,
                    "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
                    "flags": flags,
                }
            ),
            flush=True,
        )
    exit_rank()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
