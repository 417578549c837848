"""The search as a library: `open_search(...)` opens or resumes a study and returns a session whose `run()`
searches (session.py). The loop is loop.py; the order within a group order.py; the prior prior.py (the CPU
one cpu_prior.py); when it stops stopping.py; the study's storage study.py; the space space.py.

    with open_search(model="13b", gpus="4xA100") as s:
        summary = s.run(n_trials=20)
"""

from autotune.search.loop import Search, Summary
from autotune.search.prior import Prior, default_prior
from autotune.search.session import Inputs, SearchSession, open_search

__all__ = ["Inputs", "Prior", "Search", "SearchSession", "Summary", "default_prior", "open_search"]
