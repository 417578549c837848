"""What benchmarks/gpu_check.py needs on a bare GPU machine, installed from the repository alone.

    python benchmarks/gpu_check.py --prepare-wheels      here (network to the package index): fill WHEEL_DIR
    python3 benchmarks/gpu_check.py --install            there (no network): install from WHEEL_DIR

The trial path (autotune/trial) imports torch, DeepSpeed, psutil and pyyaml; of these the GPU
machine lacks only DeepSpeed and its requirements. Its CUDA torch is kept: torch is never
downloaded, and pip, resolving DeepSpeed's `torch>=2.0.0` against what is installed, leaves it.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL_DIR = ROOT / "build" / "gpu_check_wheels"
"""Under build/, which .gitignore already ignores: carried with the working tree, never committed."""
TARGET_PYTHON = "3.12"
"""The lent GPU machine's python3 (docs/gpu_check.md, "The GPU machine")."""
TARGET_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
"""x86-64 Linux wheels: the manylinux tags PyPI's binary wheels carry (PEP 600, PEP 599)."""
KEEP = {"torch"}
"""Requirements never downloaded: the GPU machine's CUDA torch stays (the CPU pin is for CPU machines)."""
OPS_TIMEOUT_S = 600
"""Pre-building FusedAdam: DeepSpeed JIT-compiles it with nvcc at first use (ops/adam/fused_adam.py,
FusedAdamBuilder().load()); two source files, about a minute with ninja on a 16-core host."""


def _requirements(dist: str) -> list[str]:
    """`dist`'s unconditional requirements (no extras, no markers), each pinned to the version
    installed here: the combination this checkout is tested with."""
    out = []
    for req in md.requires(dist) or []:
        if ";" in req:
            continue
        name = re.match(r"[A-Za-z0-9_.\-]+", req).group(0)
        if name.lower() in KEEP:
            continue
        try:
            out.append(f"{name}=={md.version(name)}")
        except md.PackageNotFoundError:
            out.append(req)
    return out


def _pip(args: list[str], env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    print("[gpu-check] $ " + " ".join(cmd[1:]), flush=True)
    subprocess.run(cmd, check=True, env=env)


def prepare_wheels(dest: Path = WHEEL_DIR) -> list[Path]:
    """Download DeepSpeed's requirements for TARGET_PYTHON and build DeepSpeed itself (an sdist on
    PyPI) into a pure-Python wheel: DS_BUILD_OPS=0 compiles no op ahead of time, DS_ACCELERATOR=cuda
    records the accelerator it is for (git_version_info_installed.py)."""
    dest.mkdir(parents=True, exist_ok=True)
    version = md.version("deepspeed")
    platforms = [a for p in TARGET_PLATFORMS for a in ("--platform", p)]
    _pip(["download", "-q", "-d", str(dest), "--only-binary=:all:", "--python-version", TARGET_PYTHON,
          "--implementation", "cp", *platforms, *_requirements("deepspeed")])
    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cuda"}
    # --no-build-isolation: DeepSpeed's setup.py imports torch, which is here; --no-cache-dir: a wheel
    # cached from a CPU build would carry accelerator_name 'cpu'.
    _pip(["wheel", "-q", "--no-deps", "--no-build-isolation", "--no-cache-dir", "--no-binary", "deepspeed",
          "-w", str(dest), f"deepspeed=={version}"], env=env)
    wheels = sorted(dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    print(f"[gpu-check] {len(wheels)} wheels, {total / 2**20:.1f} MiB in {dest}", flush=True)
    return wheels


def _externally_managed() -> bool:
    """PEP 668: a distribution's Python refuses pip installs outside a venv unless told."""
    in_venv = sys.prefix != sys.base_prefix
    return not in_venv and Path(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED").exists()


def installed(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def install(source: Path = WHEEL_DIR) -> dict:
    """Install DeepSpeed from `source` with no index; torch must come out unchanged. Timed."""
    t0 = time.monotonic()
    torch_before = installed("torch")
    wheels = sorted(source.glob("deepspeed-*.whl"))
    want = wheels[-1].name.split("-")[1] if wheels else None
    have = installed("deepspeed")
    if have and (want is None or have == want):
        return {"install_s": 0.0, "deepspeed": have, "torch": torch_before, "note": "already installed"}
    if not wheels:
        raise SystemExit(f"[gpu-check] deepspeed is not installed and {source} holds no deepspeed wheel: "
                         f"run `python benchmarks/gpu_check.py --prepare-wheels` on a machine with the index")
    extra = ["--break-system-packages"] if _externally_managed() else []
    _pip(["install", "-q", "--no-index", "--find-links", str(source), *extra, f"deepspeed=={want}"])
    if installed("torch") != torch_before:
        raise SystemExit(f"[gpu-check] the install changed torch {torch_before} -> {installed('torch')}")
    took = time.monotonic() - t0
    print(f"[gpu-check] installed deepspeed {want} in {took:.1f} s (torch {torch_before} kept)", flush=True)
    return {"install_s": took, "deepspeed": want, "torch": torch_before, "note": f"from {source.name}"}


PREBUILD = "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load(verbose=False)"


def prebuild_ops() -> dict:
    """Compile FusedAdam once, before any trial, into torch's extension cache, where every rank's
    deepspeed.initialize then finds it: the compile would otherwise count in the first trial's time
    and could pass its timeout. Fails where there is no nvcc (a pip-only CUDA torch has none), and
    then every GPU trial fails in deepspeed.initialize: said here, before any trial is spent."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        try:
            rc = subprocess.run([sys.executable, "-c", PREBUILD], env=env, stdout=log, stderr=subprocess.STDOUT,
                                timeout=OPS_TIMEOUT_S).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        log.seek(0)
        tail = log.read()[-1500:]
    took = time.monotonic() - t0
    ok = rc == 0
    print(f"[gpu-check] FusedAdam {'built' if ok else 'NOT built'} in {took:.1f} s"
          + ("" if ok else f" (exit {rc}); every trial will fail in deepspeed.initialize:\n{tail}"), flush=True)
    return {"ops_ok": ok, "ops_s": took, "ops_log_tail": "" if ok else tail}
