"""Train a causal language model with a plain `deepspeed.initialize` loop: a training script of your own, as
`autotune search --script` tunes it with your own DeepSpeed config (docs/trials.md, "Tuning your own script").

    deepspeed --num_gpus 2 examples/train_deepspeed.py --deepspeed_config examples/ds_config.json
    autotune search --model examples/tiny-llama.json --gpus 2xcpu --seq-len 64 --script examples/train_deepspeed.py \
        --script-config examples/ds_config.json --script-config-flag deepspeed_config \
        --script-args "--model_config examples/tiny-llama.json --seq_len 64"

Everything the loop needs comes from the JSON: the micro batch, the gradient accumulation, ZeRO, precision, the
optimizer and its scheduler; `activation_checkpointing.number_checkpoints`, when set, checkpoints that many decoder
layers from the first on. Nothing is downloaded: the model is built from a config (a Hugging Face config.json or a
folder holding one; default: a tiny Llama) with random weights, and trains on random tokens, a fixed set per rank.
"""

from __future__ import annotations

import argparse
import json

import deepspeed
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

TINY_LLAMA = dict(
    num_hidden_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    intermediate_size=128,
    vocab_size=256,
    max_position_embeddings=256,
)


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model_config", default=None, help="a Hugging Face config.json or a folder holding one")
    p.add_argument("--seq_len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps")
    p.add_argument("--local_rank", type=int, default=-1, help="set by DeepSpeed's launcher")
    p = deepspeed.add_config_arguments(p)  # --deepspeed, --deepspeed_config
    args = p.parse_args()
    if not args.deepspeed_config:
        p.error("--deepspeed_config FILE is required")
    return args


def build_model(args, ds: dict):
    config = AutoConfig.from_pretrained(args.model_config) if args.model_config else LlamaConfig(**TINY_LLAMA)
    torch.manual_seed(0)  # every rank starts from the same weights
    if ds.get("zero_optimization", {}).get("stage") == 3:
        with deepspeed.zero.Init(config_dict_or_path=ds):  # each rank holds its partition only from the start
            model = AutoModelForCausalLM.from_config(config)
    else:
        model = AutoModelForCausalLM.from_config(config)
    k = ds.get("activation_checkpointing", {}).get("number_checkpoints", 0)
    if k:  # recompute the first k decoder layers in backward, keep the others' activations
        n = config.num_hidden_layers
        layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i < k
    return model


def main() -> None:
    args = arguments()
    with open(args.deepspeed_config) as f:
        ds = json.load(f)
    deepspeed.init_distributed()
    model = build_model(args, ds)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=ds
    )
    rank = torch.distributed.get_rank()
    gen = torch.Generator().manual_seed(1000 + rank)
    micro = engine.train_micro_batch_size_per_gpu()
    data = torch.randint(0, model.config.vocab_size, (64, micro, args.seq_len), generator=gen)
    for step in range(args.steps):
        for i in range(engine.gradient_accumulation_steps()):
            x = data[(step * engine.gradient_accumulation_steps() + i) % len(data)].to(engine.device)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step}: loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
