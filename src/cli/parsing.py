"""The ``kvserve`` command's argparse machinery: a help formatter that shows
every default, a parser whose usage errors are one line with a hint, and
the small function that adds a table of ``(flags, kwargs)`` to a group."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable
from importlib import metadata
from typing import Any

from kvserve import __version__

#: One flag as data: its option strings and ``add_argument``'s keywords.
Flag = tuple[tuple[str, ...], dict[str, Any]]


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with every option's default shown: its help text
    when that names the default, else ``(default: X)`` appended (``off`` for
    a switch, ``on`` for a ``--no-...`` switch, ``none`` for None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.default is argparse.SUPPRESS
                or "default" in text.lower()):
            return text
        if isinstance(action, argparse._StoreTrueAction):
            shown = "off"
        elif isinstance(action, argparse._StoreFalseAction):
            shown = "on"
        elif action.default is None:
            shown = "none"
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})"


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line that says where the flags
    are listed (the command's own ``--help``, also for an unknown flag,
    which argparse reports from the top-level parser), and the nearest
    flag for a misspelt one."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see '{self.prog} --help' for the "
                     "options\n")

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            owner = self.command_parser(parsed) or self
            owner.error(_unrecognized(extras, owner))
        return parsed

    def command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser | None:
        """The sub-command's parser ``parsed`` came through, or None."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(getattr(parsed, action.dest, None))
        return None


def _unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" message, with the closest known
    flag for each unknown one (``difflib``)."""
    known = [flag for action in parser._actions for flag in action.option_strings]
    hints = {}
    for word in extras:
        flag = word.split("=", 1)[0]
        close = difflib.get_close_matches(flag, known, n=1) if flag.startswith("--") else []
        if close:
            hints[flag] = close[0]
    if len(hints) == 1:
        hint = f" (did you mean {next(iter(hints.values()))}?)"
    else:
        hint = "".join(f" ({flag}: did you mean {near}?)" for flag, near in hints.items())
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


def argument_groups(p: argparse.ArgumentParser,
                    groups: tuple[tuple[str, str], ...]) -> dict[str, argparse._ArgumentGroup]:
    """``p``'s argument groups by name, created in ``groups``' order."""
    return {name: p.add_argument_group(name, description) for name, description in groups}


def add_arguments(target: argparse.ArgumentParser | argparse._ArgumentGroup,
                  flags: Iterable[Flag]) -> None:
    """Add each ``(option strings, keywords)`` of ``flags`` to ``target``, in order."""
    for names, kwargs in flags:
        target.add_argument(*names, **kwargs)


def kvserve_version() -> str:
    """kvserve's version: the installed distribution's, else ``kvserve.__version__``."""
    try:
        return metadata.version("kvserve")
    except metadata.PackageNotFoundError:
        return __version__
