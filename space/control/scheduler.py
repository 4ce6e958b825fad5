"""Placement: which nodes may get a new sandbox, in the order to ask them (issue 19).

Only ``active`` nodes are placed on (not draining, not lost). The order:
1. free capacity: nodes that reported room for another sandbox (or reported nothing
   yet) before nodes that reported none;
2. where the template already is: a warm pool with a VM waiting, then its ready
   state (a template built on the node);
3. spread: fewest sandboxes first; ties by id.
A sandbox asking for a guest type (issue 21) is placed only on nodes that report it
(or reported nothing yet); ``auto`` on any.
A node still admits by its own capacity (space/node/core/capacity.py) and refuses with
InsufficientCapacity when it has no room, and with NotFound when the template has not
been shipped there yet (space.control.shipping); the control plane then asks the next
node (space.control.lifecycle), so a report that went stale costs one refusal, not a
failed create.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from space.control.store.nodes import ACTIVE, NodeRecord

__all__ = ["rank_nodes"]


def rank_nodes(
    nodes: Iterable[NodeRecord],
    load: Mapping[str, int],
    *,
    reachable: Iterable[str],
    template: str | None = None,
    guest: str = "auto",
) -> list[str]:
    """The ids of the active ``nodes`` among ``reachable`` (this replica can call them),
    in placement order (the module docstring). ``load`` counts live sandboxes per node
    id; ``template`` is the node's name of the template to create from (None: from a
    snapshot, where the template does not matter)."""
    callable_here = set(reachable)

    def key(node: NodeRecord) -> tuple[bool, bool, bool, int, str]:
        report = node.capacity or {}
        full = report.get("room", 1) <= 0
        pooled = template is not None and report.get("pools", {}).get(template, 0) > 0
        built = template is not None and template in report.get("templates", ())
        return (full, not pooled, not built, load.get(node.id, 0), node.id)

    def runs(node: NodeRecord) -> bool:
        offered = (node.capacity or {}).get("guest_types")
        return guest == "auto" or offered is None or guest in offered

    chosen = [
        node for node in nodes if node.state == ACTIVE and node.id in callable_here and runs(node)
    ]
    return [node.id for node in sorted(chosen, key=key)]
