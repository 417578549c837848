"""ReadsMemo: a function of a configuration memoised by the fields it reads (autotune/search/reads_memo.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from autotune.costmodel import simulate
from autotune.errors import SpecError
from autotune.hardware import parse_gpus
from autotune.memory import estimate
from autotune.models import resolve_model
from autotune.search.reads_memo import ReadsMemo
from autotune.search.space import expand, load_space
from autotune.train_config import TrainConfig

BASE = TrainConfig(zero_stage=1, micro_batch=4, ckpt_layers=0, precision="fp32", seq_len=128)


def counted(fn):
    calls = []

    def wrapped(model, cluster, cfg):
        calls.append(None)  # nothing read of cfg: the count alone
        return fn(cfg)

    return wrapped, calls


def test_a_config_that_differs_only_in_what_was_not_read_is_answered_without_a_call():
    # reads the stage only for large micro batches, the checkpointed layers only for small ones
    fn, calls = counted(lambda c: ("big", c.zero_stage) if c.micro_batch > 2 else ("small", c.ckpt_layers))
    memo = ReadsMemo(fn)
    cases = [
        BASE,
        dataclasses.replace(BASE, ckpt_layers=2),  # not read at micro batch 4: a hit
        dataclasses.replace(BASE, zero_stage=2),  # read: a call
        dataclasses.replace(BASE, micro_batch=1),  # read: a call
        dataclasses.replace(BASE, micro_batch=1, zero_stage=3),  # the stage is not read there: a hit
        dataclasses.replace(BASE, micro_batch=1, ckpt_layers=2),
    ]  # read there: a call
    got = [memo(None, None, c) for c in cases]
    assert got == [("big", 1), ("big", 1), ("big", 2), ("small", 0), ("small", 0), ("small", 2)]
    assert len(calls) == memo.calls == 4


@pytest.mark.parametrize(
    "whole",
    [
        lambda c: hash(c),
        lambda c: c.key(),
        lambda c: vars(c),
        lambda c: repr(c),
        lambda c: dataclasses.asdict(c),
        lambda c: json.dumps(c.to_dict()),
    ],
)
def test_a_read_of_the_whole_config_is_a_read_of_every_field(whole):
    # the result depends on a field only through a read of the whole instance: no two configs may share it
    fn, calls = counted(lambda c: (whole(c), c.zero_stage, c.lora_dropout)[1:])
    memo = ReadsMemo(fn)
    for c in (
        BASE,
        dataclasses.replace(BASE, ckpt_layers=2),
        dataclasses.replace(BASE, reduce_bucket_size=2**20),
        BASE,
    ):
        memo(None, None, c)
    assert len(calls) == 3  # the repeat of BASE, and only it, is answered


def test_a_call_that_raises_is_not_kept():
    def fn(c):
        if c.micro_batch == 8:
            raise SpecError("refused")
        return c.micro_batch

    fn, calls = counted(fn)
    memo = ReadsMemo(fn)
    for _ in range(2):
        with pytest.raises(SpecError):
            memo(None, None, dataclasses.replace(BASE, micro_batch=8))
    assert memo(None, None, BASE) == 4 and len(calls) == 3


SPACE = """
zero_stage: [0, 1, 2, 3]
precision: [auto]
micro_batch: [1, 4]
ckpt_layers: [0, L]
seq_len: [2048]
offload_optimizer: [false, true]
offload_param: [none, cpu]
overlap_comm: [false, true]
reduce_bucket_size: [0, 500000000]
stage3_param_persistence_threshold: [0, 1000000]
stage3_prefetch_bucket_size: [0, 50000000]
stage3_max_live_parameters: [0, 100000000]
grad_accum_dtype: [auto, fp32]
zero_quantized_weights: [false, true]
zero_quantized_gradients: [false, true]
"""


@pytest.mark.parametrize("impl", [pytest.param("hf", marks=pytest.mark.slow), "builtin"])  # hf: ~5 s of tracing
def test_memoised_estimates_and_simulations_equal_the_functions_on_a_real_space(tmp_path, impl):
    """Every candidate of a space of full.yaml's knobs, for 13B on 4 x A100 (transformers' Llama traced, and the
    stand-in's analytic model): the memo's estimate and simulated step equal the functions', term for term, in
    fewer calls."""
    (tmp_path / "space.yaml").write_text(SPACE)
    model, cluster = resolve_model("13b", implementation=impl), parse_gpus("4xA100")
    cands = expand(load_space(tmp_path / "space.yaml"), model, cluster, seq_len=2048).candidates
    for fn in (estimate, simulate):
        memo = ReadsMemo(fn)
        for cfg in cands:
            got, want = memo(model, cluster, cfg), fn(model, cluster, cfg)
            assert (got.to_json() if fn is estimate else dataclasses.asdict(got)) == (
                want.to_json() if fn is estimate else dataclasses.asdict(want)
            ), cfg.short()
        print(f"{impl} {fn.__name__}: {memo.calls} calls for {len(cands)} candidates")
        assert memo.calls < len(cands) * (0.5 if fn is estimate else 1), (fn.__name__, memo.calls, len(cands))
