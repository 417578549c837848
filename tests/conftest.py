"""Settings every test process shares: DeepSpeed on CPU, quiet local Ray, with Ray's token authentication on.
Also `quick`, which keeps a few cases of a long parametrisation in the quick loop (`-m "not slow"`), and
`killed_and_resumed`, one real search through the CLI that two test modules read."""

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import pytest
from cases import TINY_LLAMA

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
if not os.environ.get("RAY_AUTH_TOKEN") and not os.environ.get("RAY_AUTH_TOKEN_PATH"):
    # The Ray clusters of a test run use a token of their own (created by autotune, 0600, on first use),
    # not the user's ~/.ray/auth_token, and it goes with the run.
    _token_dir = tempfile.mkdtemp(prefix="autotune-test-ray-")
    os.environ["RAY_AUTH_TOKEN_PATH"] = os.path.join(_token_dir, "auth_token")
    atexit.register(shutil.rmtree, _token_dir, ignore_errors=True)
if not os.environ.get("AUTOTUNE_CACHE_DIR"):
    # Traced programs are kept on disk between runs (autotune/trace_cache.py): a test run starts with an
    # empty cache of its own, so that what it measures does not depend on earlier runs, and leaves
    # the user's alone.
    _cache_dir = tempfile.mkdtemp(prefix="autotune-test-cache-")
    os.environ["AUTOTUNE_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
# Nor do they read the traces shipped for the presets (autotune/trace_pack.py), which would stand in
# for the tracing they test; tests/test_trace_pack.py tests those, and a test that takes the
# `shipped_traces` fixture reads them.
os.environ.setdefault("AUTOTUNE_SHIPPED_TRACES", "0")


@pytest.fixture
def shipped_traces(monkeypatch):
    """For a test of what is done with estimates of a preset (a simulated search), not of how they are
    traced: its estimates read the traces shipped for the presets, as a user's first run does, where they
    were written by this code (trace_cache.shipped). tests/test_trace_pack.py checks that they are this
    code's, and fails when they are stale; until they are written again, such a test traces."""
    monkeypatch.setenv("AUTOTUNE_SHIPPED_TRACES", "1")


def quick(cases, fast):
    """`cases` as pytest params, those not in `fast` marked slow: the quick loop runs a few, CI all."""
    return [pytest.param(*c, marks=() if c in fast else pytest.mark.slow) for c in cases]


@pytest.fixture(scope="session")
def killed_and_resumed(tmp_path_factory):
    """One real search through the CLI, as a user runs it: Ray + DeepSpeed trials of a tiny transformers
    Llama on two CPU ranks under a 12 MiB cap (micro batch 16 with k < L is estimated over it, the rest
    fit), killed with SIGTERM after its first completed trial, then resumed to 3 runs (--exhaustive
    both times: the stopping rule may end this space after 2, and what is tested here is the budget
    across a kill and a resume). What
    test_search checks of the runs and test_report_pictures draws from their study (one search for
    both: about 90 s)."""
    root = tmp_path_factory.mktemp("e2e")
    cfg = root / "tiny" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(TINY_LLAMA))
    trials = root / "trials"
    env = {**os.environ, "AUTOTUNE_TRIALS_DIR": str(trials), "DS_ACCELERATOR": "cpu"}
    space = Path(__file__).resolve().parents[1] / "search_spaces" / "tiny-cpu.yaml"
    base = [
        sys.executable,
        "-m",
        "autotune",
        "search",
        "--model",
        str(cfg),
        "--gpus",
        "2xcpu@12MiB",
        "--seq-len",
        "64",
        "--space",
        str(space),
        "--study",
        "e2e",
        "--n-trials",
        "3",
        "--exhaustive",
        "--no-progress",
    ]
    db = trials / "e2e" / "study.db"
    first = subprocess.Popen(base, env=env, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    end = time.monotonic() + 240
    while (
        time.monotonic() < end and first.poll() is None and not any(r["state"] == "COMPLETE" for r in finished_runs(db))
    ):
        time.sleep(0.5)
    first.send_signal(signal.SIGTERM)
    out1, _ = first.communicate(timeout=120)
    done_before = {json.dumps(r["config"], sort_keys=True) for r in finished_runs(db) if r["state"] == "COMPLETE"}
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune",
            "search",
            "--resume",
            "--study",
            "e2e",
            "--n-trials",
            "3",
            "--exhaustive",
            "--no-progress",
        ],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return types.SimpleNamespace(
        root=root, trials=trials, env=env, db=db, first=first, out1=out1, done_before=done_before, second=second
    )


def finished_runs(db: Path) -> list[dict]:
    """Finished runs in the study database, read with sqlite3 alone (the search process owns Optuna's handle)."""
    import sqlite3

    if not db.exists():
        return []
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            rows = con.execute(
                "select t.number, t.state, a.value_json from trials t join trial_user_attributes a "
                "on a.trial_id = t.trial_id where a.key = 'config'"
            ).fetchall()
    except sqlite3.OperationalError:  # Optuna is still creating its tables
        return []
    return [{"number": n, "state": s, "config": json.loads(v)} for n, s, v in rows]


# Seconds per work unit in a full run on two workers (2026-12-06, 2 cores; `--durations`): the units are
# handed out longest first, so that no long one starts last and runs alone. Order only; no test reads it.
UNIT_SECONDS = {
    "tests/test_memory_hf.py": 232,
    "tests/test_knobs.py": 228,
    "tests/test_trial.py": 194,
    "tests/test_lora.py": 156,
    "tests/test_sequence_parallel.py": 106,
    "tests/test_ray_executor.py": 99,
    "killed_and_resumed": 92,
    "tests/test_hf.py": 87,
    "tests/test_gpu_check.py": 69,
    "tests/test_parallel.py": 66,
    "tests/test_seq_family.py": 55,
    "tests/test_correction.py": 49,
    "tests/test_export_sp.py": 47,
    "tests/test_stopping.py": 47,
}


def work_unit(nodeid: str) -> str:
    """What one xdist worker runs as a whole: a module, so that a module-scoped fixture (real runs of a
    minute or more) is built once; the tests named for the session's `killed_and_resumed` search (in two
    modules) go together, so that it runs once."""
    return "killed_and_resumed" if "killed_and_resumed" in nodeid else nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # before xdist's own
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's two workers (pyproject's addopts: `-n 2 --dist loadscope --no-loadscope-reorder`)
    take `work_unit`s in the order collected. (`--dist loadgroup` would say the grouping with marks, but
    xdist 3.8 cannot rename pytest 9.2's node ids, and ignores them.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByUnit(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The longest work units first (UNIT_SECONDS), the others in file order after them."""
    items.sort(key=lambda item: -UNIT_SECONDS.get(work_unit(item.nodeid), 0))


_EXIT_STATUS = {}


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End a test process (`python -m pytest`, `./run test`) without the interpreter's own teardown, once
    pytest has printed its summary: the exit handlers run (Ray's shutdown, the folders above), then the
    process exits with pytest's status. Measured: one full CI run of 2026-12-01 passed every test and
    then died of a segmentation fault in that teardown (exit status 139), after two runs of the same
    tests that exited cleanly; native library state (torch, gloo, Ray threads) being finalised is the
    likely cause, unconfirmed. Not done where pytest runs inside another program."""
    import sys

    as_pytest = sys.argv[0].endswith(("pytest", "py.test", os.path.join("pytest", "__main__.py")))
    if "status" not in _EXIT_STATUS or not as_pytest:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(_EXIT_STATUS["status"])
