"""Settings every test process shares: DeepSpeed on CPU, quiet local Ray, with Ray's token authentication on.
Also `quick`, which keeps a few cases of a long parametrisation in the quick loop (`-m "not slow"`),
`shipped_traces`, and `killed_and_resumed`, one real search through the CLI that two test modules read.
The model shapes tests share are tests/cases.py's."""

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
    # A test run starts with an empty trace cache of its own (autotune/trace_cache.py): what it measures
    # does not depend on earlier runs, and the user's is left alone.
    _cache_dir = tempfile.mkdtemp(prefix="autotune-test-cache-")
    os.environ["AUTOTUNE_CACHE_DIR"] = _cache_dir
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
# Nor the traces shipped for the presets (autotune/trace_pack.py), which would stand in for the tracing
# they test; a test that takes the `shipped_traces` fixture reads them.
os.environ.setdefault("AUTOTUNE_SHIPPED_TRACES", "0")


@pytest.fixture
def shipped_traces(monkeypatch):
    """For a test of what is done with estimates of a preset (a plan, a search's decisions), not of how they
    are traced: its estimates read the traces shipped for the presets, as a user's first run does
    (trace_cache.shipped). tests/test_trace_pack.py fails when they are not this code's; until they are
    written again, such a test traces."""
    monkeypatch.setenv("AUTOTUNE_SHIPPED_TRACES", "1")


@pytest.fixture(scope="module")
def shipped_traces_module():
    """`shipped_traces` for a whole module whose module-scoped fixtures estimate presets
    (`pytestmark = pytest.mark.usefixtures("shipped_traces_module")`)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AUTOTUNE_SHIPPED_TRACES", "1")
        yield


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


# Seconds per work unit on two workers, 2 cores (`--durations=0`): the units are handed out longest first, so
# that no long one starts last and runs alone. Order only; no test reads them. UNIT_SECONDS: a full run
# (2026-12-06); QUICK_UNIT_SECONDS: `-m "not slow"` (2026-12-07).
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
QUICK_UNIT_SECONDS = {
    "tests/test_memory_hf.py": 27,
    "tests/test_hf.py": 19,
    "tests/test_search.py": 13,
    "tests/test_traced.py": 11,
    "tests/test_lora.py": 10,
    "tests/test_plan.py": 9,
    "tests/test_parallel.py": 8,
    "tests/test_costops.py": 8,
    "tests/test_security.py": 6,
    "tests/test_memory_measured.py": 6,
    "tests/test_seq_family.py": 5,
    "tests/test_interrupts.py": 5,
    "tests/test_reads_memo.py": 5,
    "tests/test_costmodel.py": 4,
}
SAME_UNIT = {"tests/test_plan_interconnect.py": "tests/test_plan.py"}
"""Modules that estimate the same programs run in one worker, which traces them once."""


def work_unit(nodeid: str) -> str:
    """What one xdist worker runs as a whole: a module, so that a module-scoped fixture (real runs of a
    minute or more) is built once, or modules of SAME_UNIT together; the tests named for the session's
    `killed_and_resumed` search (in two modules) go together, so that it runs once."""
    if "killed_and_resumed" in nodeid:
        return "killed_and_resumed"
    module = nodeid.split("::", 1)[0]
    return SAME_UNIT.get(module, module)


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
    """The longest work units first (UNIT_SECONDS; QUICK_UNIT_SECONDS when no slow test is selected), the
    others in file order after them."""
    seconds = UNIT_SECONDS if any(item.get_closest_marker("slow") for item in items) else QUICK_UNIT_SECONDS
    items.sort(key=lambda item: -seconds.get(work_unit(item.nodeid), 0))


_EXIT_STATUS = {}


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End a test process (`python -m pytest`, `./run test`) without the interpreter's own teardown, once
    pytest has printed its summary and the exit handlers have run (Ray's shutdown, the folders above): a
    CI run that passed every test once died of a segfault in that teardown (docs/measurements/trials.md,
    "The test suite's processes"). Not done where pytest runs inside another program."""
    import sys

    as_pytest = sys.argv[0].endswith(("pytest", "py.test", os.path.join("pytest", "__main__.py")))
    if "status" not in _EXIT_STATUS or not as_pytest:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    atexit._run_exitfuncs()
    os._exit(_EXIT_STATUS["status"])
