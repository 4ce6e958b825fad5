"""``space template``: build a template from a directory, list and delete templates.

``build``, ``ls`` and ``rm`` go through the SDK (the API key's tenant). ``build-base``
builds the node's own base image in the local image cache (a server command, run where
the node runs).
"""

from __future__ import annotations

from pathlib import Path

import click

from space.cli._common import (
    ProgressPrinter,
    api_options,
    connection,
    echo_table,
    reports_errors,
)
from space.sdk import Template, TemplateInfo

__all__ = ["template"]

DEFAULT_CACHE_DIR = Path("/var/cache/space/images")


@click.group()
def template() -> None:
    """Build, list and delete sandbox templates."""


@template.command(name="build")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option(
    "-f", "--file", "spec", default="space.toml", show_default=True,
    help="The spec, relative to DIRECTORY; it is sent as space.toml.",
)  # fmt: skip
@api_options
@reports_errors
def template_build(directory: Path, spec: str, api_url: str | None, api_key: str | None) -> None:
    """Build the template DIRECTORY/SPEC describes; print the log as it comes.

    Exits 1 with the error if the build fails (the tag keeps its previous build).
    """
    built = Template.build(directory, spec=spec, on_log=click.echo, **connection(api_url, api_key))
    click.echo(f"built {built.ref} {built.digest}")


@template.command(name="ls")
@api_options
@reports_errors
def template_ls(api_url: str | None, api_key: str | None) -> None:
    """List base and your templates, one line per name and tag."""
    rows = [_row(info) for info in Template.list(**connection(api_url, api_key))]
    echo_table(("NAME:TAG", "DIGEST", "BASE", "CPUS/MEM/DISK", "READY", "CREATED"), rows)


def _row(info: TemplateInfo) -> tuple[str, ...]:
    return (
        info.ref,
        info.digest[:12],
        info.base,
        f"{info.cpus}/{info.memory_mib}/{info.disk_mib}",
        "yes" if info.ready else "no",
        info.created_at.strftime("%Y-%m-%d %H:%M:%S"),
    )


@template.command(name="rm")
@click.argument("ref")
@api_options
@reports_errors
def template_rm(ref: str, api_url: str | None, api_key: str | None) -> None:
    """Delete REF: name or name:tag (that tag), or name@digest (every tag of that build)."""
    Template.delete(ref, **connection(api_url, api_key))


@template.command(name="build-base")
@click.argument("name", default="base")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_CACHE_DIR,
    show_default=True,
)
def template_build_base(name: str, cache_dir: Path) -> None:
    """Build the node's image NAME (default: base) in the cache, or reuse it; print its digest."""
    _build_base(name, cache_dir)


def _build_base(name: str, cache_dir: Path) -> None:
    from space.cli._server import server_errors

    progress = ProgressPrinter()
    progress(f"building template {name!r} in {cache_dir}")
    with server_errors():
        from space.node.images import build_template

        image = build_template(name, cache_dir=cache_dir, progress=progress)
    progress(f"template {name!r} ready: {image.directory}")
    click.echo(image.digest)
