"""The GPU check's measuring and writing: the device gauge, stray ranks, one CSV row per trial,
the Markdown summary. The columns are described in docs/gpu_check.md."""

from __future__ import annotations

import csv
import shutil
import subprocess
import threading
from pathlib import Path

import psutil

from autotune.deepspeed_config import FP16_LOSS_SCALER
from autotune.units import GiB, MiB

POLL_S = 0.5
"""nvidia-smi every half second: a config's peak lasts a whole step (0.05-0.2 s by the cost
model) repeated over 10 steps, and the reserve only grows within a config."""
COLUMNS = [
    "order",
    "group",
    "trial",
    "role",
    "zero",
    "precision",
    "ckpt_layers",
    "micro_batch",
    "status",
    "check",
    "reason",
    "max_allocated_gib",
    "peak_gib",
    "est_tensor_peak_gib",
    "peak_error_pct",
    "max_reserved_gib",
    "fragmentation_gib",
    "est_fragmentation_gib",
    "device_used_gib",
    "non_allocator_gib",
    "est_context_gib",
    "est_overhead_gib",
    "samples_per_s",
    "sim_samples_per_s",
    "speed_ratio",
    "step_time_s",
    "sim_step_time_s",
    "mfu",
    "optimizer_impl",
    "loss_scale_initial",
    "loss_scale_final",
    "overflow_count",
    "warmup_overflow_count",
    "skipped_steps",
    "losses",
    "wall_s",
    "processes_left",
]
SHOWN = [
    ("trial", "trial", "{}"),
    ("status", "status", "{}"),
    ("check", "check", "{}"),
    ("peak_gib", "peak GiB", "{:.2f}"),
    ("est_tensor_peak_gib", "est", "{:.2f}"),
    ("max_reserved_gib", "reserved", "{:.2f}"),
    ("samples_per_s", "samples/s", "{:.2f}"),
    ("sim_samples_per_s", "sim", "{:.2f}"),
    ("optimizer_impl", "optimizer", "{}"),
    ("loss_scale_final", "scale", "{:g}"),
    ("overflow_count", "skipped", "{}"),
]


class Gauge:
    """The device's used memory (nvidia-smi, all processes) during a group, less what was used
    before it: CUDA context, NCCL, cuBLAS and the allocator's reserve of the group's ranks. Device-wide,
    not per pid: in a container nvidia-smi may list host pids, or none."""

    def __init__(self):
        self.smi = shutil.which("nvidia-smi")
        self.before = self.peak = None
        self._stop = threading.Event()

    def used_mib(self) -> float | None:
        if not self.smi:
            return None
        try:
            out = subprocess.run(
                [self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True,
                text=True,
                timeout=10,
            ).stdout
            return float(out.strip().splitlines()[0])
        except (subprocess.SubprocessError, ValueError, IndexError):
            return None

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            v = self.used_mib()
            if v is not None:
                self.peak = max(self.peak or 0.0, v)

    def __enter__(self):
        self.before, self.peak = self.used_mib(), None
        self._stop.clear()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def reading(self) -> dict:
        if self.before is None or self.peak is None:
            return {}
        return {"device_used_gib": max(0.0, self.peak - self.before) * MiB / GiB}


def leftover(root: Path) -> list[int]:
    """Live ranks of the trials under `root`: a rank runs autotune.trial.worker with its payload
    there on its command line (this process, whose own command line names `root`, is not one)."""
    pids = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "autotune.trial.worker" in cmd and str(root) in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            pids.append(p.pid)
    return pids


def _gib(b: int | None) -> float | None:
    return None if b is None else b / GiB


def _check(role: str, res, left: int) -> str:
    """PASS/FAIL for the OOM probe; for a trial ok, `finding` (oom, diverged: an outcome to read) or
    FAIL (crashed, timeout: the GPU path broke). Any rank left behind fails."""
    if left:
        return "FAIL"
    if role == "oom_probe":
        return "PASS" if res.status == "oom" and "OutOfMemoryError" in res.reason else "FAIL"
    return {"ok": "ok", "oom": "finding", "diverged": "finding"}.get(res.status, "FAIL")


def measured(res, cfg, group_reserved: int | None, extra: dict) -> dict:
    """The row's measured columns from a TrialResult (peaks relative to the pre-build baseline)."""
    # Over build, initialize and the steps: the window max_memory_reserved covers (worker.Phases).
    top = max((b for b in (res.peak_bytes, res.init_peak_bytes) if b is not None), default=None)
    alloc = top + (res.baseline_bytes or 0) if top is not None else None
    used = extra.get("device_used_gib")
    return {
        "max_allocated_gib": _gib(alloc),
        "peak_gib": _gib(res.peak_bytes),
        "max_reserved_gib": _gib(res.reserved_bytes),
        "fragmentation_gib": _gib(res.reserved_bytes - alloc) if res.reserved_bytes and alloc else None,
        "device_used_gib": used,
        "non_allocator_gib": used - group_reserved / GiB if used is not None and group_reserved else None,
        "samples_per_s": res.samples_per_s,
        "step_time_s": res.step_time_s,
        "mfu": res.mfu,
        "loss_scale_initial": 2.0 ** FP16_LOSS_SCALER["initial_scale_power"] if cfg.precision == "fp16" else None,
        "loss_scale_final": res.loss_scale,
        "overflow_count": res.overflow_count,
        "warmup_overflow_count": res.warmup_overflow_count,
        "skipped_steps": ";".join(map(str, res.skipped_steps)),
        "optimizer_impl": res.optimizer_impl,
        "losses": ";".join(f"{x:.4g}" for x in res.losses),
        "wall_s": res.wall_s,
    }


def rows_for(todo: list, results: list, entries: dict[str, dict], extra: dict, note: str) -> list[dict]:
    """One row per planned trial of a group; `results` None where it did not run (`note` says why)."""
    reserved = max((r.reserved_bytes or 0 for r in results if r is not None), default=0) or None
    rows = []
    for p, res in zip(todo, results):
        e, c = entries[p.name], p.config
        row = {
            "order": p.order,
            "group": p.group,
            "trial": p.name,
            "role": p.role,
            "zero": c.zero_stage,
            "precision": c.precision,
            "ckpt_layers": c.ckpt_layers,
            "micro_batch": c.micro_batch,
            **{
                k: e[k]
                for k in (
                    "est_tensor_peak_gib",
                    "est_fragmentation_gib",
                    "est_context_gib",
                    "est_overhead_gib",
                    "sim_samples_per_s",
                    "sim_step_time_s",
                )
            },
        }
        if res is None:
            rows.append({**row, "status": "", "check": "not run", "reason": note})
            continue
        row |= measured(res, c, reserved, extra)
        row |= {
            "status": res.status,
            "reason": res.reason.splitlines()[0][:300] if res.reason else "",
            "processes_left": extra.get("processes_left", 0),
            "check": _check(p.role, res, extra.get("processes_left", 0)),
        }
        if row["peak_gib"] is not None and p.role == "trial":
            row["peak_error_pct"] = 100 * (row["peak_gib"] / e["est_tensor_peak_gib"] - 1)
        if res.samples_per_s:
            row["speed_ratio"] = res.samples_per_s / e["sim_samples_per_s"]
        rows.append(row)
        print("  " + "  ".join(_fmt(row, k, f) for k, _, f in SHOWN), flush=True)
    return rows


def _fmt(row: dict, key: str, fmt: str) -> str:
    v = row.get(key)
    return "-" if v is None or v == "" else fmt.format(v)


def write_summary(out: Path, head: dict, rows: list[dict], elapsed_s: float) -> None:
    """gpu_check.csv and summary.md, rewritten whole (through a temporary file and a rename) after
    every group, so that a run killed at any moment leaves the rows it finished, readable."""
    tmp = out / "gpu_check.csv.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
    tmp.replace(out / "gpu_check.csv")
    probe = next((r for r in rows if r["role"] == "oom_probe"), None)
    verdict = f"{probe['check']} ({probe['status'] or '-'}: {probe['reason']})" if probe else "not reached"
    count = {c: sum(r["check"] == c for r in rows) for c in ("FAIL", "finding", "not run")}
    said = [f"- {k}: {v}" for k, v in head.items() if v not in ("", None) and k != "ops_log_tail"]
    if head.get("ops_log_tail"):
        said += ["- FusedAdam build log (tail):", "```", head["ops_log_tail"], "```"]
    lines = [
        "# GPU check\n",
        *said,
        f"- elapsed: {elapsed_s:.0f} s",
        "",
        "## Checks\n",
        f"- first trial ran: {rows[0]['status'] or rows[0]['check'] if rows else 'no'}",
        f"- OOM probe: {verdict}",
        f"- processes left behind: {sum(r.get('processes_left') or 0 for r in rows)}",
        f"- failed: {count['FAIL']}, findings: {count['finding']}, not run: {count['not run']}",
        "",
        "## Trials (all columns in gpu_check.csv; docs/gpu_check.md says what each means)\n",
        "| " + " | ".join(t for _, t, _ in SHOWN) + " |",
        "|" + "---|" * len(SHOWN),
    ]
    lines += ["| " + " | ".join(_fmt(r, k, f) for k, _, f in SHOWN) + " |" for r in rows]
    (out / "summary.md").write_text("\n".join(lines) + "\n")
