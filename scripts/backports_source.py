"""Print an apt source (deb822) for CODENAME-backports on the mirror this system uses.

Usage: python3 scripts/backports_source.py CODENAME. The mirror is the one serving
CODENAME's main suite in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list,
so setup names no host of its own.
"""

import re
import sys
from pathlib import Path


def mirror(codename: str) -> tuple[str, str]:
    """(URI, Signed-By or "") of the source that serves ``codename``."""
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        for stanza in re.split(r"\n\s*\n", path.read_text()):
            fields = dict(
                (k.strip(), v.strip())
                for k, _, v in (line.partition(":") for line in stanza.splitlines())
                if not k.startswith("#") and v
            )
            if codename in fields.get("Suites", "").split() and fields.get("URIs"):
                return fields["URIs"].split()[0], fields.get("Signed-By", "")
    legacy = Path("/etc/apt/sources.list")
    if legacy.exists():
        for line in legacy.read_text().splitlines():
            parts = re.sub(r"\[[^]]*\]", "", line).split()  # drop [options]
            if len(parts) >= 3 and parts[0] == "deb" and parts[2] == codename:
                return parts[1], ""
    sys.exit(f"no apt source serves {codename}: cannot add {codename}-backports")


def main() -> None:
    codename = sys.argv[1]
    uri, signed_by = mirror(codename)
    print("Types: deb")
    print(f"URIs: {uri}")
    print(f"Suites: {codename}-backports")
    print("Components: main")
    if signed_by:
        print(f"Signed-By: {signed_by}")


if __name__ == "__main__":
    main()
