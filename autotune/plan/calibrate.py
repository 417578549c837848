"""`autotune plan --calibrate STUDY`: your own GPUs beat the datasheet. A measured study on one GPU
type gives, per successful run, measured tokens/s over what the cost model simulates for the same
model, cluster and configuration; the median of those ratios rescales that type's simulated
throughput in the plan (the same factor for every count of that type: the rescale is of the GPU, the
interconnect keeps the cost model's)."""

from __future__ import annotations

import statistics

from autotune.errors import SpecError


def study_factor(name: str) -> tuple[str, float, int]:
    """(GPU type, median measured / simulated tokens/s, runs used) of a measured study."""
    from autotune.costmodel import simulate
    from autotune.search import study as st

    study = st.load_study(name)  # an unknown study is a SpecError naming the known ones
    model, cluster, attrs = st.specs_of(study)
    if cluster.gpu.is_cpu:
        raise SpecError(
            f"--calibrate {name}: its runs are on CPU ranks, which the cost model does not price; "
            f"calibrate from a study on a GPU type"
        )
    ratios = []
    for r in st.records(study):
        if r.status != "ok" or r.result is None or r.result.source != "measured" or not r.result.tokens_per_s:
            continue
        sim = simulate(model, cluster, r.config).samples_per_s * r.config.seq_len
        ratios.append(r.result.tokens_per_s / sim)
    if not ratios:
        raise SpecError(
            f"--calibrate {name}: no measured run in it (source {attrs.get('source', '?')}): "
            f"a simulated study would only calibrate the cost model against itself"
        )
    return cluster.gpu.name, statistics.median(ratios), len(ratios)


def calibration_from_studies(names: list[str]) -> dict[str, tuple[float, str]]:
    """GPU type -> (factor, what it came from), one study per type."""
    out: dict[str, tuple[float, str]] = {}
    for name in names:
        gpu, factor, n = study_factor(name)
        if gpu in out:
            raise SpecError(f"--calibrate: two studies for {gpu} ({out[gpu][1]} and {name}); give one per GPU type")
        out[gpu] = (factor, f"calibrated by measured study {name}: median of {n} runs")
    return out
