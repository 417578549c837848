"""Train a causal language model with the Hugging Face Trainer under DeepSpeed: a training script of your own, as
`autotune search --script` tunes it (docs/trials.md, "Tuning your own script").

    torchrun --nproc_per_node 2 examples/train_hf.py --deepspeed ds_config.json --per_device_train_batch_size 4
    autotune search --model examples/tiny-llama.json --gpus 2xcpu --seq-len 64 --script examples/train_hf.py \
        --script-args "--model_config examples/tiny-llama.json --seq_len 64"

Nothing is downloaded. The model is built from a config (a Hugging Face config.json, or a folder holding one;
default: a tiny Llama) with random weights; the data is a local text file (`--data FILE`, one document per line,
cut into byte tokens) or random tokens. Every TrainingArguments flag works (--learning_rate, --max_steps, --bf16,
...). The DeepSpeed JSON may say "auto" wherever the Trainer fills a value in (batch sizes, optimizer, scheduler,
gradient clipping, precision). Its `activation_checkpointing.number_checkpoints`, when set, checkpoints that many
decoder layers from the first on (the rest keep their activations), which is what autotune's `ckpt_layers` means.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, LlamaConfig, Trainer, TrainingArguments

TINY_LLAMA = dict(
    num_hidden_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=256,
)
"""The default model: a 4-layer Llama small enough to train in seconds on CPU (examples/tiny-llama.json)."""


@dataclass
class ScriptArgs:
    model_config: str | None = field(
        default=None, metadata={"help": "a Hugging Face config.json or a folder holding one (default: a tiny Llama)"}
    )
    seq_len: int = field(default=64, metadata={"help": "tokens per training sequence"})
    data: str | None = field(default=None, metadata={"help": "a text file, one document per line (default: random)"})
    samples: int = field(default=4096, metadata={"help": "training sequences (random data)"})


def build_model(script: ScriptArgs):
    if script.model_config:
        config = AutoConfig.from_pretrained(script.model_config)
    else:
        config = LlamaConfig(**TINY_LLAMA)
    torch.manual_seed(0)  # every rank starts from the same weights
    return AutoModelForCausalLM.from_config(config)


def dataset(script: ScriptArgs, vocab_size: int) -> list[dict]:
    """Sequences of seq_len tokens: the text file's bytes (modulo the vocabulary), or random tokens."""
    if script.data:
        with open(script.data, "rb") as f:
            tokens = torch.tensor([b % vocab_size for b in f.read()], dtype=torch.long)
        n = len(tokens) // script.seq_len
        if n == 0:
            raise SystemExit(f"--data {script.data}: fewer than {script.seq_len} bytes")
        seqs = tokens[: n * script.seq_len].view(n, script.seq_len)
    else:
        gen = torch.Generator().manual_seed(0)
        seqs = torch.randint(0, vocab_size, (script.samples, script.seq_len), generator=gen)
    return [{"input_ids": s, "labels": s} for s in seqs]


def checkpoint_first(model, k: int) -> None:
    """Recompute the activations of the first k decoder layers in backward, keep the others' (transformers'
    GradientCheckpointingLayer checkpoints a layer while its flag is set)."""
    if not k:
        return
    n = model.config.num_hidden_layers
    layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i < k


def deepspeed_json(path_or_dict) -> dict:
    if isinstance(path_or_dict, dict):
        return path_or_dict
    if path_or_dict and os.path.isfile(path_or_dict):
        with open(path_or_dict) as f:
            return json.load(f)
    return {}


def main() -> None:
    parser = HfArgumentParser((ScriptArgs, TrainingArguments))
    parser.set_defaults(
        output_dir="train_hf_output",
        save_strategy="no",
        report_to="none",
        logging_steps=10,
        max_steps=1000,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )
    script, args = parser.parse_args_into_dataclasses()
    if args.deepspeed and args.use_cpu:
        # The Trainer's device setup joins torch.distributed on CPU but not DeepSpeed's comm, whose world size
        # deepspeed.zero.Init reads when from_config builds a ZeRO-3 model below
        args.device  # noqa: B018 (the property does the setup)
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    # After TrainingArguments: with ZeRO-3 in the JSON it keeps the HfDeepSpeedConfig that builds the model
    # partitioned (transformers' "non-Trainer integration")
    model = build_model(script)
    checkpoint_first(
        model, deepspeed_json(args.deepspeed).get("activation_checkpointing", {}).get("number_checkpoints", 0)
    )
    trainer = Trainer(model=model, args=args, train_dataset=dataset(script, model.config.vocab_size))
    trainer.train()


if __name__ == "__main__":
    main()
