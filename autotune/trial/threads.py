"""How many threads a rank computes with: decided here, used by the launcher, the Ray executor and
the CPU prior, so that what the prior times is what a trial runs with.

A node's cores are split evenly among the ranks of the trials that run on it at once. By default
one trial runs at a time (`autotune search --concurrent-trials N` asks for more): two trials on the
same cores compete for them, and each one's samples/s would then depend on what else runs.
"""

from __future__ import annotations

import os


def cpu_threads_per_rank(ranks_per_node: int, concurrent_trials: int = 1, cores: int | None = None) -> int:
    """Threads for each of `ranks_per_node` ranks when `concurrent_trials` trials share `cores`
    (default: this machine's) - at least one."""
    cores = cores or os.cpu_count() or 1
    return max(1, cores // max(1, ranks_per_node * concurrent_trials))
