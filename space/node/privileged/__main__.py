"""``python -m space.node.privileged --fd N --scope JSON``: the root broker."""

from space.node.privileged.server import main

main()
