"""Placement: which nodes may get a new sandbox, in the order to ask them.

A node admits by its own capacity (space/node/core/capacity.py) and refuses with
InsufficientCapacity when it has no room; the control plane then asks the next node
(space.control.lifecycle), so this order only needs to be a good first guess.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["rank_nodes"]


def rank_nodes(candidates: Iterable[str], load: Mapping[str, int]) -> list[str]:
    """The candidates, fewest sandboxes first (ties: the smallest id).

    ``load`` counts live sandboxes per node id; nodes missing from it have none.
    """
    return sorted(candidates, key=lambda node_id: (load.get(node_id, 0), node_id))
