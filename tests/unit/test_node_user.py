"""What a server started as root does before its node agent drops root (issue 18):
the user, whether it can reach its data dir, and handing it what root left."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from space.node.agent import node_user
from space.node.api import InvalidArgument
from space.node.core.config import NodeConfig
from space.node.vmm.jail import JAIL_UIDS
from tests.integration.platform import let_through

UID, GID = 4242, 4343


@pytest.fixture(autouse=True)
def _as_root() -> None:
    if os.geteuid() != 0:
        pytest.fail("these tests change owners: run the suite as root")


def test_negative_root_or_an_unknown_user_is_refused() -> None:
    with pytest.raises(InvalidArgument, match="is root"):
        node_user.node_user("root")
    with pytest.raises(InvalidArgument, match="no user 'no-such-user-here'"):
        node_user.node_user("no-such-user-here")


def test_the_setup_user_is_the_default_and_is_not_root() -> None:
    uid, gid = node_user.node_user(node_user.DEFAULT_USER)
    assert uid != 0 and gid != 0


def test_negative_a_data_dir_the_user_cannot_reach_is_refused_before_anything(
    tmp_path: Path,
) -> None:
    closed = tmp_path / "closed"
    (closed / "inner").mkdir(parents=True)
    let_through(tmp_path)
    closed.chmod(0o700)
    with pytest.raises(InvalidArgument, match=f"{closed} is drwx------"):
        node_user._check_reachable(closed / "inner", UID, GID)
    closed.chmod(0o710)
    os.chown(closed, 0, GID)  # its group may search it
    node_user._check_reachable(closed / "inner", UID, GID)
    closed.chmod(0o700)
    os.chown(closed, UID, 0)  # its owner may
    node_user._check_reachable(closed / "inner", UID, GID)


def test_what_root_left_becomes_the_users_and_a_jails_joins_the_users_group(
    tmp_path: Path,
) -> None:
    data, run = tmp_path / "data", tmp_path / "run" / "node"
    gateway, jail = JAIL_UIDS[1], JAIL_UIDS[2]
    for path in (data / "egress/audit/x", data / "egress/ca/sb-1", data / "master.key"):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    (run / "vm-1").mkdir(parents=True)
    (run / "vm-1/qmp.sock").write_text("")  # a live VM's socket (a file will do)
    for path, uid in ((data / "egress", gateway), (data / "egress/audit", gateway),
                      (data / "egress/audit/x", gateway), (run / "vm-1", jail),
                      (run / "vm-1/qmp.sock", jail)):  # fmt: skip
        os.chown(path, uid, uid)
        path.chmod(0o700 if path.is_dir() else 0o600)
    (data / "elsewhere").symlink_to("/etc/passwd")
    let_through(tmp_path)
    node_user.prepare_directories(NodeConfig(data_dir=data, run_dir=run), (UID, GID))
    owners = {
        str(p.relative_to(tmp_path)): (p.lstat().st_uid, p.lstat().st_gid)
        for p in tmp_path.rglob("*")
        if p.lstat().st_uid != 0 or p.is_symlink()
    }
    assert owners == {
        "data": (UID, GID),
        "data/egress": (gateway, GID),  # the gateway's, shared with the agent
        "data/egress/audit": (gateway, gateway),  # handed over again at its start
        "data/egress/audit/x": (gateway, gateway),
        "data/egress/ca": (UID, GID),
        "data/egress/ca/sb-1": (UID, GID),
        "data/master.key": (UID, GID),
        "data/elsewhere": (0, 0),  # a link is never followed nor changed
        "run/node": (UID, GID),
        "run/node/vm-1": (jail, GID),
        "run/node/vm-1/qmp.sock": (jail, GID),
    }
    assert (run / "vm-1/qmp.sock").stat().st_mode & 0o777 == 0o660  # the agent connects
    assert (run / "vm-1").stat().st_mode & 0o7777 == 0o2770
    assert os.stat("/etc/passwd").st_uid == 0
