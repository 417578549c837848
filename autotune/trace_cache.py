"""Traced programs kept on disk between runs, for code whose source cannot change under us.

Each estimate of Hugging Face code traces small programs of the module on fake tensors (about 0.2 s
each on this 2-core machine; a 13B search's first grid traces 42 of them, 15-19 s). Their results
depend only on the program's key (code_trace.trace_program: the model's config, precision,
attention, shape, layers, LoRA) and on the code that ran: transformers, peft and torch, and
autotune's own tracer. So they are stored under a fingerprint of those versions and of every
autotune source file, and a later `autotune estimate` or `search` of the same model reads them
back instead of tracing again. So is a program's family over a range of sequence lengths or
micro batches (memory/seq_family.py), or the finding that it is not exact. Any change of those
versions or of autotune's code starts a fresh folder; a user's own module (implementation
`factory`) is never stored, as its file can change between runs without any version saying so.

Where: $AUTOTUNE_CACHE_DIR, else $XDG_CACHE_HOME/autotune, else ~/.cache/autotune; one JSON file
per program, written to a temporary name and renamed, so a crash or a concurrent run never leaves
half a file. An unreadable entry is traced again; a cache that cannot be written is skipped.

Beside the programs, `remembered` keeps the few other facts an estimate of such code reads from
torch or transformers (the class's attention kernels, the module's parameter sizes, the optimizer
step's traced peak, LoRA's adapter layout), so that a later `autotune estimate` imports neither
(tests/test_memory_hf.py runs one with those imports refused).

`in_parallel` runs traces in a forked process that hands them over through this cache: how a first
`autotune estimate` of transformers' code traces on two cores (cli/estimate.py).

Shipped traces: where this cache lacks an entry, `load` reads it from autotune/data/shipped_traces.json.gz,
the same entries written by `python -m autotune.trace_pack` from the estimates of every preset model
(autotune/trace_pack.py). They hold under the same fingerprint only, so the file is used where the
installed torch, transformers and peft and autotune's sources are the ones that wrote it (the
versions `./run` installs, constraints.txt), and ignored otherwise: then everything is traced as
above. AUTOTUNE_SHIPPED_TRACES=0 ignores it too (how benchmarks/estimate_speed.py times a run that
traces).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from functools import cache
from importlib import metadata
from pathlib import Path


def cache_root() -> Path:
    if os.environ.get("AUTOTUNE_CACHE_DIR"):
        return Path(os.environ["AUTOTUNE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "autotune"


def libraries() -> str:
    """The versions of the libraries that run the traced code, one line each."""
    out = []
    for dist in ("torch", "transformers", "peft"):
        try:
            out.append(f"{dist}=={metadata.version(dist)}\n")
        except metadata.PackageNotFoundError:
            out.append(f"{dist} absent\n")
    return "".join(out)


@cache
def fingerprint() -> str:
    """The libraries that run the traced code and autotune's own sources, hashed."""
    h = hashlib.sha256()
    h.update(libraries().encode())
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        h.update(path.relative_to(package).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:20]


def _path(key: tuple) -> Path:
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
    return cache_root() / "traces" / fingerprint() / f"{name}.json"


def load(key: tuple) -> dict | None:
    try:
        entry = json.loads(_path(key).read_text())
    except (OSError, ValueError):
        return shipped().get(repr(key))
    return entry["value"] if entry.get("key") == repr(key) else None  # a hash collision reads as a miss


SHIPPED = Path(__file__).resolve().parent / "data" / "shipped_traces.json.gz"


@cache
def shipped_pack() -> dict:
    """The shipped file as written ({"fingerprint", "libraries", "commands", "entries"}), {} where
    it is absent or unreadable."""
    try:
        with gzip.open(SHIPPED, "rt") as f:
            return json.load(f)
    except (OSError, ValueError, EOFError):
        return {}


def shipped() -> dict:
    """The shipped entries by repr(key), where they were written under this fingerprint; else {}."""
    if os.environ.get("AUTOTUNE_SHIPPED_TRACES", "1") == "0":
        return {}
    pack = shipped_pack()
    return pack.get("entries", {}) if pack.get("fingerprint") == fingerprint() else {}


def store(key: tuple, value: dict) -> None:
    path = _path(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": repr(key), "value": value}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def remembered(key: tuple, compute, keep: bool = True):
    """`compute()`'s JSON value, read from the cache under `key` where a run before stored it: what
    depends only on the fingerprinted code (a Hugging Face class's flags, a module's parameter
    sizes), so that a later run answers without importing that code. `keep` False (code the
    fingerprint does not cover: code_trace.kept_on_disk): computed every time, nothing stored."""
    if not keep:
        return compute()
    value = load(key)
    if value is None:
        value = compute()
        store(key, value)
    return value


def in_parallel(here: list, there: list, *, timeout_s: float = 300.0) -> None:
    """Run the calls in `there` in a forked child process and those in `here` in this one, then wait
    for the child: two cores trace at once. What the child traces reaches this process through
    this cache, so `there` must be calls that store what they make here (transformers' programs;
    a user's module is never stored). A child that fails, or outlives `timeout_s`, costs nothing but
    the time: what it did not store is traced again when it is asked for. Without fork (not
    Linux), everything runs here, in turn."""
    if not there:
        for call in here:
            call()
        return
    if not sys.platform.startswith("linux"):
        for call in here + there:
            call()
        return
    fingerprint()  # hashed once, before the fork, for both processes
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: its calls, then out without the parent's exit handlers or buffers
        code = 1
        try:
            for call in there:
                call()
            code = 0
        finally:
            os._exit(code)
    done = False
    try:
        for call in here:
            call()
        done = True
    finally:
        deadline = time.monotonic() + (timeout_s if done else 0.0)  # interrupted here: the child too
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.002)
