"""Measure the training loop's per-step host work outside DeepSpeed's engine timers.

    PYTHONPATH=. python benchmarks/host_step.py [--micro-batch 3] [--seq-len 1024] [--steps 200]

What the Hugging Face Trainer does between `engine.step()` and the next `engine.forward()` (the
part DeepSpeed's forward/backward/step timers leave out): take the next batch from a DataLoader
(num_workers 0, the Trainer's default) over run_clm.py-style examples (Python lists of token ids:
input_ids, attention_mask, labels), collate it with transformers' default_data_collator, move it
to the device (here the CPU: a host-to-GPU copy of a few KB adds microseconds), and the loop's
bookkeeping (a detached loss accumulated). It runs on the host CPU in both cases, so this CPU
measures it; the median per step is what autotune.costmodel.HOST_STEP_S holds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.data import DataLoader


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro-batch", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=200)
    a = ap.parse_args()
    from transformers import default_data_collator

    torch.set_num_threads(1)  # a shared machine: one core, as the Trainer's loop is one thread
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 50257, (a.seq_len,), generator=gen).tolist() for _ in range(a.micro_batch * a.steps)]
    data = [{"input_ids": r, "attention_mask": [1] * a.seq_len, "labels": r} for r in rows]
    loader = DataLoader(data, batch_size=a.micro_batch, collate_fn=default_data_collator, num_workers=0)
    tr_loss = torch.zeros(())
    loss = torch.ones(())
    times = []
    it = iter(loader)
    for _ in range(a.steps):
        t0 = time.perf_counter()
        batch = next(it)
        batch = {k: v.to("cpu", non_blocking=True) for k, v in batch.items()}
        tr_loss += loss.detach()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    print(
        f"host work per step (micro batch {a.micro_batch}, seq {a.seq_len}): median {med * 1e3:.2f} ms, "
        f"p90 {sorted(times)[int(0.9 * len(times))] * 1e3:.2f} ms over {a.steps} steps"
    )


if __name__ == "__main__":
    main()
