"""The control plane: REST API, tenants and API keys, sandbox records, placement.

Entry points: ``create_app`` (the FastAPI app over a ``NodeRegistry``),
``run_control_plane`` and ``register_remote_node`` (for the CLI), and the key helpers
``create_key``/``list_keys``/``revoke_key``.
"""

from __future__ import annotations

from space.control.app import create_app
from space.control.errors import ApiError
from space.control.keys import KeyInfo, create_key, list_keys, revoke_key
from space.control.nodes import NodeRegistry
from space.control.server import TlsFiles, register_remote_node, run_control_plane
from space.control.settings import ControlSettings

__all__ = [
    "ApiError",
    "ControlSettings",
    "KeyInfo",
    "NodeRegistry",
    "TlsFiles",
    "create_app",
    "create_key",
    "list_keys",
    "register_remote_node",
    "revoke_key",
    "run_control_plane",
]
