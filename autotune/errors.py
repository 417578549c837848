"""The one error type for bad user input."""

from __future__ import annotations


class SpecError(ValueError):
    """Bad user input for a spec (model, GPUs, config, space, study): the CLI prints it and exits 2."""
