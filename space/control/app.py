"""The control plane's FastAPI application.

``create_app`` wires the routers, the error handlers and a lifespan that, in order:
applies the database migrations, loads the master keys (making the key file if
missing, refusing to start on an unsafe one) and re-wraps data keys wrapped by an older
master key, makes the node token file if missing, records and heartbeats the embedded
nodes, attaches the remote ones the database knows, reconciles every node with the
database (unless another replica holds that job), sends secret grants to nodes that
restarted, and runs the background rounds (space.control.background) until shutdown,
when it gives up its job leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

import anyio.to_thread
from fastapi import FastAPI

from space.control import background, broker, e2b
from space.control.deps import ControlContext, load_or_create_node_token
from space.control.e2b.envd import EnvdHandler
from space.control.edges import control_edges
from space.control.errors import install_error_handlers
from space.control.nodes import NodeRegistry
from space.control.ports import PortProxy
from space.control.prometheus import router as prometheus_router
from space.control.routers import (
    commands,
    egress,
    files,
    metrics,
    pools,
    quotas,
    sandboxes,
    secrets,
    snapshots,
    templates,
)
from space.control.routers import nodes as node_routes
from space.control.sandbox_traffic import SandboxTraffic
from space.control.secrets import load_keyring, rotate
from space.control.settings import ControlSettings
from space.control.store import Database
from space.control.store import nodes as node_rows

__all__ = ["create_app"]

log = logging.getLogger(__name__)


async def _prepare_keyring(settings: ControlSettings, db: Database) -> None:
    """Load the master keys (MasterKeyError stops the start) and re-wrap what an older
    master key wraps, so that it can be dropped from the ring."""
    keyring = await anyio.to_thread.run_sync(lambda: load_keyring(settings, create=True))
    count = await db.run(lambda session: rotate(session, keyring, strict=False))
    if count:
        log.info("re-wrapped %d data keys under master key %s", count, keyring.current.key_id)


@contextlib.asynccontextmanager
async def _running(
    settings: ControlSettings, nodes: NodeRegistry, clock: Callable[[], float]
) -> AsyncIterator[ControlContext]:
    db = Database(settings.database_url)
    try:
        await anyio.to_thread.run_sync(db.upgrade)
        await _prepare_keyring(settings, db)
        token = load_or_create_node_token(settings.token_file)
        ctx = ControlContext(settings=settings, db=db, nodes=nodes, clock=clock, node_token=token)
        nodes.use_directory(lambda node_id: db.call(lambda s: node_rows.url_of(s, node_id)), token)
        await background.start(ctx)
        await broker.sync_restarted_nodes(ctx)
        rounds = asyncio.create_task(background.background_loop(ctx))
        try:
            yield ctx
        finally:
            # A task that is done needs nothing more, and one of another loop can be
            # neither cancelled into nor awaited from this one (a test's client can
            # serve requests on a loop of its own, even one closed by now).
            loop = asyncio.get_running_loop()
            pending = [
                task for task in (rounds, *ctx.tasks) if not task.done() and task.get_loop() is loop
            ]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            await ctx.activity.aclose()
            await background.release_jobs(ctx)
            await nodes.aclose()
    finally:
        db.dispose()


def create_app(
    settings: ControlSettings,
    nodes: NodeRegistry,
    *,
    clock: Callable[[], float] = time.time,
) -> FastAPI:
    """The REST API of docs/api.md over ``nodes``; state lives in ``settings.database_url``.

    ``clock`` (seconds since the epoch) decides creation times and expiry, so tests
    can move time. Nothing happens until the app's lifespan starts.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with _running(settings, nodes, clock) as ctx:
            app.state.ctx = ctx
            yield

    app = FastAPI(title="SPACE", version="1", lifespan=lifespan)
    install_error_handlers(app)
    routers = (sandboxes, snapshots, egress, secrets, commands, files, pools, templates, quotas)
    for module in (*routers, metrics):
        app.include_router(module.router)
    app.include_router(node_routes.router)
    app.include_router(prometheus_router)
    app.include_router(e2b.router)  # last: its catch-all answers E2B's unknown routes
    app.add_middleware(control_edges)
    # Outermost: a request addressed to a sandbox never reaches the API's edge.
    app.add_middleware(SandboxTraffic, envd=EnvdHandler(), ports=PortProxy())
    return app
