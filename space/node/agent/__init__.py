"""The node agent: ``Node``, the in-process implementation of space.node.api.NodeService
(sandboxes as QEMU VMs on btrfs, their snapshots, templates, warm pools and egress)."""

from space.node.agent.node import Node

__all__ = ["Node"]
