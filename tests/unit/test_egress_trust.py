"""The guest's CA bundle edits of space.node.network.trust: one SPACE block in, every
copy of the CA out again (a build step may have run update-ca-certificates)."""

from __future__ import annotations

from space.node.network.trust import with_block, without_ca

CA = b"-----BEGIN CERTIFICATE-----\nMIIBsandboxCA\n-----END CERTIFICATE-----\n"
OTHER = b"-----BEGIN CERTIFICATE-----\nMIIBotherCA\n-----END CERTIFICATE-----\n"
SYSTEM = b"# ISRG Root X1\n" + OTHER


def test_a_block_is_added_once_and_replaced_on_a_second_install() -> None:
    once = with_block(SYSTEM, CA)
    assert once.startswith(SYSTEM) and once.count(CA) == 1
    newer = CA.replace(b"sandboxCA", b"newerCA")
    twice = with_block(once, newer)
    assert CA not in twice and twice.count(newer) == 1
    assert twice.count(b"# BEGIN SPACE") == 1


def test_a_bundle_without_a_final_newline_keeps_its_last_certificate_whole() -> None:
    bundle = with_block(SYSTEM.rstrip(b"\n"), CA)
    assert bundle.startswith(SYSTEM) and bundle.endswith(CA + b"# END SPACE egress CA\n")


def test_without_ca_restores_the_bundle_from_before_the_install() -> None:
    assert without_ca(with_block(SYSTEM, CA), CA) == SYSTEM


def test_without_ca_also_drops_copies_outside_the_block() -> None:
    """update-ca-certificates writes the CA from /usr/local/share unmarked."""
    regenerated = SYSTEM + CA + OTHER.replace(b"other", b"third")
    cleaned = without_ca(with_block(regenerated, CA), CA)
    assert CA not in cleaned
    assert cleaned == SYSTEM + OTHER.replace(b"other", b"third")


def test_negative_without_ca_leaves_a_bundle_without_it_alone() -> None:
    assert without_ca(SYSTEM, CA) == SYSTEM
    assert without_ca(b"", CA) == b""
    assert without_ca(SYSTEM, b"") == SYSTEM
