"""What of a node's own words a tenant may see (issue 17: a refused create quoted the
node-internal template name ``tca978112ca1bbdca.no-such-template``).

A node's messages, build log lines and sandbox errors may quote its internal names: a
tenant's template as the node stores it (``t`` + 16 hex + ``.`` + name, see
space.control.template_names) and paths in its store (``<pool>/templates/<name>/<digest>``,
``<pool>/sandboxes/sb-...``). ``scrub`` takes every such prefix out, any tenant's (a
node quoting another tenant's name must not show it either), and replaces such paths by
``<node path>``. A guest path (``/home/user/templates/x``) is left alone: only a path
whose store directory is followed by a node-internal name (a tenant template, ``base``,
a sandbox or snapshot id, a digest) is the node's.

The control plane applies it wherever node text reaches a tenant: every node error it
answers (space.control.errors), an exec stream's error line, build events and log lines,
and a sandbox's ``error`` field.
"""

from __future__ import annotations

import re

from space.node.api import TENANT_PREFIX

__all__ = ["NODE_PATH", "scrub"]

#: What a node path becomes in a tenant's answer.
NODE_PATH = "<node path>"
_TEMPLATE_PREFIX = re.compile(rf"(?<![0-9a-z]){TENANT_PREFIX.pattern}")
_STORE_PATH = re.compile(
    r"(?:/[^\s/'\"]+)*/(?:templates|sandboxes|snapshots|layers)/"
    rf"(?:{TENANT_PREFIX.pattern}|base(?=[/\s'\"]|$)|sb-|sn-|[0-9a-f]{{64}})[^\s'\"]*"
)


def scrub(text: str) -> str:
    """``text`` with node store paths replaced and tenant template prefixes removed."""
    return _TEMPLATE_PREFIX.sub("", _STORE_PATH.sub(NODE_PATH, text))
