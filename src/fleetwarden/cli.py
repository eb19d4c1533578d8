"""The ``fleetwarden`` command."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console

from fleetwarden import __version__
from fleetwarden.router.settings import DEFAULT_HOST, DEFAULT_PORT, RouterSettings

if TYPE_CHECKING:
    from fleetwarden.router import Router

#: The router's defaults, shown in ``fleetwarden route --help`` (defined once, in settings).
_ROUTER_DEFAULTS = RouterSettings()

app = typer.Typer(
    help="Keep a fleet of LLM inference engines serving.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"fleetwarden {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Keep a fleet of LLM inference engines serving."""


@app.command()
def demo() -> None:
    """Play the note-001 story through the real ledger and print every transition."""
    from fleetwarden.story import play_note_001

    console = Console(highlight=False)
    console.print("[bold]Note 001: a restarted engine has no history[/bold]")
    console.print("4 shards, default policy (3 failures condemn, 5 restarts); shard 1 fails.\n")
    for n, s in enumerate(play_note_001(), 1):
        console.print(f"[bold]{n}. {s.title}[/bold]")
        for t in s.transitions:
            if t.shard == 1:
                console.print(f"   {t.from_state} → {t.to_state}: {t.cause}")
        r = s.record
        console.print(
            f"   [dim]now {r.state}, reported streak {r.consecutive_reported_failures}, "
            f"state_before_partial {r.state_before_partial or 'none'}, "
            f"restarts {r.restart_attempts}/5, {r.base_url}[/dim]"
        )
    console.print("\nThe replacement came back [green]HEALTHY with streak 0[/green]; "
                  "one failed request made it SUSPECT, not DEAD.")


@app.command()
def route(
    backend: Annotated[list[str], typer.Option(
        "--backend", "-b", help="An engine's base URL (http://host:port); repeat for each.")],
    host: Annotated[str, typer.Option(
        help="Address to listen on (0.0.0.0: every one).")] = DEFAULT_HOST,
    port: Annotated[int, typer.Option(
        help="Port to listen on (0: any free port).")] = DEFAULT_PORT,
    backend_timeout: Annotated[float, typer.Option(
        "--backend-timeout",
        help="Seconds one attempt on a backend may take, headers to last byte.")
    ] = _ROUTER_DEFAULTS.backend_timeout_s,
    connect_timeout: Annotated[float, typer.Option(
        "--connect-timeout", help="Seconds to open a connection to a backend.")
    ] = _ROUTER_DEFAULTS.connect_timeout_s,
    max_retries: Annotated[int, typer.Option(
        "--max-retries",
        help="Re-sends of a request an engine may have worked on (0: none). Requests that "
             "never reached an engine are always re-sent.")] = _ROUTER_DEFAULTS.max_retries,
    max_body_bytes: Annotated[int, typer.Option(
        "--max-body-bytes", help="Largest request body; larger ones are answered 413.")
    ] = _ROUTER_DEFAULTS.max_body_bytes,
    session_header: Annotated[str, typer.Option(
        "--session-header", help="Header naming a session for affinity ('' turns it off).")
    ] = _ROUTER_DEFAULTS.session_header or "",
    control_port: Annotated[int | None, typer.Option(
        "--control-port",
        help="Also serve the control API on 127.0.0.1 at this port (needs --token-file).")
    ] = None,
    token_file: Annotated[Path | None, typer.Option(
        "--token-file",
        help="Bearer token of the control API; created (0600) with a new token if missing.")
    ] = None,
    log_level: Annotated[str, typer.Option(
        "--log-level", help="debug, info, warning or error.")] = "warning",
) -> None:
    """Run the router alone in front of a static list of engines.

    No health management: retries move failed requests to other engines; no engine is dropped.

    Stops on Ctrl-C or SIGTERM.
    """
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    def refuse(message: str) -> NoReturn:
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(2)

    for url in backend:
        if not url.startswith(("http://", "https://")):
            refuse(f"--backend {url!r} is not an http:// or https:// URL")
    if control_port is not None and token_file is None:
        refuse("--control-port needs --token-file")
    try:
        settings = RouterSettings(
            backend_timeout_s=backend_timeout, connect_timeout_s=connect_timeout,
            max_retries=max_retries, max_body_bytes=max_body_bytes,
            session_header=session_header or None)
        from fleetwarden.router.control import load_or_create_token

        token = load_or_create_token(token_file) if token_file is not None else None
    except (ValueError, OSError) as exc:
        refuse(str(exc))
    _run(_serve_router(backend, settings, host, port, control_port, token))


async def _serve_router(backends: list[str], settings: RouterSettings, host: str, port: int,
                        control_port: int | None, token: str | None) -> None:
    from fleetwarden.router import Router

    router: Router = Router(backends, settings, health_managed=False)
    await router.start(host, port, control_port=control_port, control_token=token)
    try:
        typer.echo(f"fleetwarden route: listening on {router.url}, "
                   f"{len(backends)} backend(s)")
        if router.control_url is not None:
            typer.echo(f"fleetwarden route: control API on {router.control_url}")
        sys.stdout.flush()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        await stop.wait()
    finally:
        await router.stop()


def _run(main: Coroutine[Any, Any, None]) -> None:
    """Run ``main`` on uvloop when it is installed, else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
