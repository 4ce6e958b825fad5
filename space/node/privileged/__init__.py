"""The root broker (issue 18): all of a node that needs root, behind a narrow, typed
request set (``requests``), served by its own process (``server``), asked through
``RootBroker`` (``client``).

The node agent does what btrfs lets a subvolume's owner do, speaks to its VMs and the
gateway, and asks the broker for the rest: loop mounts, quotas and limits, subvolume
deletion; network namespaces, their nftables rules and the gateway's listeners in
them; VMM jails (uids, cgroups, the hand-over of files, launches, signals); the egress
gateway's start and stop. Everything the broker does is bounded by the ``Scope`` it
was started with.
"""

from space.node.privileged.client import RootBroker, broker_for, start_broker
from space.node.privileged.requests import Scope

__all__ = ["RootBroker", "Scope", "broker_for", "start_broker"]
