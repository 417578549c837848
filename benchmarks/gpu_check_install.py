"""What benchmarks/gpu_check.py needs on a bare GPU machine, installed from the repository alone.

    python benchmarks/gpu_check.py --prepare-wheels      here (network to the package index): fill WHEEL_DIR
    python3 benchmarks/gpu_check.py --install            there (no network): install from WHEEL_DIR

The check runs trials the way `autotune search` does, through autotune's Ray executor: it imports torch, DeepSpeed,
Ray, psutil and pyyaml; the GPU machine lacks DeepSpeed, Ray and their requirements. Its CUDA torch is kept: torch is
never downloaded, and pip, resolving DeepSpeed's `torch>=2.0.0` against what is installed, leaves it. Ray's wheel
(about 78 MB) is carried without what a Ray cluster of trials never loads (trim_ray_wheel), so that the wheels and
the working tree fit the 64 MiB a device call carries.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as md
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL_DIR = ROOT / "build" / "gpu_check_wheels"
"""Under build/, which .gitignore already ignores: carried with the working tree, never committed."""
TARGET_PYTHON = "3.12"
"""The lent GPU machine's python3 (docs/gpu_check.md, "The GPU machine")."""
TARGET_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
"""x86-64 Linux wheels: the manylinux tags PyPI's binary wheels carry (PEP 600, PEP 599)."""
KEEP = {"torch", "numpy"}
"""Requirements never downloaded: the GPU machine's CUDA torch stays (the CPU pin is for CPU machines), and the numpy
every torch image carries (DeepSpeed asks for any numpy; its 16.6 MB wheel would not fit the 64 MiB a call carries)."""
ROOTS = ("deepspeed", "ray")
"""What the check installs, with what they require: DeepSpeed for the trials, Ray for the executor that places them."""
RAY_UNUSED = (
    "ray/jars/",  # Java workers (30.6 MB of the 2.58 wheel's 74 MB compressed); autotune starts Python workers only
    "ray/dashboard/client/",  # the dashboard's web page; autotune starts Ray without a dashboard
    "ray/rllib/",
    "ray/serve/",
    "ray/data/",
    "ray/tune/",
    "ray/train/",
    "ray/llm/",
)
"""Folders of Ray's wheel that a cluster of autotune's tasks never imports (ray/__init__.py imports none of them;
ray.init with include_dashboard=False serves no page; Java workers start only for a job with a Java code search
path, ray/_private/services.py)."""
MAX_CARRY_BYTES = 60 * 2**20
"""A device call carries at most 64 MiB of working tree and carried paths together; the repository takes ~2.3 MB."""
OPS_TIMEOUT_S = 300
"""Pre-building FusedAdam: DeepSpeed JIT-compiles it with nvcc at first use (ops/adam/fused_adam.py,
FusedAdamBuilder().load()): one .cu and one .cpp file, about a minute on a 16-core host (an
expectation, not measured here; the CPU variant took 250 s on 2 shared cores). Past 5 minutes the
8-minute budget has no room left for trials anyway."""


def _canon(name: str) -> str:
    """PEP 503 normalised name: wheel files write py_cpuinfo, requirements py-cpuinfo."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _metadata_requires(wheel: Path) -> list[str]:
    """Requires-Dist lines of a wheel's METADATA (PEP 566)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return [
            ln.split(":", 1)[1].strip() for ln in z.read(meta).decode().splitlines() if ln.startswith("Requires-Dist:")
        ]


def _requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional requirements (no extras, no markers), each pinned to the version
    installed here where there is one: the combination this checkout is tested with. Read from the
    wheel, not from the DeepSpeed installed here: a build for CUDA adds nvidia-ml-py (its setup.py)."""
    out = []
    for req in _metadata_requires(wheel):
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


def trim_ray_wheel(wheel: Path) -> Path:
    """Rewrite Ray's wheel in place without RAY_UNUSED, its RECORD listing only what is kept (PEP 376/427: each entry's
    sha256 and size, which pip checks against the files). Returns the wheel."""
    tmp = wheel.with_suffix(".trimmed")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        kept = []
        for info in src.infolist():
            if info.filename == record or info.filename.startswith(RAY_UNUSED):
                continue
            data = src.read(info)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            kept.append(f"{info.filename},sha256={digest},{len(data)}")
        dst.writestr(record, "\n".join([*kept, f"{record},,"]) + "\n")
    tmp.replace(wheel)
    return wheel


def prepare_wheels(dest: Path = WHEEL_DIR, python: str = TARGET_PYTHON) -> list[Path]:
    """Download DeepSpeed's requirements for `python` (X.Y) and build DeepSpeed itself (an sdist on
    PyPI) into a pure-Python wheel: DS_BUILD_OPS=0 compiles no op ahead of time, DS_ACCELERATOR=cuda
    records the accelerator it is for (git_version_info_installed.py)."""
    dest.mkdir(parents=True, exist_ok=True)
    version = md.version("deepspeed")
    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": "cuda"}
    # --no-build-isolation: DeepSpeed's setup.py imports torch, which is here; --no-cache-dir: a wheel
    # cached from a CPU build would carry accelerator_name 'cpu' and lack the CUDA requirements.
    _pip(
        [
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-cache-dir",
            "--no-binary",
            "deepspeed",
            "-w",
            str(dest),
            f"deepspeed=={version}",
        ],
        env=env,
    )
    platforms = [a for p in TARGET_PLATFORMS for a in ("--platform", p)]
    target = ["--python-version", python, "--implementation", "cp", *platforms]
    ray_version = md.version("ray")
    _pip(["download", "-q", "--no-deps", "-d", str(dest), "--only-binary=:all:", *target, f"ray=={ray_version}"])
    ray_wheel = next(dest.glob(f"ray-{ray_version}-*.whl"))
    before = ray_wheel.stat().st_size
    trim_ray_wheel(ray_wheel)
    print(
        f"[gpu-check] {ray_wheel.name}: {before / 2**20:.1f} -> {ray_wheel.stat().st_size / 2**20:.1f} MiB", flush=True
    )
    _pip(
        [
            "download",
            "-q",
            "-d",
            str(dest),
            "--only-binary=:all:",
            "--python-version",
            python,
            "--implementation",
            "cp",
            *platforms,
            *_requirements(dest / f"deepspeed-{version}-py3-none-any.whl"),
            *_requirements(ray_wheel),
        ]
    )
    wheels = sorted(dest.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels)
    print(f"[gpu-check] {len(wheels)} wheels, {total / 2**20:.1f} MiB in {dest}", flush=True)
    if total > MAX_CARRY_BYTES:
        raise SystemExit(f"[gpu-check] {total / 2**20:.1f} MiB of wheels: more than a device call can carry")
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


def _missing(source: Path) -> list[Path]:
    """The wheels in `source` that DeepSpeed needs here: its own unless that version is installed,
    then, following requirements from it, each distribution absent or outside the required versions.
    What is installed and fits (torch above all) is left alone."""
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip carries its own copy
        from pip._vendor.packaging.requirements import Requirement
    wheels = {_canon(w.name.split("-")[0]): w for w in source.glob("*.whl")}
    for root in ROOTS:
        if root not in wheels:
            raise SystemExit(
                f"[gpu-check] {source} holds no {root} wheel: run `python benchmarks/gpu_check.py "
                f"--prepare-wheels` on a machine with the package index, and carry that folder"
            )
    out, todo = [], [(root, wheels[root].name.split("-")[1]) for root in ROOTS]
    while todo:
        name, spec = todo.pop()
        have = installed(name)
        fits = have is not None and (
            spec == have if name in ROOTS else Requirement(f"x{spec}").specifier.contains(have, prereleases=True)
        )
        if fits or name in KEEP or wheels.get(name) in out:
            continue
        if name not in wheels:
            raise SystemExit(f"[gpu-check] {name}{spec} is needed, not installed, and not in {source}")
        out.append(wheels[name])
        for text in _metadata_requires(wheels[name]):
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append((_canon(req.name), str(req.specifier)))
    return out


def install(source: Path = WHEEL_DIR) -> dict:
    """Install what DeepSpeed lacks here from `source`, with no index and no resolver (--no-deps:
    pip would otherwise re-check torch's own requirements, and fail without an index on any it
    dislikes); then import it in a child to prove it. torch must come out unchanged. Timed."""
    t0 = time.monotonic()
    torch_before = installed("torch")
    todo = _missing(source)
    if todo:
        extra = ["--break-system-packages"] if _externally_managed() else []
        _pip(["install", "-q", "--no-index", "--no-deps", *extra, *map(str, todo)])
    probe = subprocess.run(
        [sys.executable, "-c", "import ray, deepspeed; print(ray.__version__); print(deepspeed.__version__)"],
        capture_output=True,
        text=True,
    )
    if probe.returncode:
        raise SystemExit(f"[gpu-check] ray or deepspeed does not import after the install:\n{probe.stderr[-2000:]}")
    if installed("torch") != torch_before:
        raise SystemExit(f"[gpu-check] the install changed torch {torch_before} -> {installed('torch')}")
    took, names = time.monotonic() - t0, ", ".join(w.name.split("-")[0] for w in todo) or "nothing"
    print(
        f"[gpu-check] installed {names} in {took:.1f} s; ray {installed('ray')} and deepspeed "
        f"{probe.stdout.strip().splitlines()[-1]} import; torch {torch_before} kept",
        flush=True,
    )
    return {
        "install_s": round(took, 1),
        "installed": names,
        "deepspeed": installed("deepspeed"),
        "ray": installed("ray"),
        "torch": torch_before,
    }


PREBUILD = "from deepspeed.ops.op_builder import FusedAdamBuilder; FusedAdamBuilder().load(verbose=False)"


def prebuild_ops() -> dict:
    """Compile FusedAdam once, before any trial, into torch's extension cache, where every rank's
    deepspeed.initialize then finds it: the compile would otherwise count in the first trial's time. Only where
    DeepSpeed can build it (autotune.trial.ops.fused_adam, what the executor asks each node); elsewhere the trials run
    torch's fused AdamW and say so. The child builds for the accelerator the ranks get (DS_ACCELERATOR=cuda, as
    autotune/trial/launch.py sets it for GPU ranks)."""
    from autotune.trial import ops

    ok, why = ops.fused_adam()
    if not ok:
        print(f"[gpu-check] FusedAdam cannot be built here ({why}): the trials run torch's fused AdamW", flush=True)
        return {"ops_ok": False, "ops_s": 0.0, "ops_log_tail": "", "fused_adam": why}
    env = {**os.environ, "DS_ACCELERATOR": "cuda"}
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        try:
            rc = subprocess.run(
                [sys.executable, "-c", PREBUILD], env=env, stdout=log, stderr=subprocess.STDOUT, timeout=OPS_TIMEOUT_S
            ).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        log.seek(0)
        tail = log.read()[-1500:]
    took = time.monotonic() - t0
    ok = rc == 0
    print(
        f"[gpu-check] FusedAdam {'built' if ok else 'NOT built'} in {took:.1f} s"
        + ("" if ok else f" (exit {rc}), although DeepSpeed's checks said it could be ({why}):\n{tail}"),
        flush=True,
    )
    return {"ops_ok": ok, "ops_s": took, "ops_log_tail": "" if ok else tail, "fused_adam": why}
