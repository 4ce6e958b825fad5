"""The REST API over TLS (issue 18): ``space serve --tls-cert/--tls-key``, and the SDK's
``ca_bundle`` to trust a private CA. A self-signed certificate for 127.0.0.1 is made
here with ``cryptography``; the control plane runs on a loopback port over a FakeNode."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from cryptography import x509

from space.cli import main
from space.control import ControlSettings, TlsFiles, create_key, run_control_plane
from space.sdk import AsyncSpace, InvalidArgument, Unavailable
from tests.ports import free_port
from tests.tls import write_self_signed
from tests.unit.fakes import FakeNode

pytestmark = pytest.mark.anyio


def _write_pair(directory: Path, name: str) -> TlsFiles:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, PEM, 0600."""
    files = TlsFiles(directory / f"{name}.crt", directory / f"{name}.key")
    loopback = x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
    write_self_signed(files.cert, files.key, name, [loopback], ca=True)
    return files


@contextlib.asynccontextmanager
async def _serving(settings: ControlSettings, tls: TlsFiles) -> AsyncIterator[int]:
    """run_control_plane over HTTPS on a free port; yields the port once it answers."""
    port = free_port()
    server = asyncio.create_task(
        run_control_plane(settings, FakeNode(), host="127.0.0.1", port=port, tls=tls)
    )
    verify = ssl.create_default_context(cafile=tls.cert)
    try:
        async with httpx.AsyncClient(verify=verify) as client:
            for _ in range(250):
                with contextlib.suppress(httpx.TransportError):
                    await client.get(f"https://127.0.0.1:{port}/openapi.json")
                    break
                assert not server.done(), server
                await asyncio.sleep(0.02)
        yield port
    finally:
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server


async def test_the_sdk_talks_to_an_https_api_with_its_ca_bundle(tmp_path: Path) -> None:
    tls = _write_pair(tmp_path, "server")
    settings = ControlSettings(data_dir=tmp_path / "data", reaper_interval_s=3600.0)
    async with _serving(settings, tls) as port:
        key = create_key(settings, "acme")
        url = f"https://127.0.0.1:{port}"
        async with AsyncSpace(url, key, ca_bundle=str(tls.cert)) as space:
            assert await space.sandboxes.list() == []


async def test_negative_the_sdk_refuses_an_https_api_signed_by_another_ca(
    tmp_path: Path,
) -> None:
    tls = _write_pair(tmp_path, "server")
    other = _write_pair(tmp_path, "other")
    settings = ControlSettings(data_dir=tmp_path / "data", reaper_interval_s=3600.0)
    async with _serving(settings, tls) as port:
        key = create_key(settings, "acme")
        async with AsyncSpace(f"https://127.0.0.1:{port}", key, ca_bundle=str(other.cert)) as sp:
            with pytest.raises(Unavailable):
                await sp.sandboxes.list()


async def test_negative_plain_http_to_the_tls_port_gets_no_answer(tmp_path: Path) -> None:
    tls = _write_pair(tmp_path, "server")
    settings = ControlSettings(data_dir=tmp_path / "data", reaper_interval_s=3600.0)
    async with _serving(settings, tls) as port, httpx.AsyncClient() as client:
        with pytest.raises(httpx.TransportError):
            await client.get(f"http://127.0.0.1:{port}/openapi.json", timeout=5)


def test_negative_an_unreadable_ca_bundle_is_an_invalid_argument(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="CA bundle"):
        AsyncSpace("https://127.0.0.1:1", ca_bundle=str(tmp_path / "absent.pem"))


def test_negative_a_key_that_does_not_match_the_certificate_is_refused(tmp_path: Path) -> None:
    one, two = _write_pair(tmp_path, "one"), _write_pair(tmp_path, "two")
    with pytest.raises(ValueError, match="cannot be served"):
        TlsFiles(one.cert, two.key).check()


def test_negative_an_unreadable_tls_file_is_named(tmp_path: Path) -> None:
    one = _write_pair(tmp_path, "one")
    with pytest.raises(ValueError, match=r"--tls-key .*absent\.key: cannot read it"):
        TlsFiles(one.cert, tmp_path / "absent.key").check()


@pytest.mark.parametrize(
    ("given", "missing"), [("--tls-cert", "--tls-key"), ("--tls-key", "--tls-cert")]
)
def test_negative_serve_refuses_one_tls_option_without_the_other(
    tmp_path: Path, given: str, missing: str
) -> None:
    one = _write_pair(tmp_path, "one")
    path = one.cert if given == "--tls-cert" else one.key
    data = tmp_path / "data"
    done = CliRunner().invoke(main, ["serve", "--data-dir", str(data), given, str(path)])
    assert done.exit_code == 2
    assert f"error: {given} needs {missing} too" in done.output
    assert not data.exists()  # refused before anything was written


def test_negative_serve_refuses_a_mismatched_pair_before_starting(tmp_path: Path) -> None:
    one, two = _write_pair(tmp_path, "one"), _write_pair(tmp_path, "two")
    data = tmp_path / "data"
    args = [
        "serve",
        "--data-dir",
        str(data),
        "--tls-cert",
        str(one.cert),
        "--tls-key",
        str(two.key),
    ]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 2
    assert "cannot be served" in done.output
    assert not data.exists()
