"""`autotune models` and `autotune gpus`: list the presets."""

from __future__ import annotations

ORDER = 90


def register(sub) -> None:
    p = sub.add_parser("models", help="list model presets")
    p.set_defaults(func=run_models)
    p = sub.add_parser("gpus", help="list GPU presets and the --gpus grammar")
    p.set_defaults(func=run_gpus)


def run_models(args) -> int:
    from autotune.models import aliases, presets
    from autotune.units import fmt_count

    by_name: dict[str, list[str]] = {}
    for a, n in aliases().items():
        by_name.setdefault(n, []).append(a)
    print(f"{'name':<13} {'params':>8} {'layers':>6} {'hidden':>6} {'heads':>7} {'ffn':>6} {'vocab':>7}  aliases")
    for name, s in presets().items():
        heads = f"{s.num_heads}/{s.num_kv_heads}" if s.num_kv_heads != s.num_heads else str(s.num_heads)
        print(
            f"{name:<13} {fmt_count(s.num_params):>8} {s.num_layers:>6} {s.hidden_size:>6} {heads:>7} "
            f"{s.ffn_hidden_size:>6} {s.vocab_size:>7}  {', '.join(sorted(by_name.get(name, [])))}"
        )
    print(
        "\n--model also takes a Hugging Face config.json, a directory holding one, or a hub id in the local "
        "Hugging Face cache: any architecture transformers' AutoModelForCausalLM builds (what is refused, and why: "
        "docs/models.md). Estimates checked against real runs: llama, mistral, qwen2, gpt2 and gpt_neox "
        "(benchmarks/memory_accuracy.py) and more types, gemma to mixtral, deepseek_v3 and hybrids such as jamba "
        "(benchmarks/hf_families.py). "
        "--impl builtin (autotune's own stand-in) reads llama, mistral, gpt2, gpt_neox and mpt configs."
    )
    return 0


def run_gpus(args) -> int:
    from autotune.hardware import GRAMMAR, gpu_table
    from autotune.units import GiB, MiB

    print(f"{'name':<10} {'memory':>10} {'bf16':>5} {'peak bf16/fp16/fp32 TFLOPS':>27}  aliases")
    for name, e in gpu_table().items():
        pk = e.get("peak_tflops") or {}
        peaks = "/".join(str(pk.get(k, "-")) for k in ("bf16", "fp16", "fp32"))
        mem = f"{e['memory_mib'] * MiB / GiB:.1f} GiB" if e["memory_mib"] else "host RAM"
        print(
            f"{name:<10} {mem:>10} {'yes' if e['bf16'] else 'no':>5} {peaks:>27}  "
            f"{', '.join(str(a) for a in e.get('aliases', []))}"
        )
    print(f"\n--gpus grammar: {GRAMMAR}. A100 alone means the 80 GB part; sources in autotune/data/gpus.yaml.")
    return 0
