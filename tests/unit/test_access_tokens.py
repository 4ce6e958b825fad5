"""Per-sandbox access tokens: one per sandbox and purpose, checked in constant time."""

from __future__ import annotations

from space.control.access_tokens import TokenPurpose, check_token, sandbox_token


def test_a_token_opens_its_own_sandbox_and_purpose_only() -> None:
    token = sandbox_token("secret", "sbx-a", TokenPurpose.ENVD)
    assert check_token("secret", "sbx-a", TokenPurpose.ENVD, token)
    assert not check_token("secret", "sbx-b", TokenPurpose.ENVD, token)
    assert not check_token("secret", "sbx-a", TokenPurpose.TRAFFIC, token)
    assert not check_token("other", "sbx-a", TokenPurpose.ENVD, token)


def test_negative_a_missing_or_mangled_token_is_refused() -> None:
    token = sandbox_token("secret", "sbx-a", TokenPurpose.TRAFFIC)
    for given in (None, "", token[:-1], token + "x", token.upper()):
        assert not check_token("secret", "sbx-a", TokenPurpose.TRAFFIC, given)
