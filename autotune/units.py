"""The only unit conversions in autotune.

Bytes are kept as ints everywhere inside; conversion happens at the edge (printing).
GiB is 1024**3 bytes, GB is 1000**3 bytes: said once, here. NVIDIA's "80 GB" A100 reports
81,920 MiB (= 80 GiB) in nvidia-smi, so GPU presets state capacity in MiB as the driver
reports it, each with its source.
"""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 10**9
TFLOPS = 10**12
GB_PER_S = GB
"""Bandwidths in the presets are GB/s: 10**9 bytes per second, as datasheets state them."""


def fmt_bytes(num_bytes: float) -> str:
    """Human-readable binary size: '1.50 GiB', '12.0 MiB', '512 B'."""
    n = float(num_bytes)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{sign}{n / size:.2f} {unit}"
    return f"{sign}{int(n)} B"


def fmt_count(n: float) -> str:
    """Parameter counts: 13.02B, 124.4M, 8.3K."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def parse_duration_s(text: str) -> float:
    """'90', '90s', '15m', '2h', '1h30m' -> seconds. Raises ValueError with the grammar."""
    import re

    s = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", s):
        return float(s)
    parts = re.findall(r"(\d+(?:\.\d+)?)([hms])", s)
    if not parts or "".join(a + b for a, b in parts) != s:
        raise ValueError(f"bad duration {text!r}: use seconds or a mix of h/m/s, e.g. 90, 15m, 1h30m")
    scale = {"h": 3600, "m": 60, "s": 1}
    return sum(float(a) * scale[b] for a, b in parts)
