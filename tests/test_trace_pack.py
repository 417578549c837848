"""The traces shipped for the presets (autotune/trace_pack.py, autotune/data/shipped_traces.json.gz):
written by this code, equal to what it traces, and enough for a first `autotune estimate` of a
preset to answer without importing torch or transformers."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_memory_hf import WITHOUT_TORCH

from autotune import trace_cache

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


SAMPLE = (
    "estimate --model gpt2 --gpus 4xA100 --impl hf --zero 3 --max-seq-len",
    "estimate --model gpt2 --gpus 4xA100 --method lora --zero 3",
)
"""Two commands of the pack whose entries hold every kind it ships: programs, their family over sequence
lengths, parameter sizes, attention kernels, the optimizer step, the op profile, LoRA's layout and what
is released after the forward."""
KINDS = (
    "program",
    "family",
    "numels",
    "attentions",
    "adamw step",
    "op_profile",
    "lora layout",
    "released after forward",
)


def kind(key: str) -> str:
    return "program" if key.startswith("('{") else key[2:].split("'", 1)[0]


@pytest.mark.slow  # ~25 s: two commands traced afresh; the pack is written centrally, CI checks it. Quick loop:
# what makes it stale (the fingerprint test below), and tests that read it (the shipped_traces fixture)
def test_the_shipped_traces_are_what_this_code_traces(shipped, tmp_path):
    """Written under this fingerprint (the libraries and trace_cache.TRACE_FORMAT), and every entry the
    sample traces afresh, in a new process with an empty cache, is the shipped one, value for value: a
    change to what is traced fails here until `python -m autotune.trace_pack` writes the pack again (and
    TRACE_FORMAT is bumped, so that no user's cache keeps the old entries)."""
    assert PACK["fingerprint"] == trace_cache.fingerprint(), (
        "the libraries or trace_cache.TRACE_FORMAT changed since the shipped traces were written: "
        "run `python -m autotune.trace_pack`"
    )
    from autotune.trace_pack import entries_of

    env = {**os.environ, "AUTOTUNE_SHIPPED_TRACES": "0", "AUTOTUNE_CACHE_DIR": str(tmp_path)}
    for command in SAMPLE:
        assert command in PACK["commands"]
        run = subprocess.run(
            [sys.executable, "-m", "autotune", *command.split()], env=env, capture_output=True, text=True, timeout=300
        )
        assert run.returncode == 0, run.stderr[-2000:]
    traced = entries_of(tmp_path)
    assert {kind(k) for k in traced} == set(KINDS)
    stale = [k[:160] for k, v in traced.items() if PACK["entries"].get(k) != v]
    assert not stale, f"{len(stale)} of {len(traced)} entries differ from the shipped ones, e.g. {stale[:3]}"


def test_a_docstring_edit_keeps_the_fingerprint_and_a_new_trace_format_changes_it(tmp_path):
    """The fingerprint is the libraries and TRACE_FORMAT, not autotune's sources: a copy of autotune/ with
    a docstring edited has this one, a copy with TRACE_FORMAT bumped another."""

    def fingerprint_of(edit) -> str:
        root = tmp_path / edit.__name__
        shutil.copytree(
            Path(trace_cache.__file__).parent,
            root / "autotune",
            ignore=shutil.ignore_patterns("__pycache__", "*.json.gz"),
        )
        edit(root / "autotune")
        out = subprocess.run(
            [sys.executable, "-c", "from autotune import trace_cache as t; print(t.fingerprint())"],
            cwd=root,
            env={**os.environ, "PYTHONPATH": str(root)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout.strip()

    def docstring(pkg):
        path = pkg / "memory" / "buffers.py"
        path.write_text(path.read_text().replace('"""', '"""An edited docstring. ', 1))

    def trace_format(pkg):
        path = pkg / "trace_cache.py"
        path.write_text(
            path.read_text().replace(
                f"TRACE_FORMAT = {trace_cache.TRACE_FORMAT}\n", f"TRACE_FORMAT = {trace_cache.TRACE_FORMAT + 1}\n"
            )
        )

    assert fingerprint_of(docstring) == trace_cache.fingerprint()
    assert fingerprint_of(trace_format) != trace_cache.fingerprint()


@pytest.mark.slow  # traces all of 13B's --max-seq-len (~12 s); quick loop: an answer from the trace cache
# without torch (test_memory_hf's first estimate)
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
