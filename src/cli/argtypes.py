"""argparse value types of the ``kvserve`` flags: each turns one flag's text
into its value, or into a one-line usage error naming the problem."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from kvserve.config import SpeculativeConfig, parse_size
from kvserve.core.parallel import parse_partition


def positive(kind: type, allow_zero: bool = False) -> Callable[[str], int | float]:
    """An argparse type: a number > 0 (>= 0 with ``allow_zero``; never NaN) of
    ``kind`` (a clear usage error otherwise)."""
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if value < 0 or (value == 0 and not allow_zero) or value != value:
            raise argparse.ArgumentTypeError(f"must be {'>=' if allow_zero else '>'} 0, "
                                             f"got {text}")
        return value
    parse.__name__ = f"{'non-negative' if allow_zero else 'positive'} {kind.__name__}"
    return parse


POSITIVE_INT, POSITIVE_FLOAT = positive(int), positive(float)
NON_NEGATIVE_FLOAT = positive(float, allow_zero=True)


def memory_size(text: str) -> str:
    """argparse type of a memory size: ``text`` as given (``parse_size``
    reads it, and accepts it, so a typo is a usage error)."""
    try:
        parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def port(text: str) -> int:
    """argparse type of ``--port``: 0 (any free port) to 65535."""
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {number}")
    return number


def speculative_config(text: str) -> SpeculativeConfig:
    """argparse type of ``--speculative-config`` (a usage error names the
    problem, a missing draft checkpoint included, before any model loads)."""
    try:
        config = SpeculativeConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if config.uses_draft_model and not (Path(config.model) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"'model': {config.model} is not a checkpoint folder "
                                         "(no config.json in it)")
    return config


def fault_injection(text: str):
    """argparse type of ``--fault-injection``: a ``FaultInjection`` from JSON."""
    # lazy: kvserve.testing stays off the serving path unless this flag is given
    from kvserve.testing.faults import FaultInjection

    try:
        return FaultInjection.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def layer_partition(text: str) -> tuple[int, ...]:
    """``--pp-layer-partition`` (``kvserve.core.parallel.parse_partition``)."""
    try:
        return parse_partition(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
