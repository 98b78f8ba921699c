"""A layout's fast groups stay inside a node: a TP group never spans two, an HSDP shard group is
inside one node or made of whole nodes. Ranks are numbered node by node, as both entry points
number them."""

from __future__ import annotations

import pytest

from rayllm.errors import ConfigError
from rayllm.parallel.layout import Layout, check_placement


def nodes(*counts: int) -> list[str]:
    return [f"node-{i}" for i, n in enumerate(counts) for _ in range(n)]


@pytest.mark.parametrize(
    ("layout", "placed"),
    [
        (Layout(dp_shard=2, tp=8), nodes(8, 8)),  # TP inside each node, FSDP across
        (Layout(dp_replicate=2, dp_shard=8), nodes(8, 8)),  # HSDP: shard in a node, replicas across
        (Layout(dp_replicate=2, dp_shard=8), nodes(4, 4, 4, 4)),  # a shard group of two whole nodes
        (Layout(dp_shard=16), nodes(6, 10)),  # FSDP alone spans the world by design
        (Layout(dp_shard=4, tp=2), nodes(6, 2)),  # TP 2 divides both nodes' counts
    ],
)
def test_placements_whose_groups_stay_in_nodes_pass(layout, placed):
    check_placement(layout, placed)


def test_a_tp_group_across_two_nodes_is_refused_by_name():
    # A node offering 6 free GPUs: TP 4 puts ranks 4-7 on two nodes.
    with pytest.raises(ConfigError) as caught:
        check_placement(Layout(dp_shard=2, tp=4), nodes(6, 2))
    assert str(caught.value).startswith(
        "the TP group of ranks 4-7 would span nodes node-0, node-1 (2, 2 ranks each), so its collectives would "
        "cross the network; give every node a multiple of 4 workers"
    )


def test_a_cp_group_with_part_of_a_node_is_refused_and_whole_nodes_pass():
    check_placement(Layout(dp_shard=2, cp=8), nodes(8, 8))  # a ring per node
    check_placement(Layout(dp_shard=1, cp=8, tp=2), nodes(8, 8))  # a ring over two whole nodes
    with pytest.raises(ConfigError, match="the CP group of ranks 0-7 would span nodes node-0, node-1 \\(6, 2 ranks"):
        check_placement(Layout(dp_shard=2, cp=4, tp=2), nodes(6, 6, 4))


def test_an_hsdp_shard_group_with_part_of_a_node_is_refused():
    with pytest.raises(ConfigError, match="the HSDP shard group of ranks 0-7 would span nodes node-0, node-1"):
        check_placement(Layout(dp_replicate=2, dp_shard=8), nodes(6, 6, 4))
