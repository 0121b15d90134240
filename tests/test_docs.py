"""The pages stay true: every `apps` command a README shows parses with the CLI as written (its
command, options and arguments exist; nothing runs), and every relative link finds its file."""

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer import _click as click

from cli import app

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        *(p for p in ROOT.rglob("README.md") if not {".venv", ".git", "fixtures"} & set(p.parts)),
        ROOT / "core" / "TPU.md",
        ROOT / "core" / "SPEED_LOG.md",
    ]
)


def shown_commands(text: str) -> list[str]:
    """The `apps ...` commands of a page: each line of its bash blocks (comments, environment
    assignments and what follows a pipe or && left out), and inline spans of three words or more."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            for part in re.split(r"&&|\|", re.sub(r"\s+#.*$", "", line)):
                part = re.sub(r"^(\w+=\S+\s+)+", "", part.strip())
                if part.startswith("apps "):
                    found.append(re.sub(r"\s*<\s*\S+$", "", part))
    prose = re.sub(r"\s*\n\s*", " ", re.sub(r"```.*?```", "", text, flags=re.S))
    for span in re.findall(r"`([^`]+)`", prose):
        span = re.sub(r"^(\w+=\S+\s+)+", "", span.strip())
        if span.startswith("apps ") and len(span.split()) > 2:
            found.append(span)
    return found


def parse(command: str) -> None:
    """Parses `command` with the CLI down to its last subcommand, as the shell would hand it;
    raises click's usage errors. Nothing is called."""
    found, args = typer.main.get_command(app), shlex.split(command)[1:]
    name, parent = "apps", None
    while hasattr(found, "resolve_command") and args and not args[0].startswith("-"):  # a group
        parent = click.Context(found, info_name=name, parent=parent)
        name, found, args = found.resolve_command(parent, args)
    found.make_context(name, list(args), parent=parent)


def placeholder(command: str) -> bool:
    """A command written with placeholders (TASK, HOST:PORT, ...) rather than to be run as is."""
    return bool(re.search(r"\b[A-Z]{2,}\b|\.\.\.", command.replace("--", "")))


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_command_a_page_shows_parses(page):
    failures = []
    for command in shown_commands(page.read_text()):
        if placeholder(command):
            continue
        try:
            parse(command)
        except (click.exceptions.ClickException, ValueError) as error:
            failures.append(f"{command}: {error}")
    assert failures == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_finds_its_file(page):
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        path = target.partition("#")[0]
        if path and not re.match(r"[a-z]+:", path) and not (page.parent / path).exists():
            missing.append(target)
    assert missing == []


def test_the_parser_sees_a_wrong_option():
    with pytest.raises(click.exceptions.NoSuchOption):
        parse("apps train sentiment --no-such-option 1")
    with pytest.raises(click.exceptions.UsageError):
        parse("apps no-such-command")
