"""Ctrl-C and SIGTERM during a search: what was interrupted, and the writes a signal must wait for.

A trial is written to the study in several database calls (Optuna's `ask`, then one call per user
attr; its end: the result's attrs, then `tell`). A signal that lands between two of them left a
trial with its config but no status, or FAIL with no reason. So the calls that belong together run
under `held()`: a SIGINT or SIGTERM that arrives inside is kept, and delivered again, to the handler
that was in place, once they are written. Outside `held()` a signal acts at once, so a running trial
is cut short when the user asks (the executor kills its ranks) and recorded as `interrupted`.
"""

from __future__ import annotations

import contextlib
import signal
import threading

SIGNALS = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM"}


class Interrupted(KeyboardInterrupt):
    """A KeyboardInterrupt that says which signal raised it."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


def why(exc: BaseException) -> str:
    """A sentence's subject for what ended the search: the signal, or the error."""
    if isinstance(exc, Interrupted):
        return exc.why
    if isinstance(exc, KeyboardInterrupt):
        return SIGNALS[signal.SIGINT]
    return f"an error ({type(exc).__name__}: {str(exc)[:200]})"


def raise_interrupted(signum: int, frame) -> None:
    """A signal handler: SIGTERM (or SIGINT) ends a search as Ctrl-C does, naming the signal."""
    raise Interrupted(SIGNALS.get(signum, f"signal {signum}"))


@contextlib.contextmanager
def held():
    """SIGINT and SIGTERM that arrive inside wait until the block is done, then act as they would
    have (the first one; a second is the same request). Only the main thread receives signals, so
    elsewhere this holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    previous = {s: signal.getsignal(s) for s in SIGNALS}
    for s in SIGNALS:
        signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if pending:
            signal.raise_signal(pending[0])
