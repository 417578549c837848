"""Settings every test process shares: DeepSpeed on CPU, quiet local Ray (../shared/NOTES.md)."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
