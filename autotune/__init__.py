"""autotune: find the fastest DeepSpeed configuration for an LLM on given GPUs.

Data flows one way: inputs become specs (`models`, `hardware`), specs and a `TrainConfig`
(`space`) become a memory estimate (`memory`), the estimate decides prune-or-run, a run
(`trial`, `executors`) becomes a result, results become a report and an export.
"""

__version__ = "0.1.0"
