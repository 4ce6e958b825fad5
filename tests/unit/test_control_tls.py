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


# the node API over TLS (issue 19: moves and template shipments stream between nodes)


@contextlib.asynccontextmanager
async def _node_serving(tls: TlsFiles) -> AsyncIterator[str]:
    """A FakeNode's node API over HTTPS on a free loopback port; yields its URL."""
    from space.node.http.server import create_node_app, node_server

    port = free_port()
    app = create_node_app(FakeNode("tls-node"), "node-token")
    server = node_server(app, host="127.0.0.1", port=port, tls=(tls.cert, tls.key))
    serving = asyncio.create_task(server.serve())
    try:
        for _ in range(250):
            if server.started:
                break
            assert not serving.done(), serving
            await asyncio.sleep(0.02)
        yield f"https://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await serving


async def test_the_node_api_serves_https_and_is_reached_with_its_ca(tmp_path: Path) -> None:
    from space.control.nodes import remote_factory
    from space.node.api import Unavailable as NodeUnavailable

    tls = _write_pair(tmp_path, "node")
    other = _write_pair(tmp_path, "other")
    async with _node_serving(tls) as url:
        trusted = remote_factory(tls.cert)(url, "node-token")
        try:
            assert (await trusted.info()).node_id == "tls-node"
        finally:
            await trusted.aclose()  # type: ignore[attr-defined]
        for refused in (remote_factory(other.cert), remote_factory(None)):
            node = refused(url, "node-token")
            try:
                with pytest.raises(NodeUnavailable):
                    await node.info()  # another CA's, or the system's: not this one
            finally:
                await node.aclose()  # type: ignore[attr-defined]


async def test_a_node_registers_with_an_https_control_plane_trusting_its_ca(
    tmp_path: Path,
) -> None:
    from space.control.server import register_remote_node
    from space.node.api import Unavailable as NodeUnavailable
    from space.node.http.client import ca_context

    tls = _write_pair(tmp_path, "server")
    settings = ControlSettings(data_dir=tmp_path / "data", reaper_interval_s=3600.0)
    async with _serving(settings, tls) as port:
        url, token = f"https://127.0.0.1:{port}", settings.token_file.read_text().strip()
        every = await register_remote_node(
            url, token, "https://127.0.0.1:9", "far", verify=ca_context(tls.cert)
        )
        assert every > 0
        with pytest.raises(NodeUnavailable, match="unreachable"):
            await register_remote_node(url, token, "https://127.0.0.1:9", "far")


def test_negative_space_node_takes_both_tls_files_or_neither(tmp_path: Path) -> None:
    tls = _write_pair(tmp_path, "node")
    token = tmp_path / "token"
    token.write_text("t\n")
    result = CliRunner().invoke(
        main,
        ["node", "--control-url", "http://127.0.0.1:9", "--token-file", str(token),
         "--data-dir", str(tmp_path / "d"), "--tls-cert", str(tls.cert)],
    )  # fmt: skip
    assert result.exit_code != 0 and "--tls-key" in result.output
