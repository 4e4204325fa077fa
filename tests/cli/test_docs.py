"""The docs agree with the code where a test can tell: every ``fleetward`` command line in the README, docs/ and
the runbooks names a command and flags that exist, and each daemon's ``--help`` lists only what it uses."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from fleetward.chaos.bench import _parser as bench_parser
from fleetward.chaos.cli import _parser as chaos_parser
from fleetward.cli.main import _parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "runbooks").glob("*.md"))]


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_lines() -> Iterator[tuple[str, str]]:
    """(where, command line) for each ``fleetward ...`` in a fenced block or an inline code span."""
    for doc in DOCS:
        text = doc.read_text()
        for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = re.sub(r"^\$ ", "", line.split(" #")[0].strip())
                if line.startswith("fleetward "):
                    yield doc.name, line
        for span in re.findall(r"`(fleetward [a-z][^`]*)`", text):
            yield doc.name, span


def parser_for(line: str) -> tuple[argparse.ArgumentParser | None, str]:
    """The parser that reads ``line``'s flags, and the command it names."""
    words = line.split()
    top = _commands(_parser())
    command = words[1]
    if command not in top:
        return None, command
    parser = top[command]
    rest = words[2:]
    if command in ("bench", "chaos"):  # their own parsers read what follows
        parser = bench_parser() if command == "bench" else chaos_parser()
    sub = _commands(parser)
    if sub and rest and rest[0] in sub:
        return sub[rest[0]], f"{command} {rest[0]}"
    return parser, command


def test_every_documented_command_line_names_a_command_and_flags_that_exist() -> None:
    lines = list(command_lines())
    assert len(lines) > 50
    wrong = []
    for where, documented in lines:
        first, *rest = documented.split(maxsplit=2)[1:]
        for alternative in first.split("|"):  # `fleetward drain|undrain WORKER`: each of them
            line = " ".join(["fleetward", alternative, *rest])
            parser, command = parser_for(line)
            if parser is None:
                wrong.append(f"{where}: `{documented}`: no command {command}")
                continue
            known = set(parser._option_string_actions)
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line):
                if flag not in known:
                    wrong.append(f"{where}: `{documented}`: fleetward {command} has no {flag}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("daemon", ["agent", "controller", "autoscaler"])
def test_a_daemons_help_lists_only_flags_it_uses(daemon: str) -> None:
    """The daemons attach to the cluster's etcd and broker: none starts them, and only the agent runs workers."""
    flags = set(_commands(_parser())[daemon]._option_string_actions)
    starting_infrastructure = {"--etcd-port", "--mqtt-port", "--etcd-host", "--mqtt-host", "--tls", "--router-port"}
    assert not flags & starting_infrastructure
    running_workers = {"--workers", "--prefill-workers", "--model", "--worker-base-port", "--lease-ttl", "--node"}
    assert (flags >= running_workers) if daemon == "agent" else not flags & running_workers
    assert {"--config", "--etcd", "--mqtt", "--cluster", "--admin-token-file"} <= flags
