"""Search spaces: the YAML format, errors that name the key and the line, expansion into configs."""

from __future__ import annotations

import dataclasses
import json

import pytest
from cases import TINY_LLAMA as TINY

from autotune.cli import main
from autotune.hardware import parse_gpus
from autotune.models import SpecError, resolve_model
from autotune.search.space import DEFAULT_SPACE, SPACES_DIR, SearchSpace, expand, load_space, parse_space


def _error(text: str) -> str:
    with pytest.raises(SpecError) as e:
        parse_space(text, "s.yaml")
    return str(e.value)


def test_default_file_is_the_built_in_default():
    # The file a user reads and the values used where the package ships without it must agree.
    space = load_space()
    built_in = SearchSpace.of()
    for f in dataclasses.fields(SearchSpace):
        if f.name not in ("path", "text"):
            assert getattr(space, f.name) == getattr(built_in, f.name), f.name
    assert space.path == str(DEFAULT_SPACE)


def test_shipped_spaces_parse():
    for path in sorted(SPACES_DIR.glob("*.yaml")):
        assert load_space(path).values["zero_stage"]


def test_unknown_key_names_key_line_and_suggestion():
    msg = _error("zero_stage: [0, 1]\nprecision: [bf16]\nmicro_batchs: [1, 2]\n")
    assert "line 3" in msg and "'micro_batchs'" in msg and "did you mean 'micro_batch'" in msg


def test_bad_value_names_the_line_of_the_item():
    msg = _error("zero_stage:\n  - 0\n  - 1\n  - 5\nmicro_batch: [1]\n")
    assert "line 4" in msg and "zero_stage" in msg and "5" in msg and "0, 1, 2, 3" in msg


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("micro_batch: [1, 0]\n", 1, ["micro_batch", "positive"]),
        ("\n\nckpt_layers: [0, 2L]\n", 3, ["ckpt_layers", "'2L'"]),
        ("offload_optimizer: [yes please]\n", 1, ["offload_optimizer", "true or false"]),
        ("precision: [fp8]\n", 1, ["precision", "fp8"]),
        ("zero_stage: [true]\n", 1, ["zero_stage"]),
        ("micro_batch: []\n", 1, ["empty"]),
        ("micro_batch: {a: 1}\n", 1, ["mapping"]),
        ("trial:\n  steps: 2\n  timout: 5m\n", 3, ["trial.timout", "did you mean 'timeout'"]),
        ("trial:\n  timeout: soon\n", 2, ["trial.timeout", "duration"]),
        ("trial:\n  steps: 0\n", 2, ["trial.steps", ">= 1"]),
        ("zero_stage: [0]\nzero_stage: [1]\n", 2, ["twice"]),
        ("trial:\n  steps: 2\n  steps: 3\n", 3, ["'trial.steps' given twice"]),
        ("zero_stage: [0\nmicro_batch: 1\n", 2, ["not valid YAML"]),
        ("- 1\n- 2\n", 1, ["mapping"]),
    ],
)
def test_errors_name_key_and_line(text, line, words):
    msg = _error(text)
    assert f"s.yaml, line {line}:" in msg, msg
    for w in words:
        assert w in msg, msg


def test_scalars_are_one_value_lists_and_trial_settings_parse():
    s = parse_space("zero_stage: 3\nprecision: fp32\ntrial: {steps: 2, warmup_steps: 0, timeout: 1m30s}\n")
    assert s.values["zero_stage"] == (3,) and s.values["precision"] == ("fp32",)
    assert (s.trial.steps, s.trial.warmup_steps, s.trial.timeout_s) == (2, 0, 90.0)


def test_ckpt_symbols_resolve_against_the_layer_count():
    s = parse_space("ckpt_layers: [0, L/4, L/2, 3L/4, L, 48]\n")
    assert s.ckpt_values(40) == [0, 10, 20, 30, 40]  # 48 clipped to L = 40
    assert s.ckpt_values(6) == [0, 1, 3, 4, 6]  # 6/4 -> 1, 18/4 -> 4 (floor)
    assert parse_space("ckpt_layers: all\n").ckpt_values(3) == [0, 1, 2, 3]


def test_expand_counts_and_global_batch():
    model = resolve_model("llama-2-13b")
    cluster = parse_gpus("4xA100")
    space = parse_space("zero_stage: [2, 3]\nmicro_batch: [1, 2, 4, 8]\nckpt_layers: [0, L]\n")
    exp = expand(space, model, cluster, seq_len=2048)
    assert len(exp.candidates) == 2 * 4 * 2 and not exp.excluded
    assert {c.precision for c in exp.candidates} == {"bf16"}  # auto on an A100
    # 16 sequences per step over 4 GPUs: micro 1 -> accum 4, 2 -> 2, 4 -> 1; 8 x 4 = 32 does not divide 16
    exp = expand(space, model, cluster, seq_len=2048, global_batch=16)
    assert sorted({(c.micro_batch, c.grad_accum) for c in exp.candidates}) == [(1, 4), (2, 2), (4, 1)]
    assert sum(exp.excluded.values()) == 2 * 2 and "does not divide --global-batch 16" in next(iter(exp.excluded))


@pytest.mark.parametrize(
    "space,gpus",
    [
        # the whole 13B full.yaml (48,996 candidates, ~9 s) in the full suite; the other spaces in the quick loop
        pytest.param(s.name, g, marks=pytest.mark.slow if s.name == "full.yaml" else ())
        for s in sorted(SPACES_DIR.glob("*.yaml"))
        for g in ("4xA100", "2xcpu")
        if not (s.name == "full.yaml" and g == "2xcpu")
    ],
)
def test_expand_builds_what_checking_every_combination_builds(space, gpus):
    """expand checks each combination of check_combination's fields once and builds the configs that pass it
    without TrainConfig's checks (TrainConfig.prechecked): the same candidates, in the same order, and the same
    reasons with the same counts as `_expand_each`, which checks and builds every combination of the product, and
    each candidate passes TrainConfig's checks when built again from its values."""
    from autotune.search.space import _expand_each
    from autotune.train_config import TrainConfig, searched_fields

    model, cluster, sp = resolve_model("13b"), parse_gpus(gpus), load_space(SPACES_DIR / space)
    names = [f.name for f in searched_fields()]
    fast = expand(sp, model, cluster, seq_len=2048)
    each = _expand_each(sp, model, cluster, names, [sp.resolved(n, model, cluster, 2048) for n in names], None)
    assert [c.key() for c in fast.candidates] == [c.key() for c in each.candidates]
    assert list(fast.excluded.items()) == list(each.excluded.items())
    assert all(TrainConfig(**c.to_dict()) == c for c in fast.candidates)


def test_a_prechecked_config_is_reset_as_a_checked_one():
    from autotune.train_config import TrainConfig

    values = {**TrainConfig().to_dict(), "method": "full", "lora_rank": 64, "zero_stage": 2}
    assert TrainConfig.prechecked(values) == TrainConfig(**values) and TrainConfig(**values).lora_rank == 8
    values = {**values, "method": "lora", "lora_dropout": 0}
    got = TrainConfig.prechecked(values)
    assert got == TrainConfig(**values) and isinstance(got.lora_dropout, float)
    with pytest.raises(ValueError):
        TrainConfig.prechecked({"zero_stage": 1})
    with pytest.raises(ValueError):
        TrainConfig.prechecked({**{k: v for k, v in values.items() if k != "seq_len"}, "seqlen": 2048})


def test_expand_auto_precision_without_bf16_and_invalid_combinations(tmp_path):
    space = parse_space(
        "zero_stage: [0, 1]\nprecision: [auto, fp16]\nmicro_batch: [1]\nckpt_layers: [0]\n"
        "offload_optimizer: [false, true]\n"
    )
    exp = expand(space, resolve_model("gpt2"), parse_gpus("2xV100"), seq_len=1024)
    # V100 has no bf16: auto -> fp16 (deduplicated with the explicit fp16); offload needs ZeRO >= 1
    assert {(c.zero_stage, c.precision, c.offload_optimizer) for c in exp.candidates} == {
        (0, "fp16", False),
        (1, "fp16", False),
        (1, "fp16", True),
    }
    assert sum(exp.excluded.values()) == 1
    with pytest.raises(SpecError, match="no valid candidate.*fp16 cannot run on CPU"):
        expand(parse_space("precision: [fp16]\n"), resolve_model("gpt2"), parse_gpus("2xcpu@1GiB"), seq_len=64)


def test_cli_bad_space_exits_2_naming_line_and_creates_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUTOTUNE_TRIALS_DIR", str(tmp_path / "trials"))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY))
    bad = tmp_path / "bad.yaml"
    bad.write_text("zero_stage: [0]\n# a comment\nmicro_batch: [1, 2]\nckpt_layer: [0]\n")
    rc = main(["search", "--model", str(cfg), "--gpus", "2xcpu@1GiB", "--space", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "line 4" in err and "'ckpt_layer'" in err and "ckpt_layers" in err
    assert not (tmp_path / "trials").exists()
