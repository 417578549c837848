"""The knob trials of tests/test_knobs.py on transformers' Llama (the default code), not the stand-in.

    python benchmarks/knobs_on_hf.py     # 33 real DeepSpeed trials on 2 CPU ranks, ~3 min

tests/test_knobs.py checks each knob's memory terms on the stand-in, whose activations the analytic
model prices exactly. Here the same configurations (tiny-llama, micro batch 1, seq 32) run on the
Hugging Face code, and each measured peak is set against `autotune.memory.estimate` with the test's
tolerances (at most 1% under; 3% over, 7% where one bucket holds every gradient, 12% for
BF16_Optimizer: the run-to-run buffers the test's constants describe). What misses is listed in docs/memory.md ("Known open error").
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_knobs import CLUSTER, IDS, KNOBS, OVER, OVER_BF16_OPTIMIZER, OVER_ONE_BUCKET, UNDER, _cfg  # noqa: E402

from autotune.memory import estimate  # noqa: E402
from autotune.memory.buffers import bf16_optimizer  # noqa: E402
from autotune.models import resolve_model  # noqa: E402
from autotune.trial import run_trials  # noqa: E402
from autotune.trial.record import TrialRequest  # noqa: E402


def main() -> None:
    model = resolve_model("tiny-llama")
    with tempfile.TemporaryDirectory() as root:
        reqs = [TrialRequest(model=model, cluster=CLUSTER, config=_cfg(kw), out_dir=Path(root, str(i)), steps=2,
                             warmup_steps=1, timeout_s=300) for i, kw in enumerate(KNOBS)]
        results = run_trials(reqs)
    misses = 0
    for name, req, res in zip(IDS, reqs, results):
        if res.status != "ok":
            print(f"{name}: {res.status} {res.reason}")
            continue
        est = estimate(model, CLUSTER, req.config).tensor_peak_bytes
        err = est / res.peak_bytes - 1
        over = OVER_ONE_BUCKET if req.config.reduce_bucket_size >= model.num_params else OVER
        if bf16_optimizer(req.config):
            over = OVER_BF16_OPTIMIZER
        miss = not -UNDER <= err <= over
        misses += miss
        print(f"{name:90s} measured {res.peak_bytes:>11,} B, estimate {est:>11,} B ({100 * err:+.2f}%)"
              + ("  MISS" if miss else ""))
    print(f"\n{misses} of {len(reqs)} outside the test's tolerance: -{100 * UNDER:.0f}% .. +{100 * OVER:.0f}%, "
          f"+{100 * OVER_ONE_BUCKET:.0f}% where one reduce bucket holds every gradient, "
          f"+{100 * OVER_BF16_OPTIMIZER:.0f}% for DeepSpeed's BF16_Optimizer")


if __name__ == "__main__":
    main()
