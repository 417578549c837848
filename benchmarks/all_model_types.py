"""`autotune estimate` on the default config of every causal-LM model type transformers knows.

    python benchmarks/all_model_types.py                 # all of them (~10 min on 2 cores)
    python benchmarks/all_model_types.py llama qwen2     # some

Each type's default config (`AutoConfig.for_model`), cut to at most 4 layers (its per-layer lists
with it) for speed, written to a config.json and estimated at ZeRO-2 bf16 on 1xA100 in a fresh
process, two at a time. Prints the exit code and the last line of stderr per type, then the counts:
0 (estimated) or 2 (one `error:` line saying why) are the only acceptable codes; a `TB` marks a
Python traceback, a bug of autotune's.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

LAYERS = 4


def one(model_type: str, root: Path) -> tuple[str, str, str]:
    try:
        d = AutoConfig.for_model(model_type).to_dict()
    except Exception as e:
        return model_type, "no default config", " ".join(str(e).split())[:160]
    depth = None
    for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        if isinstance(d.get(k), int) and d[k] > LAYERS:
            depth, d[k] = d[k], LAYERS
    if depth:
        for k, v in list(d.items()):
            if isinstance(v, list) and len(v) == depth:
                d[k] = v[:LAYERS]
    path = root / model_type
    path.mkdir()
    (path / "config.json").write_text(json.dumps(d))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune",
            "estimate",
            "--model",
            str(path),
            "--gpus",
            "1xA100",
            "--zero",
            "2",
            "--precision",
            "bf16",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in p.stderr.splitlines() if line.strip() and not line.startswith("[transformers]")]
    return (
        model_type,
        f"rc={p.returncode}",
        ("TB " if "Traceback" in p.stderr else "") + (lines[-1][:200] if lines else ""),
    )


def main(types: list[str]) -> None:
    counts: Counter[str] = Counter()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:
        for model_type, code, said in pool.map(lambda t: one(t, Path(tmp)), types):
            counts[code + (" traceback" if said.startswith("TB") else "")] += 1
            print(f"{model_type:28s} {code:8s} {said}", flush=True)
    print("\n" + ", ".join(f"{n} {code}" for code, n in sorted(counts.items())))


if __name__ == "__main__":
    main(sys.argv[1:] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
