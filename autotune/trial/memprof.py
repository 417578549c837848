"""Peak tensor memory of a trial: from the profiler's allocation events on CPU, from the caching
allocator's counters on GPU; every figure relative to the live bytes just before the config's model is
built, so a config does not inherit what an earlier one in the process left.

CPU (docs/platform.md "Peak memory without a GPU"): with c10's FLAGS_caffe2_report_cpu_memory_usage set,
ProfiledCPUMemoryReporter stamps the process's live CPU tensor bytes on every allocation event
(`total_allocated`, c10/core/CPUAllocator.cpp), frees in gloo's unrecorded threads included: the true
live-bytes curve, what `torch.cuda.max_memory_allocated` counts on a GPU. Set it before the tensors to be
counted are allocated (an earlier block's free is not counted).
"""

from __future__ import annotations

import bisect
import ctypes
import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch._C._profiler import _EventType, _ExtraFields_Allocation

MARK = "autotune."
"""Prefix of the record_function ranges the worker opens (autotune.init, autotune.step3, ...)."""


def enable_cpu_memory_reporting() -> None:
    """Set c10's FLAGS_caffe2_report_cpu_memory_usage (see the module docstring). Idempotent."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so")
    ctypes.c_bool.in_dll(ctypes.CDLL(lib), "FLAGS_caffe2_report_cpu_memory_usage").value = True


def _walk(events):
    stack = list(events)
    while stack:
        e = stack.pop()
        yield e
        stack.extend(e.children)


def _origin(e) -> str:
    """The op that allocated: the nearest ancestor that is not a bare allocation op, and its parent."""
    names, p = [], e.parent
    while p is not None and len(names) < 2:
        if not (p.name.startswith("aten::empty") or p.name in ("aten::zeros", "aten::new_empty")):
            names.append(p.name)
        p = p.parent
    return " < ".join(names) or "(outside any op)"


@dataclass
class CpuCurve:
    """The live CPU tensor bytes after each allocation event, in time order."""

    times_ns: list[int]
    live_bytes: list[int]
    """Absolute live bytes (since the c10 flag was set)."""
    sizes: list[int]
    ptrs: list[int]
    events: list
    """The allocation events themselves, for the tables (their parents name the allocating op)."""
    ranges: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """record_function name -> [(start_ns, end_ns)] for the autotune.* ranges."""

    @classmethod
    def from_profiler(cls, prof) -> "CpuCurve":
        """From a stopped torch.autograd.profiler.profile or torch.profiler.profile (memory on)."""
        results = prof.kineto_results if hasattr(prof, "kineto_results") else prof.profiler.kineto_results
        allocs, ranges = [], defaultdict(list)
        for e in _walk(results.experimental_event_tree()):
            if e.tag == _EventType.Allocation:
                f = e.extra_fields
                if isinstance(f, _ExtraFields_Allocation) and f.device.type == "cpu":
                    allocs.append((e.start_time_ns, f.total_allocated, f.alloc_size, f.ptr, e))
            elif e.tag == _EventType.TorchOp and e.name.startswith(MARK):
                ranges[e.name].append((e.start_time_ns, e.end_time_ns))
        allocs.sort(key=lambda a: a[0])
        for spans in ranges.values():
            spans.sort()
        return cls(
            times_ns=[a[0] for a in allocs],
            live_bytes=[a[1] for a in allocs],
            sizes=[a[2] for a in allocs],
            ptrs=[a[3] for a in allocs],
            events=[a[4] for a in allocs],
            ranges=dict(ranges),
        )

    @property
    def baseline_bytes(self) -> int:
        """Live bytes just before the first event of the window."""
        return self.live_bytes[0] - self.sizes[0] if self.live_bytes else 0

    def live_at(self, t_ns: int) -> int:
        """Absolute live bytes at time t (after every event up to t)."""
        i = bisect.bisect_right(self.times_ns, t_ns)
        return self.live_bytes[i - 1] if i else self.baseline_bytes

    def peak(self, start_ns: int, end_ns: int) -> tuple[int, int]:
        """(peak bytes over [start, end] relative to the baseline, the time of that peak)."""
        lo, hi = bisect.bisect_left(self.times_ns, start_ns), bisect.bisect_right(self.times_ns, end_ns)
        best, t_best = self.live_at(start_ns), start_ns
        for i in range(lo, hi):
            if self.live_bytes[i] > best:
                best, t_best = self.live_bytes[i], self.times_ns[i]
        return best - self.baseline_bytes, t_best

    def span(self, name: str, index: int = -1) -> tuple[int, int]:
        return self.ranges[name][index]

    def phase_peaks(self, step: str) -> dict[str, int]:
        """Peak per phase (forward, backward, optimizer) inside the range `step`, relative to baseline."""
        return {phase: peak for phase, (peak, _) in self.phase_peak_times(step).items()}

    def phase_peak_times(self, step: str) -> dict[str, tuple[int, int]]:
        """(peak relative to baseline, its time) per phase inside the range `step`."""
        s0, s1 = self.span(step)
        out = {}
        for phase in ("forward", "backward", "optimizer"):
            inside = [sp for sp in self.ranges.get(MARK + phase, []) if s0 <= sp[0] and sp[1] <= s1]
            if inside:
                out[phase] = max(self.peak(a, b) for a, b in inside)
        return out

    def _group(self, indices) -> dict[str, list[int]]:
        """Allocation events by allocating op: {origin: [bytes, count]}."""
        groups: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for i in indices:
            g = groups[_origin(self.events[i])]
            g[0] += self.sizes[i]
            g[1] += 1
        return groups

    def live_table(self, t_ns: int, limit: int = 25) -> str:
        """The tensors live at time t, grouped by the op that allocated them (biggest first).

        Blocks allocated before the window (the baseline) or in threads the profiler does not record
        are not attributed; the table says how many bytes that leaves unexplained.
        """
        live: dict[int, int] = {}
        for i in range(bisect.bisect_right(self.times_ns, t_ns)):
            if self.sizes[i] > 0:
                live[self.ptrs[i]] = i
            else:
                live.pop(self.ptrs[i], None)
        groups = self._group(live.values())
        total = self.live_at(t_ns) - self.baseline_bytes
        attributed = sum(g[0] for g in groups.values())
        lines = [
            f"live tensor bytes at the peak (relative to the baseline): {total:,}",
            f"baseline (live before the model was built): {self.baseline_bytes:,}",
            f"{'bytes':>16} {'tensors':>8}  allocated by (op < caller)",
        ]
        for origin, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:limit]:
            lines.append(f"{size:>16,} {count:>8}  {origin}")
        lines.append(
            f"{total - attributed:>16,} {'':>8}  difference: blocks freed or allocated where the "
            f"profiler records no event (gloo threads, the baseline)"
        )
        return "\n".join(lines)

    def alloc_table(self, limit: int = 25) -> str:
        """The profiler's allocation table over the whole window: bytes allocated per op (a sum of
        allocations, not a peak), the same grouping as the live table."""
        groups = self._group(i for i, size in enumerate(self.sizes) if size > 0)
        lines = [
            "allocations over the whole window (model build to the last step):",
            f"{'bytes allocated':>16} {'count':>8}  allocated by (op < caller)",
        ]
        for origin, (size, count) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:limit]:
            lines.append(f"{size:>16,} {count:>8}  {origin}")
        return "\n".join(lines)


class GpuPhases:
    """Peak bytes per phase on a GPU: reset the allocator's high-water mark at each phase start.

    No device synchronization: the caching allocator keeps its counters on the host and updates them when a block is
    handed out or returned, which happens as the host enqueues the work, not when the device runs it
    (c10/cuda/CUDACachingAllocator.cpp: DeviceStats, updated in malloc/free); reading or resetting them
    (torch.cuda.memory_allocated, max_memory_allocated, reset_peak_memory_stats) only reads host state. Six syncs per
    micro batch (two per phase) inside the timed step would have stalled the host's run-ahead of the device."""

    def __init__(self, device: torch.device):
        self.device = device
        torch.cuda.synchronize(device)  # once, before the window: whatever was queued before has run
        self.baseline_bytes = torch.cuda.memory_allocated(device)

    def start(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        """Peak allocated bytes since start(), relative to the baseline."""
        return torch.cuda.max_memory_allocated(self.device) - self.baseline_bytes

    def live(self) -> int:
        """Allocated bytes now, relative to the baseline."""
        return torch.cuda.memory_allocated(self.device) - self.baseline_bytes

    def reserved(self) -> int:
        return torch.cuda.max_memory_reserved(self.device)
