"""The executor contract: a TrialRequest goes in, a TrialResult comes back as a value
(both are autotune.trial.record's; the executors only decide where a trial runs)."""

from __future__ import annotations

import abc
from typing import Literal

from autotune.trial.record import TrialRequest, TrialResult


class Executor(abc.ABC):
    """Runs trials; several at once when it has room. Results come back as values."""

    source: Literal["measured", "simulated"] = "measured"

    @abc.abstractmethod
    def slots(self) -> int:
        """How many trials can run at the same time."""

    @abc.abstractmethod
    def submit(self, request: TrialRequest) -> str:
        """Start a trial; returns a ticket."""

    @abc.abstractmethod
    def wait_any(self, timeout_s: float | None = None) -> list[tuple[str, TrialResult]]:
        """Block until at least one submitted trial finishes (or timeout); return the finished ones."""

    def close(self) -> None:
        """Release workers; running trials are killed."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
