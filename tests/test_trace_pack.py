"""The traces shipped for the presets (autotune/trace_pack.py, autotune/data/shipped_traces.json.gz):
written by this code, equal to what it traces, and enough for a first `autotune estimate` of a
preset to answer without importing torch or transformers."""

import json
import os
import subprocess
import sys

import pytest
from test_memory_hf import WITHOUT_TORCH

from autotune import trace_cache
from autotune.cli import main
from autotune.memory import code_trace

PACK = trace_cache.shipped_pack()


@pytest.fixture
def shipped(monkeypatch):
    if PACK.get("libraries") != trace_cache.libraries():
        pytest.skip(
            f"the installed {trace_cache.libraries()!r} are not the shipped traces' "
            f"{PACK.get('libraries')!r}: they are ignored, and estimates trace (./run installs "
            f"the versions of constraints.txt)"
        )
    monkeypatch.setenv("AUTOTUNE_SHIPPED_TRACES", "1")


def test_the_shipped_traces_are_this_codes(shipped, tmp_path, monkeypatch, capsys):
    """Written under this code's fingerprint, and each entry a first estimate of a preset stores is
    the shipped one, value for value (traced again here: GPT-2's, the smallest preset)."""
    assert PACK["fingerprint"] == trace_cache.fingerprint(), (
        "autotune's sources changed since the shipped traces were written: run `python -m autotune.trace_pack`"
    )
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AUTOTUNE_SHIPPED_TRACES", "0")
    monkeypatch.setattr(code_trace, "_PROGRAMS", {})
    monkeypatch.setattr(code_trace, "_FAMILIES", {})
    args = ["estimate", "--model", "gpt2", "--gpus", "4xA100", "--impl", "hf", "--zero", "3", "--max-seq-len"]
    assert " ".join(args) in PACK["commands"]
    assert main(args) == 0
    capsys.readouterr()
    from autotune.trace_pack import entries_of

    traced = entries_of(tmp_path)
    assert len(traced) >= 5  # programs, their family, parameter sizes, optimizer step, op profile
    for key, value in traced.items():
        assert PACK["entries"].get(key) == value, key[:200]


def test_a_first_estimate_of_a_preset_imports_neither_torch_nor_transformers(shipped, tmp_path):
    """The issue's own command, with an empty trace cache: answered from the shipped traces, the
    answer the same as a run that traces everything."""
    args = ["estimate", "--model", "13b", "--gpus", "4xA100", "--zero", "3", "--max-seq-len", "--json"]
    env = {**os.environ, "AUTOTUNE_SHIPPED_TRACES": "1"}
    first = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *args],
        capture_output=True,
        text=True,
        env={**env, "AUTOTUNE_CACHE_DIR": str(tmp_path / "empty")},
        timeout=300,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    assert not (tmp_path / "empty").exists()  # nothing traced, so nothing stored
    traced = subprocess.run(
        [sys.executable, "-m", "autotune", *args],
        capture_output=True,
        text=True,
        env={**env, "AUTOTUNE_SHIPPED_TRACES": "0", "AUTOTUNE_CACHE_DIR": str(tmp_path / "t")},
        timeout=300,
    )
    assert traced.returncode == 0, traced.stderr[-2000:]
    assert json.loads(first.stdout) == json.loads(traced.stdout)
