"""system.identity: validation on both ends, spaced's --stdio recording, the Linux parts
that are safe to run on a host (struct packing, file replacement)."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from space.guest import _identity
from space.guest.__main__ import _parse
from space.guest._errors import OpError
from space.guest._identity import (
    RNDADDENTROPY,
    RNDRESEEDCRNG,
    GvisorSystem,
    LinuxSystem,
    RecordingSystem,
    apply_identity,
    hosts_with,
    is_space_guest,
    pack_rand_pool_info,
    replace_file,
    system_for,
    write_host_name,
    write_machine_id,
)
from space.node.api import InvalidArgument, Unavailable
from space.node.channel import GuestChannel
from space.node.channel._parse import parse_applied
from space.protocol import (
    MAX_TIME_NS,
    MIN_TIME_NS,
    ErrorCode,
    Frame,
    FrameDecoder,
    FrameKind,
    Identity,
    ProtocolError,
    decode_json,
    encode_frame,
    encode_json,
)

from ._guest_harness import Guest, run_with_channel

MACHINE_ID = "0123456789abcdef0123456789abcdef"
ENTROPY = bytes(range(64))
NOW_NS = 1_750_000_000 * 10**9


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# -- through spaced --stdio --


def test_set_identity_applies_every_field_clock_first_and_spaced_records_them(
    tmp_path: Path,
) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        applied = await channel.set_identity(
            hostname="sb-fork-1", machine_id=MACHINE_ID, entropy=ENTROPY, time_ns=NOW_NS
        )
        assert applied == ["time_ns", "entropy", "hostname", "machine_id"]
        assert guest.identity_changes() == [
            {"change": "clock", "time_ns": NOW_NS},
            {"change": "entropy", "entropy": b64(ENTROPY)},
            {"change": "hostname", "hostname": "sb-fork-1"},
            {"change": "machine_id", "machine_id": MACHINE_ID},
        ]

    run_with_channel(tmp_path, body)


def test_set_identity_with_one_field_applies_only_that_field(tmp_path: Path) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        assert await channel.set_identity(time_ns=MAX_TIME_NS) == ["time_ns"]
        assert guest.identity_changes() == [{"change": "clock", "time_ns": MAX_TIME_NS}]

    run_with_channel(tmp_path, body)


def test_stdio_spaced_leaves_the_hosts_hostname_and_machine_id_alone(tmp_path: Path) -> None:
    before = (socket.gethostname(), _read("/etc/machine-id"), _read("/etc/hostname"))

    async def body(channel: GuestChannel, guest: Guest) -> None:
        await channel.set_identity(hostname="not-this-host", machine_id=MACHINE_ID)
        assert [change["change"] for change in guest.identity_changes()] == [
            "hostname",
            "machine_id",
        ]

    run_with_channel(tmp_path, body)
    assert (socket.gethostname(), _read("/etc/machine-id"), _read("/etc/hostname")) == before


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


GUEST_REJECTS: list[dict[str, object]] = [
    {},
    {"hostname": None},
    {"hostname": "ok", "color": "blue"},
    {"machine_id": "a" * 31},
    {"machine_id": "a" * 33},
    {"machine_id": "A" * 32},
    {"machine_id": "0" * 32},
    {"machine_id": "g" * 32},
    {"machine_id": 7},
    {"entropy": b64(b"x" * 31)},
    {"entropy": b64(b"x" * 513)},
    {"entropy": b64(b"x" * 32).rstrip("=")},
    {"entropy": "!" * 44},
    {"entropy": 32},
    {"hostname": "a" * 64},
    {"hostname": "a" * 32 + "." + "b" * 32},
    {"hostname": "Host"},
    {"hostname": "under_score"},
    {"hostname": "-lead"},
    {"hostname": "trail-"},
    {"hostname": "a..b"},
    {"hostname": "dot."},
    {"hostname": ""},
    {"hostname": "new\nline"},
    {"hostname": ["a"]},
    {"time_ns": MIN_TIME_NS - 1},
    {"time_ns": MAX_TIME_NS + 1},
    {"time_ns": True},
    {"time_ns": float(NOW_NS)},
    {"time_ns": str(NOW_NS)},
    # One malformed field spoils the request: the valid clock is not set either.
    {"time_ns": NOW_NS, "machine_id": "a" * 33},
]


def test_negative_spaced_rejects_each_malformed_identity_and_records_nothing(
    tmp_path: Path,
) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        for fields in GUEST_REJECTS:
            request = {"op": "system.identity", **fields}
            with pytest.raises(InvalidArgument):
                await channel._request(request, lambda message: message)
            assert guest.identity_changes() == [], fields
        assert await channel.ping() < 1.0  # the guest and the channel carry on

    run_with_channel(tmp_path, body)


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"machine_id": "a" * 31},
        {"machine_id": "a" * 33},
        {"entropy": b"x" * 31},
        {"entropy": b"x" * 513},
        {"hostname": "a" * 64},
        {"time_ns": MIN_TIME_NS - 1},
        {"time_ns": MAX_TIME_NS + 1},
    ],
    ids=lambda kwargs: ",".join(f"{k}={str(v)[:12]}" for k, v in kwargs.items()) or "none",
)
def test_negative_set_identity_refuses_bad_arguments_before_sending(
    tmp_path: Path, kwargs: dict[str, object]
) -> None:
    async def body(channel: GuestChannel, guest: Guest) -> None:
        with pytest.raises(InvalidArgument) as refused:
            await channel.set_identity(**kwargs)  # type: ignore[arg-type]
        assert refused.value.sandbox_id == "sb-test"
        assert guest.identity_changes() == []
        assert await channel.ping() < 1.0

    run_with_channel(tmp_path, body)


# -- the protocol's Identity --


@pytest.mark.parametrize(
    "identity",
    [
        Identity(hostname="a" * 63),
        Identity(hostname="a" * 31 + "." + "b" * 32),  # 64 characters in all
        Identity(hostname="0-9.x"),
        Identity(machine_id="0" * 31 + "1"),
        Identity(entropy=b"\0" * 32),
        Identity(entropy=b"\xff" * 512),
        Identity(time_ns=MIN_TIME_NS),
        Identity(time_ns=MAX_TIME_NS),
    ],
    ids=repr,
)
def test_identity_at_each_limit_round_trips_through_its_request(identity: Identity) -> None:
    assert Identity.from_request(identity.to_request()) == identity


def test_identity_limits_are_the_years_2000_to_2200() -> None:
    assert MIN_TIME_NS == 946_684_800 * 10**9  # 2000-01-01T00:00:00Z
    assert MAX_TIME_NS + 1 == 7_289_654_400 * 10**9  # 2201-01-01T00:00:00Z


@pytest.mark.parametrize("fields", GUEST_REJECTS, ids=lambda fields: repr(fields)[:50])
def test_negative_identity_from_request_raises_protocol_error(fields: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        Identity.from_request({"op": "system.identity", **fields})


# -- the host's check of the answer --


ALL = ["time_ns", "entropy", "hostname", "machine_id"]


def test_parse_applied_accepts_exactly_the_requested_names_in_any_order() -> None:
    assert parse_applied({"applied": list(reversed(ALL))}, ALL) == list(reversed(ALL))
    assert parse_applied({"applied": ["hostname"]}, ["hostname"]) == ["hostname"]


@pytest.mark.parametrize(
    "applied",
    [None, "hostname", [], ["machine_id"], ["hostname", "hostname"], ["hostname", 1], ALL * 2],
    ids=repr,
)
def test_negative_parse_applied_refuses_a_hostile_answer(applied: object) -> None:
    with pytest.raises(ProtocolError):
        parse_applied({"applied": applied}, ["hostname"])


async def _lying_guest(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers HELLO, then claims to have applied a field nobody asked for."""
    decoder = FrameDecoder()
    frames: list[Frame] = []

    async def next_frame() -> Frame:
        while not frames:
            data = await reader.read(65536)
            assert data, "the host hung up"
            frames.extend(decoder.feed(data))
        return frames.pop(0)

    session = decode_json((await next_frame()).payload)["session"]
    answer = {"version": 1, "agent": "liar/1", "session": session}
    writer.write(encode_frame(FrameKind.HELLO, 0, encode_json(answer)))
    request = await next_frame()
    assert decode_json(request.payload) == {"op": "system.identity", "hostname": "h"}
    result = {"ok": True, "applied": ["hostname", "machine_id"]}
    writer.write(encode_frame(FrameKind.RESULT, request.stream, encode_json(result)))
    await writer.drain()


def test_negative_a_guest_that_lies_about_applied_gets_its_channel_closed() -> None:
    async def main() -> None:
        host_sock, guest_sock = socket.socketpair()
        guest_reader, guest_writer = await asyncio.open_connection(sock=guest_sock)
        host_reader, host_writer = await asyncio.open_connection(sock=host_sock)
        opening = asyncio.create_task(
            GuestChannel.open(host_reader, host_writer, sandbox_id="sb-liar", hello_timeout_s=5)
        )
        liar = asyncio.create_task(_lying_guest(guest_reader, guest_writer))
        await asyncio.sleep(0)
        channel = await opening
        try:
            with pytest.raises(Unavailable) as broken:
                await channel.set_identity(hostname="h")
            assert broken.value.sandbox_id == "sb-liar" and channel.closed
        finally:
            await channel.close()
            await liar
            guest_writer.close()
            await guest_writer.wait_closed()

    asyncio.run(main())


# -- spaced's choice of system --


def test_stdio_mode_always_gets_the_recording_system(tmp_path: Path) -> None:
    record = str(tmp_path / "record")
    for argv in (["--stdio"], ["--stdio", "--identity-record", record]):
        args = _parse(argv)
        system = system_for(args.stdio, args.identity_record)
        assert isinstance(system, RecordingSystem) and not isinstance(system, LinuxSystem)
    assert isinstance(system_for(False, None), LinuxSystem)


def test_negative_identity_record_without_stdio_is_refused() -> None:
    with pytest.raises(SystemExit):
        _parse(["--identity-record", "/tmp/x"])


def test_gvisor_mode_gets_the_gvisor_system_and_needs_stdio_alone() -> None:
    args = _parse(["--stdio", "--gvisor"])
    assert isinstance(
        system_for(args.stdio, args.identity_record, gvisor=args.gvisor), GvisorSystem
    )
    for argv in (["--gvisor"], ["--stdio", "--gvisor", "--identity-record", "/tmp/x"]):
        with pytest.raises(SystemExit):
            _parse(argv)


def test_negative_the_gvisor_system_refuses_to_act_unless_spaced_is_pid_1() -> None:
    # This test's process is never PID 1: nothing of the host is touched.
    system = GvisorSystem()
    changes: list[Callable[[], None]] = [
        lambda: system.set_hostname("elsewhere"),
        lambda: system.set_machine_id(MACHINE_ID),
        lambda: system.set_clock_ns(NOW_NS),
        lambda: system.add_entropy(ENTROPY),
    ]
    for change in changes:
        with pytest.raises(OpError) as refused:
            change()
        assert refused.value.code is ErrorCode.PERMISSION_DENIED
    # As the init, the clock and the RNG are the host's already: nothing to change.
    as_init = GvisorSystem(pid=1)
    as_init.set_clock_ns(NOW_NS)
    as_init.add_entropy(ENTROPY)


def test_negative_the_linux_system_refuses_to_act_outside_a_space_guest() -> None:
    # Adding 32 random bytes to the host's pool would be harmless if this failed.
    assert not is_space_guest()
    with pytest.raises(OpError) as refused:
        LinuxSystem().add_entropy(os.urandom(32))
    assert refused.value.code is ErrorCode.PERMISSION_DENIED


def test_is_space_guest_reads_pid_1s_command_line(tmp_path: Path) -> None:
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"/usr/bin/python3\0-B\0-m\0space.guest.init\0")
    assert is_space_guest(str(cmdline))
    cmdline.write_bytes(b"/sbin/init\0space.guest.init.fake\0")
    assert not is_space_guest(str(cmdline))
    assert not is_space_guest(str(tmp_path / "missing"))


# -- the Linux parts that are pure or work on files --


def _ioc(direction: int, kind: str, number: int, size: int) -> int:
    """_IOC of asm-generic/ioctl.h (x86): dir << 30 | size << 16 | type << 8 | nr."""
    return direction << 30 | size << 16 | ord(kind) << 8 | number


def test_ioctl_numbers_match_linux_random_h() -> None:
    assert _ioc(1, "R", 0x03, 2 * 4) == RNDADDENTROPY  # _IOW('R', 0x03, int[2])
    assert _ioc(0, "R", 0x07, 0) == RNDRESEEDCRNG  # _IO('R', 0x07)
    header = Path("/usr/include/linux/random.h")
    if header.exists():
        text = re.sub(r"\s+", "", header.read_text())
        assert "#defineRNDADDENTROPY_IOW('R',0x03,int[2])" in text
        assert "#defineRNDRESEEDCRNG_IO('R',0x07)" in text


@pytest.mark.parametrize("size", [32, 33, 512])
def test_pack_rand_pool_info_credits_every_bit_and_carries_the_bytes(size: int) -> None:
    data = os.urandom(size)
    packed = pack_rand_pool_info(data)
    assert isinstance(packed, bytearray) and len(packed) == 8 + size
    assert struct.unpack("=ii", packed[:8]) == (size * 8, size)
    assert bytes(packed[8:]) == data
    if struct.pack("=i", 1) == b"\1\0\0\0":  # little-endian hosts (x86-64)
        assert packed[:8] == (size * 8).to_bytes(4, "little") + size.to_bytes(4, "little")


def _tree(root: Path) -> None:
    (root / "etc").mkdir()
    (root / "etc/machine-id").write_text("old\n")
    (root / "var/lib/dbus").mkdir(parents=True)


def test_write_machine_id_replaces_etc_and_a_regular_dbus_copy(tmp_path: Path) -> None:
    _tree(tmp_path)
    (tmp_path / "var/lib/dbus/machine-id").write_text("old\n")
    write_machine_id(str(tmp_path), MACHINE_ID)
    for rel in ("etc/machine-id", "var/lib/dbus/machine-id"):
        assert (tmp_path / rel).read_text() == MACHINE_ID + "\n"
        assert stat.S_IMODE((tmp_path / rel).stat().st_mode) == 0o444
    assert sorted(p.name for p in (tmp_path / "etc").iterdir()) == ["machine-id"]


def test_write_machine_id_leaves_a_dbus_symlink_and_a_missing_copy_alone(tmp_path: Path) -> None:
    _tree(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("keep\n")
    link = tmp_path / "var/lib/dbus/machine-id"
    link.symlink_to(elsewhere)
    write_machine_id(str(tmp_path), MACHINE_ID)
    assert link.is_symlink() and elsewhere.read_text() == "keep\n"
    link.unlink()
    write_machine_id(str(tmp_path), MACHINE_ID)
    assert not link.exists()


def test_replace_file_replaces_a_symlink_instead_of_following_it(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_text("keep")
    (tmp_path / "hostname").symlink_to(target)
    replace_file(str(tmp_path / "hostname"), b"new\n", 0o644)
    assert (tmp_path / "hostname").read_text() == "new\n"
    assert not (tmp_path / "hostname").is_symlink() and target.read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hostname", "target"]


def test_negative_replace_file_that_fails_leaves_no_temp_file(tmp_path: Path) -> None:
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir/sub").mkdir()
    with pytest.raises(IsADirectoryError):
        replace_file(str(tmp_path / "dir/sub"), b"x", 0o644)
    assert [p.name for p in (tmp_path / "dir").iterdir()] == ["sub"]


# -- applying, with a fake system --


class FailingSystem(RecordingSystem):
    """Records like --stdio mode; fails on ``fail_on``."""

    def __init__(self, path: Path, fail_on: str) -> None:
        super().__init__(str(path))
        self.fail_on = fail_on

    def set_hostname(self, hostname: str) -> None:
        if self.fail_on == "hostname":
            raise PermissionError(1, "Operation not permitted")
        super().set_hostname(hostname)


def test_negative_a_failing_step_stops_and_names_what_was_applied(tmp_path: Path) -> None:
    record = tmp_path / "record"
    identity = Identity(hostname="h", machine_id=MACHINE_ID, time_ns=NOW_NS)
    with pytest.raises(OpError) as failed:
        apply_identity(identity, FailingSystem(record, "hostname"))
    assert failed.value.code is ErrorCode.PERMISSION_DENIED
    assert "hostname" in failed.value.message and "['time_ns']" in failed.value.message
    assert record.read_text().splitlines() == [f'{{"change": "clock", "time_ns": {NOW_NS}}}']


def test_the_identity_module_keeps_the_real_system_out_of_stdio_mode() -> None:
    # system_for is the only place spaced's entry point builds a system.
    source = Path(_identity.__file__).with_name("__main__.py").read_text()
    assert "LinuxSystem" not in source and "system_for(" in source


def test_hosts_with_names_the_host_on_127_0_1_1_and_keeps_other_lines() -> None:
    text = "127.0.0.1\tlocalhost\n127.0.1.1\tspace\n::1\tlocalhost ip6-localhost\n10.0.0.5 db\n"
    assert hosts_with(text, "kid-a") == (
        "127.0.0.1\tlocalhost\n127.0.1.1\tkid-a\n::1\tlocalhost ip6-localhost\n10.0.0.5 db\n"
    )
    assert hosts_with("", "x") == "127.0.1.1\tx\n"
    assert hosts_with(hosts_with(text, "a"), "b") == hosts_with(text, "b")  # one line only


def test_write_host_name_rewrites_hostname_and_hosts(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/hosts").write_text("127.0.0.1\tlocalhost\n127.0.1.1\tspace\n")
    write_host_name(str(tmp_path), "kid-b")
    assert (tmp_path / "etc/hostname").read_text() == "kid-b\n"
    assert (tmp_path / "etc/hosts").read_text() == "127.0.0.1\tlocalhost\n127.0.1.1\tkid-b\n"
