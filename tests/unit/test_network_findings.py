"""rayllm.bench.network's reading of NCCL's log and its findings, from NCCL's own line format."""

from __future__ import annotations

from rayllm.bench.network import judge, transport

RESULT = {"nodes": 2, "backend": "nccl", "busbw_gb_per_s": {"across nodes, every GPU at once": {"256": 41.0}}}


def test_the_transport_is_read_from_nccls_channel_lines(tmp_path):
    (tmp_path / "nccl.node-a.101").write_text(
        "node-a:101:120 [0] NCCL INFO Channel 00/0 : 7[7] -> 8[0] [receive] via NET/AWS Libfabric/0\n"
        "node-a:101:120 [0] NCCL INFO Channel 00 : 0[0] -> 1[1] via P2P/IPC\n"
    )
    (tmp_path / "nccl.node-b.202").write_text("node-b:202:230 [0] NCCL INFO Ring 00 : 15 -> 0 via NET/IB/0\n")
    assert transport(tmp_path) == "AWS Libfabric, IB"
    assert transport(tmp_path / "empty") is None


def test_sockets_between_gpu_nodes_and_a_slow_link_are_findings():
    assert judge({**RESULT, "transport": "AWS Libfabric"}, "h100-80gb") == []
    found = judge({**RESULT, "transport": "Socket"}, "h100-80gb")
    assert found == [
        "NCCL uses Socket between nodes: TCP sockets, not EFA/InfiniBand/TCPX (see README, 'Networking across nodes')"
    ]
    slow = {**RESULT, "transport": "IB", "busbw_gb_per_s": {"across nodes, every GPU at once": {"256": 9.5}}}
    assert judge(slow, "h100-80gb") == ["across nodes 9.5 GB/s per GPU, below 25 (half of what rayllm plan assumes)"]
    assert judge({**RESULT, "nodes": 1, "transport": None}, None) == []
