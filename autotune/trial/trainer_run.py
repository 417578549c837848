"""A Hugging Face Trainer script that `autotune export --verify` runs as a script trial (autotune/report/verify.py,
autotune/trial/script_rank.py): the study's model, random-init (autotune.impl, as the trials build it), on random
tokens, trained by `transformers.Trainer` with the exported DeepSpeed JSON (`--deepspeed FILE`). Every
TrainingArguments flag works; DeepSpeed's `autotuning` section that the verify run adds stops it after the warm-up
and measured steps.

    python autotune/trial/trainer_run.py --autotune_model model.json --seq_len 64 --deepspeed ds.json \
        --per_device_train_batch_size 4
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from transformers import HfArgumentParser, Trainer, TrainingArguments


@dataclass
class RunArgs:
    autotune_model: str = field(metadata={"help": "the study's ModelSpec as JSON (autotune/models: ModelSpec)"})
    seq_len: int = field(default=64, metadata={"help": "tokens per training sequence"})
    attention: str = field(default="sdpa", metadata={"help": "transformers' attn_implementation"})
    samples: int = field(default=2048, metadata={"help": "random training sequences"})


def main() -> None:
    from autotune.impl import impl_for
    from autotune.models import ModelSpec

    parser = HfArgumentParser((RunArgs, TrainingArguments))
    parser.set_defaults(
        output_dir="trainer_output",
        save_strategy="no",
        report_to="none",
        logging_steps=10,
        max_steps=1000,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    run, args = parser.parse_args_into_dataclasses()
    with open(run.autotune_model) as f:
        spec = ModelSpec(**json.load(f))
    if args.deepspeed and args.use_cpu:
        # as examples/train_hf.py: the Trainer's CPU setup joins torch.distributed but not DeepSpeed's comm, whose
        # world size deepspeed.zero.Init reads when a ZeRO-3 model is built below
        args.device  # noqa: B018 (the property does the setup)
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    ds = {}
    if args.deepspeed and os.path.isfile(args.deepspeed):
        with open(args.deepspeed) as f:
            ds = json.load(f)
    impl = impl_for(spec)
    torch.manual_seed(0)
    # after TrainingArguments: under ZeRO-3 its HfDeepSpeedConfig makes from_config build the model partitioned
    model = impl.build(spec, dtype=torch.float32, attention=run.attention)
    impl.checkpoint_first(model, ds.get("activation_checkpointing", {}).get("number_checkpoints", 0))
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(0, spec.vocab_size, (run.samples, run.seq_len), generator=gen)
    Trainer(model=model, args=args, train_dataset=[{"input_ids": s, "labels": s} for s in seqs]).train()


if __name__ == "__main__":
    main()
