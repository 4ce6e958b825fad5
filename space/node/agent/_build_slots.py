"""Build slots of a node, shared fairly between the owners of builds (issue 17, probe 6).

Private to space.node.agent (``Builds`` asks here before a build runs). A node runs at
most ``slots`` builds at once. A build's owner is the tenant whose template it builds,
which the node reads from the template's name (``build_owner``); when a slot frees, the
next build is the oldest waiting one of the owner with the fewest running builds, ties
going round-robin (to the owner served longest ago). So a lone owner may fill every
slot, but one with many builds waiting never holds more than its share while another
owner waits. Builds of one name never run at once: their layers, subvolume and tags
are the same (space.node.agent._builder keys layers by the name), so the second waits
for the first and takes no slot meanwhile.

Each owner may have at most ``queued_per_owner`` builds waiting; one more is refused
with ResourceExhausted (so nothing of it need stay on the host). Not thread-safe: one
event loop.
"""

from __future__ import annotations

import asyncio
import enum
from collections import Counter
from dataclasses import dataclass, field

from space.node.api import TENANT_PREFIX, ResourceExhausted

__all__ = ["OPERATOR", "BuildSlots", "Ticket", "build_owner"]

#: The owner of builds whose name has no tenant prefix: the operator's own templates.
OPERATOR = "operator"


def build_owner(name: str) -> str:
    """Who a build of the node's template ``name`` belongs to: its tenant prefix, or
    OPERATOR for a name without one (``base`` and templates built on the node itself)."""
    match = TENANT_PREFIX.match(name)
    return match.group().removesuffix(".") if match else OPERATOR


class _State(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    GONE = "gone"


@dataclass(eq=False)
class Ticket:
    """One build's place: waiting for a slot, holding one, or gone."""

    owner: str
    name: str
    order: int
    granted: asyncio.Event = field(default_factory=asyncio.Event)
    state: _State = _State.WAITING


class BuildSlots:
    """``slots`` builds at once, shared fairly by owner (see the module docstring)."""

    def __init__(self, slots: int, queued_per_owner: int) -> None:
        self._slots = slots
        self._queued_per_owner = queued_per_owner
        self._waiting: list[Ticket] = []
        self._running: Counter[str] = Counter()
        self._running_names: set[str] = set()
        #: When each owner last got a slot (a count of grants): ties go to the owner
        #: never served or served longest ago. One entry per tenant that ever built
        #: here, and tenants are made by operators, so it stays small.
        self._served: dict[str, int] = {}
        self._grants = 0
        self._orders = 0

    def enqueue(self, name: str) -> Ticket:
        """Queue a build of the template ``name``; it may get its slot at once.

        Raises ResourceExhausted if its owner has ``queued_per_owner`` builds waiting
        already (nothing is queued then). The caller must ``leave`` the ticket in the end.
        """
        owner = build_owner(name)
        queued = sum(1 for t in self._waiting if t.owner == owner)
        if queued >= self._queued_per_owner:
            raise ResourceExhausted(
                f"{queued} builds of this tenant are waiting for a build slot on this node; "
                f"at most {self._queued_per_owner} may wait (this node runs "
                f"{self._slots} builds at once)"
            )
        self._orders += 1
        ticket = Ticket(owner, name, self._orders)
        self._waiting.append(ticket)
        self._dispatch()
        return ticket

    def ahead(self, ticket: Ticket) -> int:
        """Waiting builds that would get a slot before ``ticket`` if none more came (an
        estimate for the log: it leaves out that builds of one name wait for each other)."""
        running = Counter(self._running)
        served = dict(self._served)
        waiting = list(self._waiting)
        for turn in range(len(waiting)):
            chosen = min(waiting, key=lambda t: self._rank(t, running, served))
            if chosen is ticket:
                return turn
            waiting.remove(chosen)
            running[chosen.owner] += 1
            served[chosen.owner] = self._grants + turn
        return 0

    @property
    def running(self) -> int:
        """Builds holding a slot now."""
        return sum(self._running.values())

    def building(self, name: str) -> bool:
        """Whether a build of the template ``name`` holds a slot now."""
        return name in self._running_names

    def waiting(self, owner: str | None = None) -> int:
        """Builds waiting for a slot (``owner``'s only, if given)."""
        return sum(1 for t in self._waiting if owner is None or t.owner == owner)

    async def wait(self, ticket: Ticket) -> None:
        """Return once ``ticket`` holds a slot. Cancelled, it gives up its place (or
        the slot it got meanwhile)."""
        try:
            await ticket.granted.wait()
        except BaseException:
            self.leave(ticket)
            raise

    def leave(self, ticket: Ticket) -> None:
        """Give up ``ticket``'s place or slot; idempotent."""
        if ticket.state is _State.WAITING:
            self._waiting.remove(ticket)
        elif ticket.state is _State.RUNNING:
            self._running[ticket.owner] -= 1
            self._running_names.discard(ticket.name)
            if not self._running[ticket.owner]:
                del self._running[ticket.owner]
        ticket.state = _State.GONE
        self._dispatch()

    def _dispatch(self) -> None:
        while self.running < self._slots:
            ready = [t for t in self._waiting if t.name not in self._running_names]
            if not ready:
                return
            ticket = min(ready, key=lambda t: self._rank(t, self._running, self._served))
            self._waiting.remove(ticket)
            ticket.state = _State.RUNNING
            self._running[ticket.owner] += 1
            self._running_names.add(ticket.name)
            self._served[ticket.owner] = self._grants
            self._grants += 1
            ticket.granted.set()

    @staticmethod
    def _rank(ticket: Ticket, running: Counter[str], served: dict[str, int]) -> tuple[int, ...]:
        """Fewest running first, then the owner served longest ago, then the oldest."""
        return (running[ticket.owner], served.get(ticket.owner, -1), ticket.order)
