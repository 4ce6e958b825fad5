"""The QEMU command line is a pure function of the VM config."""

from __future__ import annotations

from pathlib import Path

import pytest

from space.node.api import SandboxSpec, SandboxState
from space.node.core.keys import NodeKeys
from space.node.core.sandbox import hostname_for, vm_config_for
from space.node.core.state import SandboxRecord
from space.node.vmm.jail import TAP_FD, Bind
from space.node.vmm.qemu import (
    VmConfig,
    build_command,
    console_tail,
    jail_binds,
    jail_owned,
    trim_console,
)


def _config(**overrides: object) -> VmConfig:
    base: dict[str, object] = {
        "sandbox_id": "sb-1",
        "run_dir": Path("/run/space/x/sb-1"),
        "kernel": Path("/pool/sandboxes/sb-1/kernel"),
        "initrd": Path("/pool/sandboxes/sb-1/initrd"),
        "rootfs": Path("/pool/sandboxes/sb-1/rootfs.img"),
        "kernel_cmdline": "console=ttyS0 space.hostname=sb-1",
        "console_log": Path("/data/sandboxes/sb-1.console.log"),
        "cpus": 2,
        "memory_mib": 512,
    }
    base.update(overrides)
    return VmConfig(**base)  # type: ignore[arg-type]


def _option(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


def test_the_command_is_qemu_itself_and_its_nic_is_the_tap_the_jail_hands_over() -> None:
    # The jail enters namespaces and sets SCHED_BATCH; no nsenter or chrt in front.
    assert build_command(_config())[0] == "qemu-system-x86_64"
    argv = build_command(_config(netns=Path("/run/netns/sb")))
    assert _option(argv, "-netdev") == [f"tap,id=net0,fd={TAP_FD}"]
    assert not any("ifname" in arg for arg in argv)
    assert _option(build_command(_config()), "-netdev") == []


def test_a_vms_jail_binds_its_own_files_and_a_shared_ram_image_read_only() -> None:
    image = Path("/pool/templates/base/d.ready/memory.ram")
    private = _config(memory_file=image)
    assert Bind(image, "ro") in jail_binds(private)
    assert image not in jail_owned(private)  # every sandbox of the template maps it
    assert {b.path: b.mode for b in jail_binds(private)} == {
        Path("/pool/sandboxes/sb-1/kernel"): "ro",
        Path("/pool/sandboxes/sb-1/initrd"): "ro",
        Path("/pool/sandboxes/sb-1/rootfs.img"): "rw",
        Path("/data/sandboxes/sb-1.console.log"): "rw",
        Path("/run/space/x/sb-1"): "rw",
        image: "ro",
    }
    own = Path("/pool/sandboxes/sb-1/memory.ram")
    shared = _config(memory_file=own, memory_shared=True)
    assert Bind(own, "rw") in jail_binds(shared) and own in jail_owned(shared)
    assert Bind(Path("/dev/kvm"), "dev") in jail_binds(_config(accel="kvm"))
    assert Path("/dev/kvm") not in {b.path for b in jail_binds(_config())}


def test_command_line_has_no_default_devices_and_no_display() -> None:
    argv = build_command(_config())
    assert "-nodefaults" in argv and "-no-user-config" in argv
    assert _option(argv, "-display") == ["none"]


def test_tcg_uses_a_64_mib_translation_cache_and_a_cpu_without_fast_strings() -> None:
    argv = build_command(_config(accel="tcg"))
    assert _option(argv, "-accel") == ["tcg,tb-size=64"]
    (cpu,) = _option(argv, "-cpu")
    model, *features = cpu.split(",")
    assert model == "max" and {"-erms", "-fsrm"} <= set(features)


def test_kvm_uses_the_host_cpu_and_the_image_s_command_line_as_it_is() -> None:
    argv = build_command(_config(accel="kvm"))
    assert _option(argv, "-accel") == ["kvm"]
    assert _option(argv, "-cpu") == ["host"]
    assert _option(argv, "-append") == ["console=ttyS0 space.hostname=sb-1"]


def test_resources_kernel_and_cmdline_come_from_the_config() -> None:
    argv = build_command(_config())
    assert _option(argv, "-smp") == ["2"]
    assert _option(argv, "-m") == ["512"]
    assert _option(argv, "-kernel") == ["/pool/sandboxes/sb-1/kernel"]
    assert _option(argv, "-initrd") == ["/pool/sandboxes/sb-1/initrd"]
    assert _option(argv, "-append") == ["console=ttyS0 space.hostname=sb-1 no_timer_check"]


def test_rootfs_is_a_raw_virtio_blk_disk() -> None:
    argv = build_command(_config())
    (drive,) = _option(argv, "-drive")
    assert drive.startswith("file=/pool/sandboxes/sb-1/rootfs.img,")
    assert "format=raw" in drive.split(",")
    assert "virtio-blk-pci,drive=root" in _option(argv, "-device")


def test_a_failed_disk_write_or_read_is_the_guests_io_error_and_never_stops_the_vm() -> None:
    # QEMU's default werror=enospc pauses the VM on the host's ENOSPC (issue 17).
    (drive,) = _option(build_command(_config()), "-drive")
    assert {"werror=report", "rerror=report"} <= set(drive.split(","))


def test_agent_port_is_a_named_virtio_serial_port_on_a_server_socket() -> None:
    argv = build_command(_config())
    chardevs = _option(argv, "-chardev")
    assert "socket,id=agent,path=/run/space/x/sb-1/agent.sock,server=on,wait=off" in chardevs
    devices = _option(argv, "-device")
    assert "virtio-serial-pci,id=vser" in devices
    assert "virtserialport,bus=vser.0,chardev=agent,name=space.agent" in devices


def test_qmp_and_console_live_in_the_run_dir_and_data_dir() -> None:
    argv = build_command(_config())
    assert _option(argv, "-qmp") == ["unix:/run/space/x/sb-1/qmp.sock,server=on,wait=off"]
    # QEMU is PID 1 of its namespace: the jail writes the host pid, not QEMU.
    assert _option(argv, "-pidfile") == []
    assert "file,id=console,path=/data/sandboxes/sb-1.console.log,append=on" in _option(
        argv, "-chardev"
    )
    assert _option(argv, "-serial") == ["chardev:console"]


def test_seccomp_sandbox_denies_spawn_privileges_and_resource_control() -> None:
    (sandbox,) = _option(build_command(_config()), "-sandbox")
    assert sandbox.split(",") == [
        "on",
        "obsolete=deny",
        "elevateprivileges=deny",
        "spawn=deny",
        "resourcecontrol=deny",
    ]


def _backend(argv: list[str]) -> dict[str, str]:
    (machine,) = _option(argv, "-machine")
    assert machine.split(",")[1:] == ["memory-backend=ram"]
    (backend,) = _option(argv, "-object")
    kind, *options = backend.split(",")
    return {"kind": kind, **dict(option.split("=", 1) for option in options)}


def test_guest_ram_is_anonymous_by_default_in_a_backend_named_ram() -> None:
    # Saved states name the RAM block: anonymous and file-backed RAM must both be "ram".
    backend = _backend(build_command(_config()))
    assert backend == {"kind": "memory-backend-ram", "id": "ram", "size": "512M"}


def test_guest_ram_from_a_file_is_a_private_mapping_unless_shared() -> None:
    image = Path("/pool/templates/base/d.ready/memory.ram")
    private = _backend(build_command(_config(memory_file=image)))
    assert private == {
        "kind": "memory-backend-file",
        "id": "ram",
        "size": "512M",
        "mem-path": str(image),
        "share": "off",
        # opened read-only, mapped copy-on-write: a jailed QEMU cannot write the image
        "readonly": "on",
        "rom": "off",
    }
    shared = _backend(build_command(_config(memory_file=image, memory_shared=True)))
    assert shared["share"] == "on"


def test_guest_reboot_ends_qemu_instead_of_rebooting() -> None:
    assert "-no-reboot" in build_command(_config())


def test_console_is_trimmed_to_its_cap_keeping_the_tail(tmp_path: Path) -> None:
    log = tmp_path / "sb.console.log"
    log.write_bytes(b"a" * 3000 + b"THE END")
    trim_console(log, 1000)
    assert log.stat().st_size == 0
    assert console_tail(log, 100).endswith("THE END")
    assert len(log.with_suffix(".old").read_bytes()) <= 500


def test_console_under_its_cap_is_left_alone(tmp_path: Path) -> None:
    log = tmp_path / "sb.console.log"
    log.write_bytes(b"boot ok\n")
    trim_console(log, 1000)
    assert log.read_bytes() == b"boot ok\n"
    assert console_tail(log, 3) == "ok\n"


def test_sandbox_kernel_cmdline_adds_a_hostname_derived_from_the_id() -> None:
    record = SandboxRecord(
        spec=SandboxSpec("Team_A.sb-42", cpus=2, memory_mib=384),
        state=SandboxState.CREATING,
        created_at=0.0,
        template_digest="d",
        run_dir="/run/space/x/Team_A.sb-42",
    )
    cfg = vm_config_for(
        record,
        volume=Path("/pool/sandboxes/Team_A.sb-42"),
        base_cmdline="console=ttyS0 quiet",
        accel="tcg",
        console_log=Path("/data/c.log"),
        keys=NodeKeys.from_node_key(bytes(32)),
    )
    assert "disk_passphrase" not in repr(cfg) and cfg.keys is not None
    assert cfg.kernel_cmdline == (
        "console=ttyS0 quiet space.hostname=team-a-sb-42 space.net=192.0.2.2/30,192.0.2.1"
    )
    assert (cfg.cpus, cfg.memory_mib) == (2, 384)
    # The VM boots from its own volume's copies, never the template's files.
    assert cfg.rootfs == Path("/pool/sandboxes/Team_A.sb-42/rootfs.img")
    assert cfg.kernel.parent == cfg.initrd.parent == cfg.rootfs.parent


@pytest.mark.parametrize(
    "sandbox_id, hostname",
    [("sb-1", "sb-1"), ("--x--", "x"), ("___", "sandbox"), ("a" * 63, "a" * 63)],
)
def test_hostnames_are_valid_whatever_the_id(sandbox_id: str, hostname: str) -> None:
    assert hostname_for(sandbox_id) == hostname
