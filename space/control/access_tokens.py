"""Per-sandbox access tokens (issue 20): what reaches a sandbox without an API key.

Two kinds, both derived, never stored: an HMAC of the sandbox id under the node token,
which every replica of one control plane already shares, with a purpose in the message
so that one kind never opens the other's door.

- ``ENVD``: E2B's ``envdAccessToken``. The E2B SDK sends it as ``X-Access-Token`` to the
  in-sandbox daemon's routes (space.control.e2b translates them).
- ``TRAFFIC``: opens a port a sandbox exposes (space.control.ports), E2B's
  ``trafficAccessToken`` (sent as ``e2b-traffic-access-token``).

A token lives as long as its sandbox id (ids are never reused). Replacing the node token
changes every token at once; clients then read them again from the sandbox's record.
"""

from __future__ import annotations

import base64
import enum
import hashlib
import hmac

__all__ = ["TokenPurpose", "check_token", "sandbox_token"]


class TokenPurpose(enum.StrEnum):
    ENVD = "envd"
    TRAFFIC = "traffic"


def sandbox_token(secret: str, sandbox_id: str, purpose: TokenPurpose) -> str:
    """The ``purpose`` token of ``sandbox_id`` under ``secret`` (the node token)."""
    message = f"space-sandbox-token\0{purpose.value}\0{sandbox_id}".encode()
    digest = hmac.new(secret.encode(), message, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def check_token(secret: str, sandbox_id: str, purpose: TokenPurpose, given: str | None) -> bool:
    """Whether ``given`` is the ``purpose`` token of ``sandbox_id``, in constant time."""
    if not given:
        return False
    expected = sandbox_token(secret, sandbox_id, purpose)
    return hmac.compare_digest(given.encode(), expected.encode())
