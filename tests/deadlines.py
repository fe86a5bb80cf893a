"""Hang deadlines of the tests (issue 33): no test asserts how long anything
took; a deadline only catches a hang, with a wide margin over the worst case
seen on a busy machine (one engine step of a 135M model took 375 s there),
and its failure message says the load average."""

from __future__ import annotations

import os

#: Seconds after which a wait that should take seconds is called a hang
#: (several times the 375-s step seen on a loaded 2-core machine).
HANG_DEADLINE_S = 1800.0


def hang_message(what: str, seconds: float) -> str:
    """The failure message of a passed hang deadline: what did not happen,
    within how long, and the machine's load average then."""
    return (f"{what} within {seconds:g} s (a hang deadline, not a speed bound; "
            f"load average {os.getloadavg()})")
