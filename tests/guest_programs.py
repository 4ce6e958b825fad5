"""Programs the VM tests leave running in a guest, to show a process lives on across an
operation."""

from __future__ import annotations

#: Where counter() writes its count.
COUNTER_FILE = "/tmp/c"


def counter(interval_s: float) -> str:
    """A shell command: a process that writes an increasing count to COUNTER_FILE every
    ``interval_s``, for ever.

    One Python process, not a shell loop: a loop spawning ``sleep`` and ``mv`` at every
    tick kept a TCG guest's host CPU at 24% (8% this way), taken from every other VM and
    test on the machine. The count goes to a side file renamed over COUNTER_FILE, so a
    reader never finds it empty.
    """
    program = (
        "import os, time\n"
        "i = 0\n"
        "while True:\n"
        "    i += 1\n"
        f"    with open('{COUNTER_FILE}.new', 'w') as f:\n"
        "        f.write(str(i))\n"
        f"    os.replace('{COUNTER_FILE}.new', '{COUNTER_FILE}')\n"
        f"    time.sleep({interval_s})\n"
    )
    return f'exec python3 -S -c "{program}"'
