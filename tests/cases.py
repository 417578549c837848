"""The model shapes the tests and the benchmarks share, written once.

Tests import it as they import steady.py and cpu_step.py (pytest puts tests/ on sys.path); a benchmark
puts tests/ on its path first. It lives here, not in autotune/, because it is test data, not what the
package ships, and benchmarks/ is a folder of scripts that tests load by file (`benchmark`).
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

TINY_LLAMA = {
    "model_type": "llama",
    "num_hidden_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 128,
    "vocab_size": 256,
    "max_position_embeddings": 256,
}
"""A transformers Llama config.json small enough for real searches on two CPU ranks (conftest's
killed_and_resumed, test_search, test_search_space, test_stopping)."""

TEST_FAMILIES: dict[str, dict] = {
    "gpt2": dict(
        model_type="gpt2",
        n_layer=3,
        n_embd=64,
        n_head=4,
        vocab_size=1000,
        n_positions=128,
        bos_token_id=999,
        eos_token_id=999,
    ),  # dropout 0.1 (the defaults)
    "llama": dict(
        model_type="llama",
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=160,
        vocab_size=1000,
        max_position_embeddings=128,
    ),
    "qwen2": dict(
        model_type="qwen2",
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=128,
        vocab_size=900,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    ),
    "gpt_neox": dict(
        model_type="gpt_neox",
        num_hidden_layers=3,
        hidden_size=64,
        num_attention_heads=4,
        intermediate_size=192,
        vocab_size=1100,
        max_position_embeddings=128,
    ),
}
"""The memory tests' own shapes (test_memory_hf, test_seq_family): traced against real CPU runs of the
same code. The benchmarks judge the estimate on FAMILIES and HELD_OUT, which these tests do not tune."""

FAMILIES: dict[str, dict] = {
    # dropout 0.1 everywhere (GPT2Config's defaults), gelu_new, learned positions, tied head
    "gpt2": dict(
        model_type="gpt2",
        n_layer=4,
        n_embd=96,
        n_head=4,
        vocab_size=1536,
        n_positions=512,
        bos_token_id=1535,
        eos_token_id=1535,
    ),
    # grouped-query attention: 8 query heads, 2 key/value heads
    "llama": dict(
        model_type="llama",
        num_hidden_layers=4,
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=336,
        vocab_size=2048,
        max_position_embeddings=512,
    ),
    "mistral": dict(
        model_type="mistral",
        num_hidden_layers=3,
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=288,
        vocab_size=1800,
        max_position_embeddings=512,
    ),
    # tied embeddings, biases on q, k and v only
    "qwen2": dict(
        model_type="qwen2",
        num_hidden_layers=3,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=320,
        vocab_size=1664,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    # parallel residual (the default), rotary on a quarter of each head
    "gpt_neox": dict(
        model_type="gpt_neox",
        num_hidden_layers=3,
        hidden_size=128,
        num_attention_heads=4,
        intermediate_size=448,
        vocab_size=2000,
        max_position_embeddings=512,
    ),
}
"""The shapes of the recorded DeepSpeed runs (benchmarks/hf_memory.py, lora_memory.py, knobs_on_hf.py,
parallel_memory.py; their CSVs in benchmarks/data/); the parallelism tests refuse and price them."""

HELD_OUT: dict[str, dict] = {
    # wider and deeper than FAMILIES, other vocabularies; measured after the table above was final
    "gpt2": dict(
        model_type="gpt2",
        n_layer=6,
        n_embd=192,
        n_head=6,
        vocab_size=4096,
        n_positions=512,
        bos_token_id=4095,
        eos_token_id=4095,
    ),
    "llama": dict(
        model_type="llama",
        num_hidden_layers=5,
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=688,
        vocab_size=8000,
        max_position_embeddings=512,
    ),
    "mistral": dict(
        model_type="mistral",
        num_hidden_layers=6,
        hidden_size=160,
        num_attention_heads=10,
        num_key_value_heads=2,
        intermediate_size=432,
        vocab_size=3000,
        max_position_embeddings=512,
    ),
    "qwen2": dict(
        model_type="qwen2",
        num_hidden_layers=5,
        hidden_size=192,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=5000,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    ),
    "gpt_neox": dict(
        model_type="gpt_neox",
        num_hidden_layers=6,
        hidden_size=192,
        num_attention_heads=6,
        intermediate_size=768,
        vocab_size=6000,
        max_position_embeddings=512,
    ),
}
"""benchmarks/hf_memory.py's held-out set: other shapes, judged with nothing changed."""


ISSUE51_LLAMA: dict = dict(
    model_type="llama",
    num_hidden_layers=4,
    hidden_size=384,
    intermediate_size=1024,
    num_attention_heads=6,
    num_key_value_heads=2,
    vocab_size=3001,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    max_position_embeddings=512,
)
"""Issue 51's Llama (8.6M parameters, V h 1.15M): benchmarks/user_loops.py's first case and knobs_on_hf.py's bucket
matrix, where reduce buckets of 1e6 to 5e8 elements fall below the LM head's gradient, between it and the model, and
above the model."""


def hf_spec(config: dict, name: str, source: str):
    """autotune's ModelSpec of a transformers config given as a dict with its model_type (exact
    parameter count: autotune/models/hf_config.py)."""
    from transformers import AutoConfig

    from autotune.models import hf_config as hf

    d = dict(config)
    return hf.spec_from_config(AutoConfig.for_model(d.pop("model_type"), **d), name=name, source=source)


def spec_of(family: str, config: dict | None = None):
    """The ModelSpec of a recorded family (FAMILIES), or of the shape a CSV row recorded for it."""
    return hf_spec(config or FAMILIES[family], name=f"hf-{family}", source="benchmarks/hf_memory.py")


def spec(family: str):
    """The ModelSpec of a TEST_FAMILIES shape; "factory": a user's own module (tests/tiny_factory.py)
    through the same seam."""
    import dataclasses

    from autotune.models import from_shape

    if family == "factory":
        return dataclasses.replace(
            from_shape(
                "test-factory",
                "gpt2",
                num_layers=3,
                hidden_size=64,
                num_heads=4,
                ffn_hidden_size=256,
                vocab_size=700,
                max_seq_len=128,
            ),
            implementation="factory",
            factory="tiny_factory:make",
        )
    return hf_spec(TEST_FAMILIES[family], name=f"test-{family}", source="test")


def summary(errors: list[float]) -> dict:
    """{n, median, max, under} in percent: median and worst |error|, and the worst under-estimate (the
    bar of issues 30 and 31: 1%, 3%, 1%)."""
    e = [100 * abs(x) for x in errors]
    return {"n": len(e), "median": statistics.median(e), "max": max(e), "under": max(0.0, -100 * min(errors))}


def benchmark(name: str):
    """benchmarks/<name>.py, loaded by file once per process (a script folder, not a package)."""
    if name not in sys.modules:
        loaded = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(loaded)
        sys.modules[name] = module
        try:
            loaded.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]
