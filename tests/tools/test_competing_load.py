"""``kvserve.bench.competing_load``: the busy processes of a benchmark's
competing load, whole cores or a share of one (issue 44: "beside a process
that keeps 20% of one core busy")."""

from __future__ import annotations

import pytest

from kvserve.bench.competing_load import busy_processes


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_a_share_outside_zero_to_one_is_refused(fraction):
    with pytest.raises(ValueError, match="busy fraction"):
        with busy_processes(1, fraction):
            pass


@pytest.mark.parametrize("fraction", [1.0, 0.2])
def test_the_processes_run_and_are_reaped(fraction):
    with busy_processes(2, fraction) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
    assert all(p.returncode is not None for p in procs)
