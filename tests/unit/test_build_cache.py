"""The build cache's key (space/node/agent/_build_cache.py): every input that goes into
a cached layer changes it; the VM side is tests/integration/test_e2b_code_interpreter.py."""

from __future__ import annotations

from space.node.agent._build_cache import cache_key

LAYER = "ab" * 32
KEY_ID = "k1"
SOURCES = ("deb [trusted=yes] copy:/var/cache/space/debs/code-interpreter-1 ./",)


def test_the_same_inputs_give_the_same_key_whatever_the_order_of_the_sources() -> None:
    two = (*SOURCES, "deb http://deb.debian.org/debian bookworm main")
    assert cache_key(LAYER, KEY_ID, two) == cache_key(LAYER, KEY_ID, tuple(reversed(two)))
    assert len(cache_key(LAYER, KEY_ID, SOURCES)) == 64


def test_the_layer_the_node_key_and_every_apt_source_change_the_key() -> None:
    keys = {
        cache_key(LAYER, KEY_ID, SOURCES),
        cache_key("cd" * 32, KEY_ID, SOURCES),
        cache_key(LAYER, "k2", SOURCES),
        cache_key(LAYER, KEY_ID, ("deb [trusted=yes] copy:/var/cache/space/debs/other ./",)),
        cache_key(LAYER, KEY_ID, (*SOURCES, "deb http://deb.debian.org/debian bookworm main")),
        cache_key(LAYER, KEY_ID, ()),
    }
    assert len(keys) == 6
