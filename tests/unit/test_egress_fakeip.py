"""Fake addresses of the egress gateway: stable, bounded, LRU-evicted, reused last."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address

import pytest

from space.node.api import InvalidArgument
from space.node.egress.fakeip import FakeIps

FIRST = IPv4Address("198.18.0.2")
LAST = IPv4Address("198.19.255.255")
RANGE_SIZE = int(LAST) - int(FIRST) + 1


def test_the_same_name_gets_the_same_address_while_mapped() -> None:
    fake = FakeIps()
    first = fake.address_for("pypi.org")
    assert fake.address_for("example.com") != first
    assert fake.address_for("pypi.org") == first


def test_addresses_start_after_198_18_0_1_and_map_back_to_their_names() -> None:
    fake = FakeIps()
    assert fake.address_for("a.example") == FIRST
    assert fake.address_for("b.example") == FIRST + 1
    assert fake.name_for(FIRST) == "a.example"
    assert fake.name_for(FIRST + 1) == "b.example"


def test_an_unmapped_address_has_no_name() -> None:
    fake = FakeIps()
    fake.address_for("a.example")
    assert fake.name_for(FIRST + 1) is None
    assert fake.name_for(IPv4Address("198.18.0.1")) is None
    assert fake.name_for(IPv4Address("93.184.216.34")) is None


@pytest.mark.parametrize(
    ("address", "inside"),
    [
        (IPv4Address("198.17.255.255"), False),
        (IPv4Address("198.18.0.0"), True),
        (IPv4Address("198.19.255.255"), True),
        (IPv4Address("198.20.0.0"), False),
        ("198.18.7.9", True),
        ("10.0.0.1", False),
        (IPv6Address("::ffff:198.18.0.2"), False),
        ("not an address", False),
        ("", False),
    ],
)
def test_contains_checks_the_whole_198_18_0_0_15_range(
    address: IPv4Address | IPv6Address | str, inside: bool
) -> None:
    assert FakeIps.contains(address) is inside


def test_the_least_recently_used_name_is_evicted_at_capacity() -> None:
    fake = FakeIps(capacity=2)
    a, b = fake.address_for("a.example"), fake.address_for("b.example")
    fake.address_for("a.example")  # a is now more recent than b
    fake.address_for("c.example")
    assert len(fake) == 2
    assert fake.name_for(a) == "a.example"
    assert fake.name_for(b) is None


def test_a_lookup_by_address_counts_as_a_use() -> None:
    fake = FakeIps(capacity=2)
    a, b = fake.address_for("a.example"), fake.address_for("b.example")
    assert fake.name_for(a) == "a.example"
    fake.address_for("c.example")
    assert fake.name_for(a) == "a.example"
    assert fake.name_for(b) is None


def test_an_evicted_name_gets_a_new_address_when_mapped_again() -> None:
    fake = FakeIps(capacity=1)
    a = fake.address_for("a.example")
    fake.address_for("b.example")
    assert fake.address_for("a.example") not in (a, FIRST + 1)


def test_a_freed_address_is_reused_only_after_every_other_address() -> None:
    fake = FakeIps(capacity=1)
    seen = {fake.address_for(f"n{i}.example") for i in range(RANGE_SIZE)}
    assert len(seen) == RANGE_SIZE
    assert min(seen) == FIRST
    assert max(seen) == LAST
    assert fake.address_for("again.example") == FIRST


def test_the_cyclic_walk_skips_addresses_still_in_use() -> None:
    fake = FakeIps(capacity=2)
    assert fake.address_for("kept.example") == FIRST
    for i in range(RANGE_SIZE - 1):
        fake.address_for("kept.example")  # stays the most recent: never evicted
        fake.address_for(f"n{i}.example")
    assert fake.name_for(LAST) == f"n{RANGE_SIZE - 2}.example"
    fake.address_for("kept.example")
    assert fake.address_for("wrapped.example") == FIRST + 1
    assert fake.name_for(FIRST) == "kept.example"


def test_the_map_never_holds_more_than_its_capacity() -> None:
    fake = FakeIps(capacity=3)
    for i in range(10):
        fake.address_for(f"n{i}.example")
    assert len(fake) == 3
    assert [fake.name_for(FIRST + i) for i in range(7, 10)] == [
        "n7.example",
        "n8.example",
        "n9.example",
    ]


@pytest.mark.parametrize("capacity", [0, -1, RANGE_SIZE + 1])
def test_negative_a_capacity_outside_the_range_is_refused(capacity: int) -> None:
    with pytest.raises(InvalidArgument, match="capacity"):
        FakeIps(capacity=capacity)


def test_the_whole_range_is_an_acceptable_capacity() -> None:
    assert len(FakeIps(capacity=RANGE_SIZE)) == 0
