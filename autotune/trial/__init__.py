"""Real trials: one process group of N ranks trains the model under DeepSpeed (through autotune/impl/:
the Hugging Face code by default, docs/models.md) and reports measured speed and memory (docs/trials.md).

    run_trial(request) -> TrialResult               one trial here
    run_trials(requests) -> list[TrialResult]       several configs in one process group

Imported lazily so that `python -m autotune.trial.worker` does not load the launcher first.
"""

__all__ = ["run_trial", "run_trials"]


def __getattr__(name: str):
    if name in __all__:
        from autotune.trial import launch

        return getattr(launch, name)
    raise AttributeError(f"module 'autotune.trial' has no attribute {name!r}")
