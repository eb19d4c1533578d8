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


def _parse_since(value: str) -> float:
    """'90s', '10m', '2h', '1d' ago, or an ISO-8601 time; returns a wall-clock timestamp."""
    import datetime as dt
    import time

    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if value and value[-1] in units and value[:-1].replace(".", "", 1).isdigit():
        return time.time() - float(value[:-1]) * units[value[-1]]
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter(f"{value!r}: use 90s, 10m, 2h, 1d or an ISO time") from None
    if when.tzinfo is None:
        when = when.astimezone()
    return when.timestamp()


@app.command()
def history(
    config_file: str = typer.Option(None, "--config", "-c", help="Config file (for its journal)."),
    journal: str = typer.Option(None, "--journal", help="Journal file (overrides the config)."),
    shard: int = typer.Option(None, "--shard", help="Only this shard."),
    since: str = typer.Option(None, "--since", help="Only after this: 10m, 2h, 1d or ISO time."),
    all_changes: bool = typer.Option(False, "--all", help="Include counter-only updates."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
) -> None:
    """What happened to the fleet: transitions from the journal, with their causes."""
    import datetime as dt
    import json
    from pathlib import Path

    from fleetwarden.config import ConfigError, load_config
    from fleetwarden.journal import Journal, JournalError

    try:
        path = Path(journal) if journal else load_config(config_file).journal.path
    except ConfigError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    if not path.exists():
        typer.echo(f"no journal at {path}", err=True)
        raise typer.Exit(2)
    try:
        with Journal(path) as j:
            entries = j.transitions(
                shard=shard, since_wall=_parse_since(since) if since else None,
                state_changes_only=not all_changes,
            )
    except JournalError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from None
    for e in entries:
        if as_json:
            typer.echo(json.dumps({"seq": e.seq, "wall": e.wall, "shard": e.shard,
                                   "from": e.from_state, "to": e.to_state, "event": e.event,
                                   "cause": e.cause, "record": e.record}))
        else:
            when = dt.datetime.fromtimestamp(e.wall).isoformat(sep=" ", timespec="seconds")
            typer.echo(f"{when}  shard {e.shard}  {e.from_state} -> {e.to_state}  {e.cause}")
    if not entries and not as_json:
        typer.echo("no transitions recorded")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
