"""One traced build for every sequence length or micro batch in a range (memory/seq_family.py), as
`autotune estimate --max-seq-len` / `--max-micro-batch` use it: a replayed program must be the traced
one to the byte, code that branches on the length must be refused, and the largest value that fits
must not change."""

import dataclasses

import pytest
from cases import TEST_FAMILIES, spec
from conftest import quick

from autotune.hardware import parse_gpus
from autotune.memory import code_trace, estimate, limits
from autotune.train_config import TrainConfig

CASES = [  # family, precision, attention, ckpt, method, field, values
    ("llama", "bf16", "sdpa", 1, "full", "seq_len", (16, 48, 128)),
    ("gpt2", "fp32", "eager", 0, "full", "seq_len", (16, 64, 128)),  # s x s attention probabilities
    ("qwen2", "bf16", "sdpa", 0, "lora", "seq_len", (16, 64, 128)),
    ("factory", "bf16", "sdpa", 1, "full", "seq_len", (16, 64, 128)),
    ("llama", "fp32", "eager", 2, "full", "micro_batch", (2, 4, 9)),
]


def _fresh(monkeypatch):
    monkeypatch.setattr(code_trace, "_PROGRAMS", {})
    monkeypatch.setattr(code_trace, "_FAMILIES", {})


@pytest.mark.parametrize(
    "family,precision,attention,ckpt,method,name,values", quick(CASES, fast=set())
)  # each a family replayed (~5 s): CI
def test_one_build_replays_every_value_to_the_byte(
    monkeypatch, family, precision, attention, ckpt, method, name, values
):
    s = spec(family)
    cfg = TrainConfig(
        micro_batch=2, seq_len=48, precision=precision, attention=attention, ckpt_layers=ckpt, method=method
    )

    def program(v):  # one of the programs an estimate traces: `ckpt` checkpointed layers, then 2 more
        return code_trace.trace_program(
            s, dataclasses.replace(cfg, **{name: v}), ckpt=ckpt, full=2, fused=False, on_cpu=True
        )

    asked = (values[0] + 1, values[1] + 3, values[2] - 1)  # the probes themselves are their own steps
    _fresh(monkeypatch)
    # the first trace of a code in a process can count a few bytes more, of objects the code makes
    # once and keeps (measured: 16 B with peft); both passes below come after it
    program(values[1])
    _fresh(monkeypatch)
    with code_trace.families(name, values):
        replayed = {v: program(v) for v in asked}
    assert [f is not None for f in code_trace._FAMILIES.values()] == [True]
    _fresh(monkeypatch)
    for v in asked:  # every segment peak, every category
        assert replayed[v] == program(v), v


@pytest.mark.slow
def test_code_that_branches_on_the_length_is_traced_value_by_value(monkeypatch):
    """Mistral's sliding window: within its width SDPA runs causal without a mask, beyond it the
    model builds one. A range across the width is refused; one inside it is replayed."""
    from transformers import AutoConfig

    from autotune.models import hf_config as hf

    d = {**TEST_FAMILIES["llama"], "model_type": "mistral", "sliding_window": 64}
    s = hf.spec_from_config(AutoConfig.for_model(d.pop("model_type"), **d), name="test-mistral", source="test")
    cfg = TrainConfig(micro_batch=2, seq_len=48, precision="bf16")

    def program(v):
        return code_trace.trace_program(
            s, dataclasses.replace(cfg, seq_len=v), ckpt=0, full=2, fused=False, on_cpu=True
        )

    program(48)
    for values, exact in (((16, 40, 128), False), ((16, 32, 60), True)):
        _fresh(monkeypatch)
        with code_trace.families("seq_len", values):
            got = program(values[1] + 3)
        assert [f is not None for f in code_trace._FAMILIES.values()] == [exact]
        _fresh(monkeypatch)
        assert got == program(values[1] + 3)


@pytest.mark.slow
def test_the_largest_fitting_length_is_the_one_traced_value_by_value(monkeypatch):
    s = spec("llama")
    cluster = parse_gpus("1xcpu@64MiB")
    cfg = TrainConfig(micro_batch=2, seq_len=48, precision="bf16", ckpt_layers=1)
    _fresh(monkeypatch)
    v = limits.largest_fitting(s, cluster, cfg, "seq_len")
    assert limits.RANGE["seq_len"][0] < v < limits.RANGE["seq_len"][1]  # answered inside the family's range
    assert code_trace._FAMILIES and all(f is not None for f in code_trace._FAMILIES.values())
    _fresh(monkeypatch)
    with monkeypatch.context() as m:  # a later run: the families are read back from the disk cache
        m.setattr(code_trace, "_run", None)
        assert limits.largest_fitting(s, cluster, cfg, "seq_len") == v
    _fresh(monkeypatch)
    assert estimate(s, cluster, dataclasses.replace(cfg, seq_len=v)).fits  # traced on their own
    assert not estimate(s, cluster, dataclasses.replace(cfg, seq_len=v + 1)).fits
