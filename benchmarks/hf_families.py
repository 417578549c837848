"""Families beyond the five of benchmarks/memory_accuracy.py: does the traced tier follow their code?

    python benchmarks/hf_families.py [MODEL_TYPE ...]
    python benchmarks/hf_families.py --deepspeed [MODEL_TYPE ...]   # real DeepSpeed, 2 CPU ranks (~1 min)
    python benchmarks/hf_families.py --deepspeed --lora [MODEL_TYPE ...]   # the same with peft's LoRA
    python benchmarks/hf_families.py --replay [MODEL_TYPE ...]      # one build for many lengths (~2 min)

For each transformers model_type below, a 3-layer config of a shape no test uses (hidden 64, 4
heads, vocab 512, random init) is traced on fake tensors (autotune.memory.traced.trace, the code
path of every Hugging Face estimate) and run for real on CPU tensors in this process
(tests/cpu_step.py: one AdamW step, then a measured one), fp32 sdpa without checkpointing and bf16
eager with one checkpointed layer. It prints real - traced bytes per phase: the same to the byte
but for the 0-dim CPU scalars c10 makes outside the dispatcher (a few bytes per layer, under 128).
With --deepspeed: real DeepSpeed trials on 2 CPU ranks of a wider model (hidden 96) of each type
(default: phi, qwen3, gemma3_text) at ZeRO-0 fp32, ZeRO-2 bf16 with 1 checkpointed layer and ZeRO-3
bf16 with 2, against `autotune.memory.estimate`: the whole per-rank peak, DeepSpeed's terms included.
With --replay: each traced program of the two cases replayed from one build stepped at three sequence
lengths (16, 48, 256) and at three micro batches (2, 3, 8) (memory/seq_family.py, what `autotune
estimate --max-seq-len` / `--max-micro-batch` use) against the same program traced at three values
between on its own: the same to the byte, or refused (then traced value by value), never different.
Classes without sdpa are refused with the attention they support (train_config.check_config), and
code that cannot run a step says why (code_trace.trace_program).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cpu_step import measure_cpu

from autotune.errors import SpecError
from autotune.hardware import parse_gpus
from autotune.memory.traced import trace
from autotune.train_config import TrainConfig, check_config

CPU = parse_gpus("1xcpu@8GiB")
COMMON = dict(
    num_hidden_layers=3,
    hidden_size=64,
    num_attention_heads=4,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=256,
)
FAMILIES = {
    "gemma": dict(num_key_value_heads=1, head_dim=16),
    "gemma2": dict(num_key_value_heads=2, head_dim=16),
    "gemma3_text": dict(num_key_value_heads=2, head_dim=16),
    "phi": {},
    "qwen3": dict(num_key_value_heads=2, head_dim=16),
    "olmo2": dict(num_key_value_heads=2),
    "stablelm": dict(num_key_value_heads=2),
    "starcoder2": dict(num_key_value_heads=2),
    "falcon": {},
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64),
    "bloom": dict(n_layer=3, n_head=4),
    "gptj": dict(n_layer=3, n_embd=64, n_head=4, rotary_dim=8, n_positions=256),
    "gpt_bigcode": dict(n_layer=3, n_embd=64, n_head=4, n_positions=256),
    "mixtral": dict(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
    "granite": dict(num_key_value_heads=2),
    "cohere": dict(num_key_value_heads=2),
    # stacks of mixed layers (ModelSpec.uniform_blocks False): a dense layer, then MoE ones
    "deepseek_v3": dict(
        first_k_dense_replace=1,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=24,
        n_group=1,
        topk_group=1,
    ),
    "qwen2_moe": dict(
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=96,
        mlp_only_layers=[0],
    ),
    "deepseek_v2": dict(
        first_k_dense_replace=1,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=48,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=24,
    ),
    # a hybrid: Mamba layers, attention every other layer, MoE every other layer
    "jamba": dict(
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_dt_rank=8,
    ),
    "bamba": dict(
        num_key_value_heads=2,
        attn_layer_indices=[1],
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_chunk_size=16,
    ),
    "granitemoehybrid": dict(
        num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba"],
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=96,
        mamba_n_heads=4,
        mamba_d_head=32,
        mamba_d_state=16,
        mamba_chunk_size=16,
    ),
    "qwen3_next": dict(
        num_key_value_heads=2,
        head_dim=16,
        layer_types=["linear_attention", "linear_attention", "full_attention"],
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=48,
    ),
    "lfm2": dict(num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"]),
    # per-layer lists beside layer_types (transformers 5's mlp_layer_types): dense, then sparse
    "exaone_moe": dict(
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        mlp_layer_types=["dense", "sparse", "sparse"],
        sliding_window=16,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
}
CASES = (("fp32", "sdpa", 0), ("bf16", "eager", 1))


def main(types: list[str]) -> None:
    from transformers import AutoConfig

    from autotune.models import hf_config as hf

    exact = total = 0
    for fam in types:
        spec = hf.spec_from_config(
            AutoConfig.for_model(fam, **{**COMMON, **FAMILIES[fam]}),
            name=f"bench-{fam}",
            source="benchmarks/hf_families.py",
        )
        for precision, attention, k in CASES:
            cfg = TrainConfig(micro_batch=2, seq_len=48, precision=precision, attention=attention, ckpt_layers=k)
            what = f"{fam:12s} {precision} {attention:5s} k={k}"
            try:
                check_config(cfg, spec, CPU)
                got = trace(spec, CPU, cfg).raw_peaks
            except SpecError as e:
                print(f"{what}  refused: {e}")
                continue
            real = measure_cpu(spec, cfg)
            diff = {ph: real[ph] - got[ph] for ph in ("forward", "backward", "optimizer")}
            ok = all(0 <= v <= 128 for v in diff.values())
            exact, total = exact + ok, total + 1
            print(
                f"{what}  real - traced: "
                + ", ".join(f"{ph} {v:+d} B" for ph, v in diff.items())
                + f"  (peak {max(real.values()):,} B){'' if ok else '  MISS'}"
            )
    print(f"\n{exact} of {total} traced steps within 128 B of the real step")


LORA_CASES = (
    (0, "fp32", 0, 2, dict(method="lora", lora_rank=8, lora_targets="all-linear", lora_dropout=0.0)),
    (2, "bf16", 1, 3, dict(method="lora", lora_rank=8)),
    (3, "fp32", 0, 2, dict(method="lora", lora_rank=8)),
)
"""--deepspeed --lora: peft's adapters on the same models (all-linear without dropout, which peft
refuses on MoE experts' grouped parameters; attention targets, rank 8)."""


def deepspeed(types: list[str], lora: bool = False) -> None:
    import tempfile

    from transformers import AutoConfig

    from autotune.memory import estimate
    from autotune.models import hf_config as hf
    from autotune.trial import run_trials
    from autotune.trial.record import TrialRequest

    cluster = parse_gpus("2xcpu")
    wider = dict(hidden_size=96, intermediate_size=256, vocab_size=700)
    shapes = LORA_CASES if lora else ((0, "fp32", 0, 2, {}), (2, "bf16", 1, 3, {}), (3, "bf16", 2, 2, {}))
    cases = [(fam, z, p, k, mb, extra) for fam in types for z, p, k, mb, extra in shapes]
    with tempfile.TemporaryDirectory() as tmp:
        reqs = []
        for fam, z, p, k, mb, extra in cases:
            shape = {**COMMON, **FAMILIES[fam], **wider}
            if "head_dim" in shape:
                shape["head_dim"] = 24
            if "mamba_d_head" in shape:  # the Mamba heads span expand x hidden
                shape["mamba_d_head"] = 2 * wider["hidden_size"] // shape["mamba_n_heads"]
            spec = hf.spec_from_config(
                AutoConfig.for_model(fam, **shape), name=f"bench-{fam}", source="benchmarks/hf_families.py"
            )
            cfg = TrainConfig(zero_stage=z, precision=p, ckpt_layers=k, micro_batch=mb, seq_len=80, **extra)
            reqs.append(
                TrialRequest(
                    model=spec,
                    cluster=cluster,
                    config=cfg,
                    out_dir=Path(tmp, f"{fam}-{z}"),
                    steps=2,
                    warmup_steps=1,
                    timeout_s=300,
                )
            )
        errors = []
        for (fam, *_), req, res in zip(cases, reqs, run_trials(reqs)):
            if res.status != "ok":
                print(f"{fam:12s} {req.config.short()}: {res.status} {res.reason}")
                continue
            est = estimate(req.model, cluster, req.config).tensor_peak_bytes
            errors.append(abs(est / res.peak_bytes - 1))
            print(
                f"{fam:12s} {req.config.short()}: measured {res.peak_bytes:,} B, estimate {est:,} B "
                f"({100 * (est / res.peak_bytes - 1):+.2f}%)"
            )
    if errors:
        print(f"\nworst |error| {100 * max(errors):.2f}% over {len(errors)} DeepSpeed runs")


def replay(types: list[str]) -> None:
    import dataclasses

    from transformers import AutoConfig

    from autotune.memory import code_trace
    from autotune.models import hf_config as hf

    counts = {"same": 0, "refused": 0, "DIFFERENT": 0}
    for fam in types:
        spec = hf.spec_from_config(
            AutoConfig.for_model(fam, **{**COMMON, **FAMILIES[fam]}),
            name=f"bench-{fam}",
            source="benchmarks/hf_families.py",
        )
        for precision, attention, k in CASES:
            cfg = TrainConfig(micro_batch=2, seq_len=48, precision=precision, attention=attention, ckpt_layers=k)
            try:
                check_config(cfg, spec, CPU)
                trace(spec, CPU, cfg)  # the first trace in a process counts objects made once
            except SpecError as e:
                print(f"{fam:12s} {precision} {attention:5s} k={k}  refused: {e}")
                continue
            for name, values in (("seq_len", (16, 48, 256)), ("micro_batch", (2, 3, 8))):
                asked = [values[0] + 1, values[1] + 2, values[2] - 1]
                code_trace._PROGRAMS.clear()
                code_trace._FAMILIES.clear()
                with code_trace.families(name, values):
                    replayed = [trace(spec, CPU, dataclasses.replace(cfg, **{name: v})).points for v in asked]
                accepted = all(f is not None for f in code_trace._FAMILIES.values())
                code_trace._PROGRAMS.clear()
                code_trace._FAMILIES.clear()
                traced = [trace(spec, CPU, dataclasses.replace(cfg, **{name: v})).points for v in asked]
                verdict = "DIFFERENT" if replayed != traced else "same" if accepted else "refused"
                counts[verdict] += 1
                print(
                    f"{fam:12s} {precision} {attention:5s} k={k} {name:11s} {values}: {verdict}"
                    + ("" if accepted else " (traced value by value)")
                )
    print("\n" + ", ".join(f"{v} {k}" for k, v in counts.items()) + " (replayed vs traced at 3 values each)")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--deepspeed"]:
        lora = args[1:2] == ["--lora"]
        deepspeed(args[1 + lora :] or ["phi", "qwen3", "gemma3_text"], lora)
    elif args[:1] == ["--replay"]:
        replay(args[1:] or list(FAMILIES))
    else:
        main(args or list(FAMILIES))
