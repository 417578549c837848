"""The import contracts of pyproject.toml (`[tool.importlinter]`): data flows one way through autotune's
packages (specs -> estimate -> prune or run -> result -> report), and memory/ imports down its layers.
`lint-imports` checks them (imports inside functions count too); `./run lint` runs it with ruff."""

import subprocess
import sys
from pathlib import Path

import autotune.memory

ROOT = Path(__file__).resolve().parents[1]


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run([str(lint)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken." in out.stdout


def test_the_public_names_of_autotune_memory_stay():
    for name in ("estimate", "MemoryEstimate", "builtin"):
        assert callable(getattr(autotune.memory, name)), name
