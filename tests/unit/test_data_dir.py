"""Nothing leaks by mode (issue 18): the data dir 0700, what the server writes 0600,
and an existing data dir of an older version brought to the same modes on start."""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

from space.node.core.data_dir import secure_data_dir, secure_top_level


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _old_data_dir(root: Path) -> Path:
    """A data dir as versions before issue 18 left it: 0755 directories, 0644 files."""
    data = root / "data"
    for sub in ("run", "images/abc", "pool", "egress"):
        (data / sub).mkdir(parents=True)
        (data / sub).chmod(0o755)
    data.chmod(0o755)
    for name in ("pool.img", "space.db", "space.db-wal", "master.key", "node-token"):
        (data / name).write_bytes(b"x")
        (data / name).chmod(0o644)
    (data / "images/abc/vmlinuz").write_bytes(b"k")
    (data / "images/abc/vmlinuz").chmod(0o644)
    return data


def test_a_new_data_dir_is_made_0700(tmp_path: Path) -> None:
    data = tmp_path / "a" / "data"
    secure_data_dir(data)
    assert _mode(data) == 0o700


def test_an_old_data_dir_gets_owner_only_modes_at_its_top_level(tmp_path: Path) -> None:
    data = _old_data_dir(tmp_path)
    secure_data_dir(data)
    assert _mode(data) == 0o700
    for name in ("run", "images", "pool", "egress"):
        assert _mode(data / name) == 0o700, name
    for name in ("pool.img", "space.db", "space.db-wal", "master.key", "node-token"):
        assert _mode(data / name) == 0o600, name
    # Below the top level nothing is walked: a 0700 parent already keeps others out.
    assert _mode(data / "images/abc") == 0o755
    assert _mode(data / "images/abc/vmlinuz") == 0o644


def test_links_and_sockets_at_the_top_level_are_left_alone(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    outside = tmp_path / "outside"
    outside.write_bytes(b"")
    outside.chmod(0o644)
    (data / "link").symlink_to(outside)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(data / "sock"))
        os.chmod(data / "sock", 0o660)
        secure_top_level(data)
        assert _mode(data / "sock") == 0o660
    assert _mode(outside) == 0o644  # the link was not followed


def test_secure_data_dir_is_idempotent(tmp_path: Path) -> None:
    data = _old_data_dir(tmp_path)
    secure_data_dir(data)
    before = {p: _mode(p) for p in data.rglob("*")}
    secure_data_dir(data)
    assert {p: _mode(p) for p in data.rglob("*")} == before


def test_a_server_process_writes_owner_only_files(tmp_path: Path) -> None:
    # In a child: the umask is process-wide and would change every later test here.
    code = (
        "import sys, pathlib\n"
        "from space.node.core.data_dir import restrict_umask\n"
        "restrict_umask()\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "(d / 'f').write_text('x'); (d / 'd').mkdir()\n"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True)
    assert _mode(tmp_path / "f") == 0o600
    assert _mode(tmp_path / "d") == 0o700
