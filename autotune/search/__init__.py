"""The search, as a library: `open_search(...)` opens or resumes a study and returns a session whose
`run()` searches (session.py); the loop (loop.py), the order a group is tried in (order.py), when it
stops (stopping.py), the priors (cpu_prior.py and loop.default_prior), the study's storage (study.py)
and the space (space.py).

    with open_search(model="13b", gpus="4xA100") as s:
        summary = s.run(n_trials=20)
"""

from autotune.search.loop import Search, Summary
from autotune.search.session import Inputs, SearchSession, open_search

__all__ = ["Inputs", "Search", "SearchSession", "Summary", "open_search"]
