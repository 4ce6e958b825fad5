"""Server-side commands: serve, node, keys (and what ``space control`` shares with them).

The node and control-plane packages are imported inside the command functions, so
``space --help`` stays fast and an SDK-only use of the CLI never imports them.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal, cast
from urllib.parse import urlsplit

import click

from space.cli._cluster import cluster_files, cluster_options, cluster_settings
from space.cli._common import ProgressPrinter, fail
from space.limits import (
    DEFAULT_BUILD_CACHE_GIB,
    DEFAULT_BUILD_SLOTS,
    DEFAULT_MEMORY_OVERCOMMIT,
    DEFAULT_POOL_SIZE_GIB,
    MEMORY_RESERVE_MIB,
    MEMORY_RESERVE_SHARE,
    POOL_RESERVE_MIB,
    POOL_RESERVE_SHARE,
)
from space.sdk.errors import SpaceError

if TYPE_CHECKING:
    from space.control.server import TlsFiles
    from space.control.settings import ControlSettings
    from space.node.core.config import NodeConfig

__all__ = [
    "DATABASE_OPTION",
    "DATA_DIR_OPTION",
    "capacity_options",
    "keys",
    "node",
    "open_database",
    "serve",
    "server_errors",
]

DEFAULT_DATA_DIR = Path("/var/lib/space")

DATA_DIR_OPTION = click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_DATA_DIR,
    show_default=True,
)

#: The control plane's database (issue 19), passed as ``database_url``: from the
#: environment too, so that a password need not show in the process list.
DATABASE_OPTION = click.option(
    "--database",
    "database_url",
    envvar="SPACE_DATABASE_URL",
    default="",
    metavar="URL",
    help="The control plane's database: sqlite:///PATH or postgresql://USER[:PASSWORD]@HOST"
    "[:PORT]/DB, shared by every replica (default: SQLite in the data dir; env"
    " SPACE_DATABASE_URL).",
)


EGRESS_RESOLVER_OPTION = click.option(
    "--egress-resolver",
    "egress_resolvers",
    multiple=True,
    metavar="ADDR[:PORT]",
    help="DNS server the egress gateway resolves allowed names with (default: the host's).",
)


def capacity_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """The node's admission settings (space/node/core/capacity.py), passed to NodeConfig
    as ``max_sandboxes``, ``memory_reserve_mib``, ``memory_overcommit``, ``pool_reserve_mib``,
    ``pool_size_gib``, its build slots as ``build_slots``, its apt sources as
    ``apt_sources`` (left out when none is given: the node's default), its build cache
    as ``build_cache_dir`` and its bound as ``build_cache_gib``, and what ``auto`` means
    on a host without KVM as ``guest_without_kvm`` (issue 21)."""
    low, high = MEMORY_RESERVE_MIB
    pool_low, pool_high = POOL_RESERVE_MIB
    options = (
        click.option(
            "--max-sandboxes", type=click.IntRange(min=1), default=None,
            help="Most sandboxes the node runs, whatever its capacity (default: no cap).",
        ),
        click.option(
            "--memory-reserve-mib", type=click.IntRange(min=0), default=None,
            help=f"Host memory kept from sandboxes (default: {MEMORY_RESERVE_SHARE:.0%}"
            f" of it, within {low}-{high} MiB).",
        ),
        click.option(
            "--memory-overcommit", type=click.FloatRange(min=0, min_open=True, max=100),
            default=DEFAULT_MEMORY_OVERCOMMIT, show_default=True,
            help="Most memory the live VMs may grow to (guest RAM plus QEMU overhead, summed),"
            " as a multiple of the host's memory less the reserve.",
        ),
        click.option(
            "--pool-reserve-mib", type=click.IntRange(min=0), default=None,
            help=f"Space kept free in the btrfs pool (default: {POOL_RESERVE_SHARE:.0%}"
            f" of it, within {pool_low}-{pool_high} MiB).",
        ),
        click.option(
            "--pool-size-gib", type=click.IntRange(min=2), default=DEFAULT_POOL_SIZE_GIB,
            show_default=True,
            help="Size of the sparse loop file holding the btrfs pool when --pool-path is not"
            " given (it bounds how many sandbox disks and saved states the node admits).",
        ),
        click.option(
            "--build-slots", type=click.IntRange(min=1), default=DEFAULT_BUILD_SLOTS,
            show_default=True, help="Template builds the node runs at once, shared by tenant.",
        ),
        click.option(
            "--guest-without-kvm", type=click.Choice(["qemu", "gvisor"]), default="qemu",
            show_default=True,
            help="The guest type a sandbox asking for 'auto' gets on a host without KVM"
            " (gvisor: gVisor's runsc; with KVM, 'auto' is always a VM).",
        ),
        click.option(
            "--apt-source", "apt_sources", multiple=True, metavar="'deb URL SUITE COMPONENT'",
            help="An apt source template builds fetch packages from, repeatable (default:"
            " Debian bookworm, its updates and security).",
        ),
        click.option(
            "--build-cache", "build_cache_dir", type=click.Path(file_okay=False, path_type=Path),
            default=None,
            help="Keep built layers here, by content, for a later build on a fresh pool"
            " (default: none; docs/templates.md).",
        ),
        click.option(
            "--build-cache-gib", "build_cache_gib", type=click.FloatRange(min=0, min_open=True),
            default=DEFAULT_BUILD_CACHE_GIB, show_default=True,
            help="Most GiB of layers the build cache keeps; past it the least recently used"
            " go.",
        ),
    )  # fmt: skip
    for option in reversed(options):
        command = option(command)
    return command


USER_OPTION = click.option(
    "--user",
    default="space",
    show_default=True,
    help=(
        "The user the node agent runs as once its root broker runs (when started as "
        "root; setup makes it). 'root' keeps root: for debugging only."
    ),
)
EGRESS_CA_OPTION = click.option(
    "--egress-upstream-ca",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    default=None,
    help="CA bundle upstream TLS servers are verified with (default: the host's).",
)


def api_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """What every command that serves the API takes: ``reaper_interval``,
    ``reconcile_interval``, ``reconcile_grace``, ``node_heartbeat``, ``node_lease``,
    ``node_ca_file``, ``sandbox_domain``, ``tls_cert`` and ``tls_key``."""
    for option in reversed(
        (
            click.option(
                "--reaper-interval", type=click.FloatRange(min=0.1), default=5.0,
                show_default=True,
                help="Seconds between background rounds: ended lifetimes, idle sandboxes, "
                "node leases.",
            ),
            click.option(
                "--reconcile-interval", type=click.FloatRange(min=0.1), default=60.0,
                show_default=True,
                help="Seconds between comparisons of every node with the database.",
            ),
            click.option(
                "--reconcile-grace", type=click.FloatRange(min=0.0), default=600.0,
                show_default=True,
                help="Seconds a sandbox may stay 'creating' (a snapshot pending) before "
                "reconciliation settles it: longer than any create takes.",
            ),
            click.option(
                "--node-heartbeat", type=click.FloatRange(min=0.2), default=5.0,
                show_default=True, help="Seconds between a node's heartbeats (nodes are told).",
            ),
            click.option(
                "--node-lease", type=click.FloatRange(min=1.0), default=30.0,
                show_default=True,
                help="Seconds a node stays active after its last heartbeat; then it is lost.",
            ),
            click.option(
                "--node-ca-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
                help="CA bundle node agents' https certificates are checked with"
                " (default: the system's).",
            ),
            click.option(
                "--sandbox-domain", default="", metavar="DOMAIN",
                help="Serve sandboxes' ports (and the E2B envd routes) at"
                " <port>-<id>.DOMAIN: point wildcard DNS and TLS for *.DOMAIN here.",
            ),
            *_TLS_OPTIONS,
        )
    ):  # fmt: skip
        command = option(command)
    return command


#: ``tls_cert`` and ``tls_key``: the API (the control plane's, or a node agent's) over HTTPS.
_TLS_OPTIONS = (
    click.option(
        "--tls-cert", type=click.Path(dir_okay=False, path_type=Path), default=None,
        help="PEM certificate chain: serve the API over HTTPS (with --tls-key).",
    ),
    click.option(
        "--tls-key", type=click.Path(dir_okay=False, path_type=Path), default=None,
        help="PEM private key of --tls-cert (keep it 0600).",
    ),
)  # fmt: skip


def tls_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """``--tls-cert`` and ``--tls-key``, for a command that serves without api_options."""
    for option in reversed(_TLS_OPTIONS):
        command = option(command)
    return command


def egress_bounds_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """What tenants' egress policies may name (issue 17), passed to NodeConfig (and
    ControlSettings) as ``egress_operator_ranges`` and ``egress_allow_wide_any_port``."""
    command = click.option(
        "--egress-allow-wide-any-port", is_flag=True,
        help="Let egress rules wider than /8 (e.g. 0.0.0.0/0) name ports beyond 80 and 443.",
    )(command)  # fmt: skip
    return click.option(
        "--egress-allow-range", "egress_operator_ranges", multiple=True, metavar="CIDR",
        help="A private, CGNAT, ULA or link-local network tenants' egress rules may name"
        " (repeatable; default: none).",
    )(command)  # fmt: skip


@click.command()
@DATA_DIR_OPTION
@DATABASE_OPTION
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=int)
@click.option("--accel", type=click.Choice(["auto", "kvm", "tcg"]), default="auto")
@click.option("--pool-path", type=click.Path(path_type=Path), default=None, help="A btrfs mount.")
@click.option("--release-pool", is_flag=True, hidden=True, help="Unmount an idle pool on exit.")
@click.option(
    "--warm-min", type=click.IntRange(min=0), default=0, show_default=True,
    help="Paused VMs each template's warm pool keeps at least.",
)  # fmt: skip
@click.option(
    "--warm-max", type=click.IntRange(min=0), default=0, show_default=True,
    help="Paused VMs each template's warm pool holds at most (0: no pool).",
)  # fmt: skip
@api_options
@capacity_options
@EGRESS_RESOLVER_OPTION
@EGRESS_CA_OPTION
@egress_bounds_options
@cluster_options
@USER_OPTION
def serve(
    data_dir: Path,
    database_url: str,
    host: str,
    port: int,
    accel: str,
    pool_path: Path | None,
    release_pool: bool,
    warm_min: int,
    warm_max: int,
    reaper_interval: float,
    reconcile_interval: float,
    reconcile_grace: float,
    node_heartbeat: float,
    node_lease: float,
    node_ca_file: Path | None,
    sandbox_domain: str,
    tls_cert: Path | None,
    tls_key: Path | None,
    egress_resolvers: tuple[str, ...],
    egress_upstream_ca: Path | None,
    egress_operator_ranges: tuple[str, ...],
    egress_allow_wide_any_port: bool,
    user: str,
    **capacity: Any,
) -> None:
    """Run the control plane and one node in this process (the embedded default)."""
    if warm_min > warm_max:
        fail(f"--warm-min ({warm_min}) must not exceed --warm-max ({warm_max})", 2)
    with server_errors():
        cluster = cluster_settings(capacity)  # imports the node's packages
        if not capacity["apt_sources"]:
            del capacity["apt_sources"]
        from space.control.secrets import load_keyring
        from space.control.server import run_control_plane
        from space.control.settings import ControlSettings
        from space.node.agent import Node
        from space.node.core.config import NodeConfig

        tls = _tls_files(tls_cert, tls_key)  # before anything is written or started
        settings = ControlSettings(
            data_dir=data_dir,
            database_url=database_url,
            reaper_interval_s=reaper_interval,
            reconcile_interval_s=reconcile_interval,
            reconcile_grace_s=reconcile_grace,
            node_heartbeat_s=node_heartbeat,
            node_lease_s=node_lease,
            egress_operator_ranges=egress_operator_ranges,
            egress_allow_wide_any_port=egress_allow_wide_any_port,
            node_ca_file=node_ca_file,
            sandbox_domain=sandbox_domain,
        )
        _owner_only(data_dir)  # once the options are known good: before the first write
        load_keyring(settings, create=True)  # an unsafe key file stops us before any VM
        open_database(settings)  # and so does a database we cannot reach
    progress = ProgressPrinter()

    async def run() -> None:
        progress(f"starting node (data in {data_dir})")
        config = NodeConfig(
            data_dir=data_dir,
            pool_path=pool_path,
            accel=_accel(accel),
            warm_pool_min=warm_min,
            warm_pool_max=warm_max,
            egress_resolvers=egress_resolvers,
            egress_upstream_ca=egress_upstream_ca,
            egress_operator_ranges=egress_operator_ranges,
            egress_allow_wide_any_port=egress_allow_wide_any_port,
            **capacity,
            **cluster,
        )
        tls_files = () if tls is None else (tls.cert, tls.key)
        await _become_user(config, user, progress, tls_files + cluster_files(cluster))
        local = await Node.start(config, progress=progress)
        try:
            scheme = "http" if tls is None else "https"
            progress(f"node {local.node_id} ready; API on {scheme}://{host}:{port}")
            await run_control_plane(settings, local, host=host, port=port, tls=tls)
        finally:
            # A loop-file pool is unmounted only when asked and no VM still uses it.
            idle = release_pool and not await local.list_sandboxes()
            progress("disconnecting from the VMs (they keep running)")
            await local.close(unmount_pool=idle)

    _run_until_signal(run())


@click.group(invoke_without_command=True)
@click.option(
    "--control-url", multiple=True,
    help="The control plane, e.g. http://ctl:8080 (required; repeat it for replicas with no "
    "load balancer: each is tried in turn).",
)  # fmt: skip
@click.option("--token-file", type=click.Path(dir_okay=False, path_type=Path), help="(required)")
@click.option(
    "--listen", default="127.0.0.1:8081", show_default=True,
    help="HOST:PORT to serve (loopback unless told otherwise: 0.0.0.0:8081 for every address).",
)  # fmt: skip
@click.option(
    "--advertise-url", default=None,
    help="The URL the control plane and other nodes call (default: from --listen, https"
    " with --tls-cert).",
)  # fmt: skip
@DATA_DIR_OPTION
@click.option("--accel", type=click.Choice(["auto", "kvm", "tcg"]), default="auto")
@click.option("--pool-path", type=click.Path(path_type=Path), default=None, help="A btrfs mount.")
@capacity_options
@EGRESS_RESOLVER_OPTION
@EGRESS_CA_OPTION
@egress_bounds_options
@cluster_options
@tls_options
@USER_OPTION
@click.pass_context
def node(
    ctx: click.Context,
    /,
    control_url: tuple[str, ...],
    token_file: Path | None,
    listen: str,
    advertise_url: str | None,
    data_dir: Path,
    accel: str,
    pool_path: Path | None,
    egress_resolvers: tuple[str, ...],
    egress_upstream_ca: Path | None,
    egress_operator_ranges: tuple[str, ...],
    egress_allow_wide_any_port: bool,
    tls_cert: Path | None,
    tls_key: Path | None,
    user: str,
    **capacity: Any,
) -> None:
    """Run a node agent alone and register it with a control plane (heartbeating it
    there), or, with a command, ask a control plane about its nodes."""
    if ctx.invoked_subcommand is not None:
        return
    if not control_url or token_file is None:
        fail("a node agent needs --control-url and --token-file", 2)
    with server_errors():
        cluster = cluster_settings(capacity)  # imports the node's packages
        if not capacity["apt_sources"]:
            del capacity["apt_sources"]
        from space.control.nodes import capacity_report
        from space.control.server import heartbeat, register_remote_node
        from space.node.agent import Node
        from space.node.core.config import NodeConfig
        from space.node.http.client import ca_context
        from space.node.http.server import create_node_app, node_server

        tls = _tls_files(tls_cert, tls_key)  # before anything is written or started
    control_urls = [_check_url(url) for url in control_url]
    host, port = _split_listen(listen)
    token = _read_token(token_file)
    scheme = "http" if tls is None else "https"
    node_url = advertise_url or f"{scheme}://{_advertised_host(host)}:{port}"
    verify = ca_context(cluster["peer_ca_file"])
    progress = ProgressPrinter()

    async def run() -> None:
        config = NodeConfig(
            data_dir=data_dir,
            pool_path=pool_path,
            accel=_accel(accel),
            egress_resolvers=egress_resolvers,
            egress_upstream_ca=egress_upstream_ca,
            egress_operator_ranges=egress_operator_ranges,
            egress_allow_wide_any_port=egress_allow_wide_any_port,
            **capacity,
            **cluster,
        )
        _owner_only(data_dir)  # the options are known good: before the first write
        tls_files = () if tls is None else (tls.cert, tls.key)
        await _become_user(config, user, progress, tls_files + cluster_files(cluster))
        local = await Node.start(config, progress=progress)
        try:
            app = create_node_app(local, token)
            served = None if tls is None else (tls.cert, tls.key)
            server = node_server(app, host=host, port=port, tls=served)
            serving = asyncio.create_task(server.serve())
            # uvicorn offers a flag, not an event: poll it while the task lives.
            while not server.started and not serving.done():
                await asyncio.wait({serving}, timeout=0.05)
            if not server.started:
                await serving  # it did not start: say why
                return
            progress(f"node {local.node_id} serving on {node_url}; registering")
            report = capacity_report(await local.info())
            every = await register_remote_node(
                control_urls, token, node_url, local.node_id, capacity=report, verify=verify
            )
            progress(f"registered with {' or '.join(control_urls)}; heartbeat every {every:g} s")
            beats = asyncio.create_task(
                heartbeat(control_urls, token, node_url, local, progress, every, verify)
            )
            try:
                await serving
            finally:
                beats.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beats
        finally:
            await local.close()

    _run_until_signal(run())


@click.group()
def keys() -> None:
    """Manage API keys."""


@keys.command(name="create")
@click.option("--tenant", required=True, help="The tenant the key belongs to.")
@DATA_DIR_OPTION
@DATABASE_OPTION
def keys_create(tenant: str, data_dir: Path, database_url: str) -> None:
    """Create an API key for TENANT and print it (shown only this once)."""
    with server_errors():
        from space.control.keys import create_key
        from space.control.settings import ControlSettings

        key = create_key(ControlSettings(data_dir=data_dir, database_url=database_url), tenant)
    click.echo(key)


def open_database(settings: ControlSettings) -> None:
    """Reach the database and bring its schema up to date, before anything starts: a URL
    of another scheme exits 2 naming the accepted ones, an unreachable database exits 1
    with the driver's reason (``error: unavailable: …``). Call inside server_errors."""
    from space.control.errors import ApiError
    from space.control.store.db import migrated

    try:
        with migrated(settings.database_url):
            pass
    except ApiError as exc:
        if exc.code == "invalid_argument":
            fail(f"--database: {exc.message}", 2)
        raise


class _Terminate(Exception):
    """Raised by the SIGTERM handler so ``finally`` blocks run on the way out."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminate


def _run_until_signal(main: Coroutine[Any, Any, None]) -> None:
    """Run a server coroutine; SIGINT/SIGTERM stop it cleanly (exit 0).

    uvicorn handles both signals while it serves and re-raises them once it has shut
    down; the handler installed here turns that (or a signal during startup) into an
    exception, so the coroutine's ``finally`` (closing the node) still runs.
    """
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        with server_errors():
            asyncio.run(main)
    except (KeyboardInterrupt, _Terminate):
        click.echo("stopped", err=True)
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def server_errors() -> Iterator[None]:
    """Node, control-plane (ApiError), secret store and OS errors as one ``error: ...`` line and
    exit code 1; a server package missing (the base install is the SDK and client CLI
    only) as how to install it, exit code 2. Wrap a server command's imports too."""
    try:
        yield
    except ModuleNotFoundError as exc:
        fail(
            f"this command runs the server, whose packages are not installed "
            f"(no module {exc.name!r}): pip install 'space[server]'",
            2,
        )
    except SpaceError as exc:
        fail(f"{exc.code}: {exc}")
    except OSError as exc:
        fail(f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}")
    except Exception as exc:
        # Importable here: the error came from the server's code.
        from space.control.errors import ApiError
        from space.control.secrets import SecretStoreError
        from space.node.api import NodeError

        if isinstance(exc, NodeError | ApiError):
            fail(f"{exc.code}: {exc}")
        if isinstance(exc, SecretStoreError):
            fail(f"secret store: {exc}")
        raise


async def _become_user(
    config: NodeConfig, user: str, say: Callable[[str], None], read_later: tuple[Path, ...] = ()
) -> None:
    """Started as root: start the root broker and go on as ``user`` (issue 18), who
    must be able to read ``read_later`` (the TLS files the API server loads, the
    cluster's key, CA and credentials files the node loads)."""
    import os

    from space.node.agent import node_user

    if user == "root" or os.geteuid() != 0:
        return  # not root: Node.start finds no broker it may start, and says so
    ids = node_user.node_user(user)
    for path in read_later:
        node_user.check_readable(path, ids)
    await node_user.become_node_user(config, ids, say)
    say(f"root broker started; the node agent goes on as {user} (uid {ids[0]})")


def _owner_only(data_dir: Path) -> None:
    """umask 077 for everything this server writes, and the data dir made 0700 (its
    top-level entries too, if an older version left them readable): issue 18."""
    from space.node.core.data_dir import restrict_umask, secure_data_dir

    restrict_umask()
    secure_data_dir(data_dir)


def _tls_files(cert: Path | None, key: Path | None) -> TlsFiles | None:
    """Both TLS options or neither; a pair that cannot be served is refused here."""
    from space.control.server import TlsFiles

    if cert is None and key is None:
        return None
    if cert is None or key is None:
        given, missing = (
            ("--tls-key", "--tls-cert") if cert is None else ("--tls-cert", "--tls-key")
        )
        fail(f"{given} needs {missing} too (or neither, for plain HTTP)", 2)
    files = TlsFiles(cert, key)
    try:
        files.check()
    except ValueError as exc:
        fail(str(exc), 2)
    return files


def _accel(value: str) -> Literal["auto", "kvm", "tcg"]:
    # click.Choice has already restricted the value; this narrows its type.
    return cast('Literal["auto", "kvm", "tcg"]', value)


def _split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        fail(f"--listen wants HOST:PORT, got {listen!r}", 2)
    return host.strip("[]") or "0.0.0.0", int(port)


def _advertised_host(host: str) -> str:
    # A wildcard address cannot be called back; the machine's name usually can.
    return socket.getfqdn() if host in ("0.0.0.0", "::", "") else host


def _read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        fail(f"cannot read the node token {path}: {exc.strerror}", 2)
    if not token:
        fail(f"the node token file {path} is empty", 2)
    return token


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        fail(f"not an http(s) URL: {url!r}", 2)
    return url.rstrip("/")
