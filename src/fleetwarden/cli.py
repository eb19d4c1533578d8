"""The ``fleetwarden`` command."""

from __future__ import annotations

import typer
from rich.console import Console

from fleetwarden import __version__

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
def config(
    example: bool = typer.Option(False, "--example", help="Print a commented example config."),
    check: str = typer.Option(None, "--check", metavar="FILE", help="Validate a config file."),
) -> None:
    """Print a commented example configuration, or validate a file."""
    from fleetwarden.config import ConfigError, example_toml, load_config

    if check:
        try:
            load_config(check)
        except ConfigError as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(2) from None
        typer.echo(f"{check}: valid")
        return
    if not example:
        typer.echo("use --example to print an example, or --check FILE", err=True)
        raise typer.Exit(2)
    typer.echo(example_toml(), nl=False)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
