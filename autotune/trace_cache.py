"""Traced programs kept on disk between runs, so that a second estimate of the same model reads what the
first one traced (a 13B search's first grid traces 42 small programs, 15-19 s on 2 cores).

A program's result depends on its key (code_trace.trace_program: config, precision, attention, shape,
layers, LoRA) and on the code that ran it: torch, transformers, peft and autotune's tracer. Entries live
under `fingerprint()`: those library versions and `TRACE_FORMAT`, which a change to what autotune traces
or how it reads a trace must bump. autotune's other sources are not in it, so editing a docstring or the
CLI keeps every cache and the shipped traces valid; tests/test_trace_pack.py re-traces a sample of the
shipped entries and fails, value by value, when the tracing changed without a new pack. A user's own
module (implementation `factory`) is never stored: its file can change without any version saying so.

Where: $AUTOTUNE_CACHE_DIR, else $XDG_CACHE_HOME/autotune, else ~/.cache/autotune; one JSON file per
entry, written to a temporary name and renamed. An unreadable entry is traced again; a cache that cannot
be written is skipped. `remembered` keeps the few facts an estimate reads from torch or transformers
(attention kernels, parameter sizes, the optimizer step's peak, LoRA's layout), so that a later estimate
imports neither. `in_parallel` traces in a forked process that hands its results over through this cache.

Shipped traces: where the cache lacks an entry, `load` reads autotune/data/shipped_traces.json.gz,
written by `python -m autotune.trace_pack` from the estimates of every preset, when it was written under
this fingerprint (the versions of constraints.txt). AUTOTUNE_SHIPPED_TRACES=0 ignores it.
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


TRACE_FORMAT = 4
"""Bump when what autotune traces, or how it turns a trace into an entry, changes: every cache and the
shipped traces then start afresh (`python -m autotune.trace_pack` writes the pack again)."""


@cache
def fingerprint() -> str:
    """The libraries that run the traced code and the trace format, hashed."""
    return hashlib.sha256(f"{libraries()}format {TRACE_FORMAT}\n".encode()).hexdigest()[:20]


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
