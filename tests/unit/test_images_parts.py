"""The pieces of an image build: modules, initramfs, tree customisation, commands."""

from __future__ import annotations

import gzip
import lzma
import os
import shutil
import stat
import subprocess
import time
from pathlib import Path

import pytest

from space.node.images import ImageBuildError, _kernel
from space.node.images._command import run_command
from space.node.images._initramfs import CpioEntry, init_script, pack_newc, write_initramfs
from space.node.images._kernel import KernelPackage, install_modules, module_load_order
from space.node.images._rootfs import GuestSource, customise

MEASURED_ORDER = [
    "virtio_ring",
    "virtio",
    "virtio_pci_legacy_dev",
    "virtio_pci_modern_dev",
    "virtio_pci",
    "virtio_console",
    "failover",
    "net_failover",
    "virtio_net",
    "virtio_blk",
]

# Excerpt of what depmod writes for Debian's 6.1 cloud kernel.
MODULES_DEP = """\
kernel/drivers/virtio/virtio.ko: kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_ring.ko:
kernel/drivers/virtio/virtio_pci_modern_dev.ko:
kernel/drivers/virtio/virtio_pci_legacy_dev.ko:
kernel/drivers/virtio/virtio_pci.ko: kernel/drivers/virtio/virtio_pci_legacy_dev.ko \
kernel/drivers/virtio/virtio_pci_modern_dev.ko kernel/drivers/virtio/virtio.ko \
kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/char/virtio_console.ko: kernel/drivers/virtio/virtio.ko \
kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/net/virtio_net.ko: kernel/drivers/net/net_failover.ko \
kernel/net/core/failover.ko kernel/drivers/virtio/virtio.ko kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/net/net_failover.ko: kernel/net/core/failover.ko
kernel/net/core/failover.ko:
kernel/drivers/block/virtio_blk.ko: kernel/drivers/virtio/virtio.ko \
kernel/drivers/virtio/virtio_ring.ko
kernel/arch/x86/crypto/crc32c-intel.ko:
"""


def _module_dir(tmp_path: Path, dep: str, builtin: str) -> Path:
    (tmp_path / "modules.dep").write_text(dep)
    (tmp_path / "modules.builtin").write_text(builtin)
    return tmp_path


def _names(paths: list[Path]) -> list[str]:
    return [p.name.split(".ko")[0] for p in paths]


def test_module_order_with_builtin_ext4_is_the_measured_one(tmp_path: Path) -> None:
    builtin = "kernel/fs/ext4/ext4.ko\nkernel/crypto/crc32c_generic.ko\n"
    moddir = _module_dir(tmp_path, MODULES_DEP, builtin)
    order = module_load_order(moddir)
    assert _names(order) == MEASURED_ORDER
    assert order[0] == moddir / "kernel/drivers/virtio/virtio_ring.ko"


def test_module_order_adds_ext4_and_its_dependencies_when_ext4_is_a_module(
    tmp_path: Path,
) -> None:
    dep = MODULES_DEP + (
        "kernel/fs/ext4/ext4.ko.xz: kernel/lib/crc16.ko.xz kernel/fs/mbcache.ko.xz "
        "kernel/fs/jbd2/jbd2.ko.xz\n"
        "kernel/lib/crc16.ko.xz:\nkernel/fs/mbcache.ko.xz:\nkernel/fs/jbd2/jbd2.ko.xz:\n"
        "kernel/crypto/crc32c_generic.ko.xz:\n"
    )
    order = _names(module_load_order(_module_dir(tmp_path, dep, "")))
    assert order[: len(MEASURED_ORDER)] == MEASURED_ORDER
    assert order[len(MEASURED_ORDER) :] == ["crc32c_generic", "jbd2", "mbcache", "crc16", "ext4"]


def test_negative_module_neither_built_in_nor_shipped_is_an_error(tmp_path: Path) -> None:
    dep = "\n".join(line for line in MODULES_DEP.split("\n") if "virtio_blk" not in line)
    with pytest.raises(ImageBuildError, match="virtio_blk"):
        module_load_order(_module_dir(tmp_path, dep, "kernel/fs/ext4/ext4.ko\n"))


def test_compressed_modules_are_installed_decompressed(tmp_path: Path) -> None:
    (tmp_path / "a.ko.xz").write_bytes(lzma.compress(b"ELF-a"))
    (tmp_path / "b-c.ko").write_bytes(b"ELF-b")
    sources = [tmp_path / "a.ko.xz", tmp_path / "b-c.ko"]
    if shutil.which("zstd"):
        subprocess.run(["zstd", "-q", "-o", str(tmp_path / "d.ko.zst")], input=b"ELF-d", check=True)
        sources.append(tmp_path / "d.ko.zst")
    names = install_modules(sources, tmp_path / "out")
    assert names[:2] == ["a", "b_c"]
    assert (tmp_path / "out" / "a.ko").read_bytes() == b"ELF-a"
    assert (tmp_path / "out" / "b_c.ko").read_bytes() == b"ELF-b"
    if len(sources) == 3:
        assert (tmp_path / "out" / "d.ko").read_bytes() == b"ELF-d"


def test_apt_answers_are_parsed_into_the_versioned_kernel_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answers = {
        "depends": "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-57-cloud-amd64\n",
        "show": "Package: linux-image-6.1.0-57-cloud-amd64\nVersion: 6.1.192-3\n"
        "Description: Linux 6.1\nSHA256: " + "ef" * 32 + "\n",
    }
    monkeypatch.setattr(_kernel, "run_command", lambda argv, **_: answers[argv[1]])
    package = _kernel._query_apt("linux-image-cloud-amd64")
    assert package == KernelPackage("linux-image-6.1.0-57-cloud-amd64", "6.1.192-3", "ef" * 32)


def test_negative_apt_without_the_metapackage_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_kernel, "run_command", lambda argv, **_: "")
    with pytest.raises(ImageBuildError, match="apt-get update"):
        _kernel._query_apt("linux-image-cloud-amd64")


def test_init_script_lists_the_modules_and_is_valid_sh() -> None:
    script = init_script(["virtio_ring", "virtio"])
    assert 'MODULES="virtio_ring virtio"' in script
    assert "exec switch_root /newroot" in script
    assert "poweroff -f" in script
    subprocess.run(["sh", "-n"], input=script.encode(), check=True)


def test_negative_init_script_rejects_a_module_name_with_shell_characters() -> None:
    with pytest.raises(ImageBuildError):
        init_script(["virtio; reboot"])


@pytest.mark.skipif(shutil.which("cpio") is None, reason="needs cpio to read the archive back")
def test_newc_archive_reads_back_with_cpio(tmp_path: Path) -> None:
    archive = pack_newc(
        [
            CpioEntry("bin", stat.S_IFDIR | 0o755),
            CpioEntry("bin/tool", stat.S_IFREG | 0o755, b"#!/bin/sh\n"),
            CpioEntry("bin/sh", stat.S_IFLNK | 0o777, b"tool"),
            CpioEntry("dev", stat.S_IFDIR | 0o755),
            CpioEntry("dev/console", stat.S_IFCHR | 0o600, rdev=(5, 1)),
        ]
    )
    listing = subprocess.run(
        ["cpio", "-itv", "--quiet"], input=archive, capture_output=True, check=True
    ).stdout.decode()
    lines = listing.splitlines()
    assert [line.split()[-1] for line in lines] == ["bin", "bin/tool", "tool", "dev", "dev/console"]
    assert lines[2].startswith("lrwxrwxrwx") and "bin/sh -> tool" in lines[2]
    assert lines[4].startswith("crw-------") and "5,   1" in lines[4]


def test_write_initramfs_holds_busybox_init_and_modules(tmp_path: Path) -> None:
    busybox = tmp_path / "busybox"
    busybox.write_bytes(b"BB")
    module = tmp_path / "virtio.ko"
    module.write_bytes(b"MOD")
    dest = tmp_path / "initrd.img"
    write_initramfs(
        dest, busybox=busybox, module_files=[module], script="#!/bin/sh\n", compress=True
    )
    archive = gzip.decompress(dest.read_bytes())
    assert archive.startswith(b"070701")
    for name in (b"init\0", b"bin/busybox\0", b"lib/modules/virtio.ko\0", b"bin/switch_root\0"):
        assert name in archive
    assert archive.rstrip(b"\0").endswith(b"TRAILER!!!")


def _fake_tree(root: Path) -> Path:
    etc = root / "etc"
    etc.mkdir(parents=True)
    (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (etc / "group").write_text("root:x:0:\n")
    (etc / "shadow").write_text("root:*:19000:0:99999:7:::\n")
    (etc / "gshadow").write_text("root:*::\n")
    (root / "usr/share/doc/python3").mkdir(parents=True)
    (root / "usr/share/doc/python3/copyright").write_text("text")
    return root


@pytest.mark.skipif(os.geteuid() != 0, reason="chowns files to uid 0 and 1000")
def test_customise_adds_user_daemon_init_and_hostname(tmp_path: Path) -> None:
    root = _fake_tree(tmp_path)
    customise(root, [GuestSource("__init__.py", b""), GuestSource("guest/init.py", b"G = 1\n")])
    assert "user:x:1000:1000:SPACE user:/home/user:/bin/sh" in (root / "etc/passwd").read_text()
    assert (root / "etc/group").read_text().endswith("user:x:1000:\n")
    assert (root / "etc/shadow").read_text().endswith("user:!:::::::\n")
    home = (root / "home/user").stat()
    assert (home.st_uid, home.st_gid) == (1000, 1000)
    init = root / "usr/lib/space/init"
    assert init.read_text() == (
        "#!/bin/sh\nexport PYTHONPATH=/usr/lib/space/python\n"
        'exec /usr/bin/python3 -B -m space.guest.init "$@"\n'
    )
    assert stat.S_IMODE(init.stat().st_mode) == 0o755
    package = root / "usr/lib/space/python/space"
    assert (package / "__init__.py").read_bytes() == b""
    assert (package / "guest/init.py").read_bytes() == b"G = 1\n"
    assert (root / "etc/hostname").read_text() == "space\n"
    assert "127.0.1.1\tspace" in (root / "etc/hosts").read_text()
    assert list((root / "usr/share/doc").iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="chowns files to uid 0 and 1000")
def test_negative_customise_refuses_a_base_tree_that_already_has_the_user(tmp_path: Path) -> None:
    root = _fake_tree(tmp_path)
    (root / "etc/passwd").write_text("user:x:1001:1001::/home/user:/bin/bash\n")
    with pytest.raises(ImageBuildError, match="already has an entry 'user'"):
        customise(root, [])


def test_negative_failing_command_error_names_it_and_carries_its_output() -> None:
    with pytest.raises(ImageBuildError) as info:
        run_command(["sh", "-c", "echo the-reason; exit 3"], timeout_s=10)
    assert info.value.command == ("sh", "-c", "echo the-reason; exit 3")
    assert info.value.output_tail == "the-reason"
    assert "status 3" in str(info.value)


def test_negative_command_past_its_deadline_is_killed_with_its_children() -> None:
    marker = f"{37 + os.getpid() % 1000}.123"
    start = time.monotonic()
    with pytest.raises(ImageBuildError, match="did not finish within"):
        run_command(["sh", "-c", f"sleep {marker} & sleep {marker}"], timeout_s=0.3)
    assert time.monotonic() - start < 5
    # SIGKILL is delivered at once but a grandchild may take a moment to be reaped.
    deadline = time.monotonic() + 5
    while _survivors(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _survivors(marker)


def _survivors(marker: str) -> list[Path]:
    return [p for p in Path("/proc").glob("[0-9]*/cmdline") if _cmdline_has(p, marker)]


def _cmdline_has(path: Path, marker: str) -> bool:
    try:
        return marker.encode() in path.read_bytes()
    except OSError:
        return False


def test_negative_missing_program_is_an_image_build_error() -> None:
    with pytest.raises(ImageBuildError, match="cannot run"):
        run_command(["/nonexistent/tool"], timeout_s=5)


def test_command_output_keeps_only_the_requested_tail() -> None:
    out = run_command(["sh", "-c", "yes x | head -c 100000; echo END"], timeout_s=10)
    assert out.endswith("END")
    assert len(out) <= 4096


def test_kernel_lookup_is_remembered_until_apt_lists_change(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    package = KernelPackage("linux-image-x", "1", "ab" * 32)
    queries: list[str] = []
    lists_mtime = [100]

    def query(meta: str) -> KernelPackage:
        queries.append(meta)
        return package

    monkeypatch.setattr(_kernel, "_query_apt", query)
    monkeypatch.setattr(_kernel, "_apt_lists_mtime_ns", lambda: lists_mtime[0])
    monkeypatch.setattr(_kernel, "_resolved", {})
    memo = tmp_path / "memo.json"
    assert _kernel.resolve_kernel_package("meta", memo_file=memo) == package
    monkeypatch.setattr(_kernel, "_resolved", {})  # as in a new process
    assert _kernel.resolve_kernel_package("meta", memo_file=memo) == package
    assert queries == ["meta"]
    lists_mtime[0] = 200  # apt-get update ran
    assert _kernel.resolve_kernel_package("meta", memo_file=memo) == package
    assert queries == ["meta", "meta"]
