"""Interconnect (issue 32): NVLink within a node, the node's NICs between nodes, PCIe without
peer-to-peer on an RTX 4090; adding a node can lose, as users see on a slow network."""

from __future__ import annotations

import pytest

from autotune import costmodel as cm
from autotune.errors import SpecError
from autotune.hardware import parse_gpus
from autotune.models import resolve_model
from autotune.train_config import TrainConfig

pytestmark = pytest.mark.usefixtures("shipped_traces_module")  # plans of 13B, as a user's first run reads them

Z3 = TrainConfig(zero_stage=3, micro_batch=2, seq_len=2048, precision="bf16", attention="sdpa")


def test_links_by_hand():
    # NVLink 3: 300 GB/s per direction x 0.8; two DGX A100 nodes: 8 x 25 GB/s NICs = 200 bound the ring
    assert cm.link_bytes_per_s(parse_gpus("8xA100")) == pytest.approx(300e9 * 0.8)
    assert cm.link_bytes_per_s(parse_gpus("2x8xA100")) == pytest.approx(200e9 * 0.8)
    # one 100 Gb/s NIC per node: 12.5 GB/s for the whole node
    assert cm.link_bytes_per_s(parse_gpus("2x8xA100@net=100Gbps")) == pytest.approx(12.5e9 * 0.8)
    # two DGX-1 (V100) nodes: 4 x 100 Gb/s EDR per node of 8 = 50 GB/s (not one 100 Gb/s NIC per GPU pair counted
    # per GPU, which read 100 GB/s: issue 49's multi-node V100 priced too fast)
    assert cm.link_bytes_per_s(parse_gpus("2x8xV100")) == pytest.approx(50e9 * 0.8)
    assert cm.link_bytes_per_s(parse_gpus("2x8xV100-16GB")) == pytest.approx(50e9 * 0.8)
    # RTX 4090: PCIe 4.0 x16 32 GB/s, no peer-to-peer: through host memory, each byte over PCIe twice
    assert not parse_gpus("8xRTX4090").gpu.p2p and parse_gpus("8xL40S").gpu.p2p
    assert cm.link_bytes_per_s(parse_gpus("8xRTX4090")) == pytest.approx(16e9 * 0.8)


def test_net_grammar():
    c = parse_gpus("2x8xH100@host=512GiB@net=3200Gbps")
    assert (c.num_nodes, c.gpu.inter_node_gbps, c.gpu.host_memory_bytes) == (2, 50.0, 512 * 2**30)
    assert "3200 Gb/s per node" in c.note
    for bad in ("2x8xA100@net=fast", "2x8xA100@net=0Gbps", "2x8xA100@net=1Gbps@net=2Gbps"):
        with pytest.raises(SpecError, match="@net="):
            parse_gpus(bad)


def test_adding_a_node_can_lose():
    """13B ZeRO-3 mb 2: on the DGX reference network (8 x 200 Gb/s per node) a second node nearly
    doubles the tokens/s; on one 100 Gb/s Ethernet NIC per node the gathers and reduce-scatters no
    longer hide under compute and 16 GPUs are slower than 8."""
    model = resolve_model("13b")

    def tok_s(gpus):
        c = parse_gpus(gpus)
        return cm.simulate(model, c, Z3).tokens_per_s_per_gpu * c.world_size

    one, two_ib, two_eth = tok_s("8xA100"), tok_s("2x8xA100"), tok_s("2x8xA100@net=100Gbps")
    assert two_ib > 1.8 * one
    assert two_eth < one


def test_plan_prices_a_slow_network_higher(tmp_path, capsys):
    import json

    from autotune.cli import main

    assert (
        main(
            [
                "plan",
                "--model",
                "13b",
                "--tokens",
                "1e9",
                "--gpus",
                "8xA100,2x8xA100@net=100Gbps",
                "--json",
                "--picture",
                str(tmp_path / "p.png"),
            ]
        )
        == 0
    )
    opts = {o["gpus"]: o for o in json.loads(capsys.readouterr().out)["options"]}
    assert opts["2x8xA100@net=100Gbps"]["usd"] > opts["8xA100"]["usd"]
