"""spaced's account lookups (issue 21): remembered between requests, since looking an
account up cost an exec under gVisor more than a millisecond, and looked up again as
soon as an account file changes."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

import pytest

from space.guest import _request
from space.guest._errors import OpError
from space.guest._request import Accounts, Fields


@pytest.fixture
def files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    passwd, group = tmp_path / "passwd", tmp_path / "group"
    passwd.write_text("x\n")
    group.write_text("x\n")
    monkeypatch.setattr(_request, "_ACCOUNT_FILES", (str(passwd), str(group)))
    return passwd, group


def test_an_account_is_looked_up_once_until_an_account_file_changes(
    files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    me = pwd.getpwuid(os.geteuid())
    looked_up: list[str] = []
    real_getpwnam = pwd.getpwnam

    def getpwnam(name: str) -> pwd.struct_passwd:
        looked_up.append(name)
        return real_getpwnam(name)

    monkeypatch.setattr(pwd, "getpwnam", getpwnam)
    accounts = Accounts(user_default=me.pw_name, home_default="/home/someone")
    as_user, as_me = Fields({}), Fields({"user": me.pw_name})
    first = accounts.get(as_user)
    assert (first.name, first.uid, first.home) == (me.pw_name, me.pw_uid, "/home/someone")
    assert accounts.get(as_user) == first and looked_up == [me.pw_name]
    # The same account by its own name is another entry: its home is its own.
    assert accounts.get(as_me).home == (me.pw_dir or "/")
    assert len(looked_up) == 2
    for changed in files:
        before = len(looked_up)
        changed.write_text("x\ny\n")  # useradd, groupadd, usermod -aG
        assert accounts.get(as_user) == first
        assert len(looked_up) == before + 1
        assert accounts.get(as_user) == first and len(looked_up) == before + 1
    files[1].unlink()
    accounts.get(as_user)
    assert len(looked_up) == 5


def test_negative_an_unknown_user_is_refused_every_time_and_never_remembered(
    files: tuple[Path, Path],
) -> None:
    accounts = Accounts()
    for _ in range(2):
        with pytest.raises(OpError, match="unknown user 'no-such-user-here'"):
            accounts.get(Fields({"user": "no-such-user-here"}))
    assert accounts._known == {}


def test_what_is_remembered_is_bounded(files: tuple[Path, Path]) -> None:
    accounts = Accounts()
    me = pwd.getpwuid(os.geteuid()).pw_name
    accounts.get(Fields({"user": me}))
    accounts._known.update({f"name{n}": accounts._known[me] for n in range(_request._MAX_KNOWN)})
    accounts.get(Fields({"user": me}))
    assert list(accounts._known) == [me]
