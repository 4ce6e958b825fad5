"""Placement: which node gets a new sandbox."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = ["pick_node"]


def pick_node(candidates: Iterable[str], load: Mapping[str, int]) -> str | None:
    """The candidate with the fewest sandboxes (ties: the smallest id), or None if none.

    ``load`` counts live sandboxes per node id; nodes missing from it have none.
    """
    ranked = sorted(candidates, key=lambda node_id: (load.get(node_id, 0), node_id))
    return ranked[0] if ranked else None
