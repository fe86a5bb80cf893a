"""The constraint compiler child's CPU watchdog answers before it ends the
process (``kvserve.constraints.compile_worker.CpuWatchdog``): the server
reads ``{"timeout": budget}`` on the child's stdout, so the refusal names the
CPU budget even when the child's exit status is lost to the parent's child
watcher (asyncio then reports 255). A real child process spins past a
0.05 s budget."""

from __future__ import annotations

import json
import subprocess
import sys

from kvserve.constraints.compile_worker import CPU_EXCEEDED

SPIN = """
import sys, time
from kvserve.constraints.compile_worker import CpuWatchdog
dog = CpuWatchdog(sys.stdout)
dog.start(0.05)
end = time.monotonic() + 60
while time.monotonic() < end:  # burn CPU until the watchdog ends the process
    pass
print("not ended", flush=True)
"""


def test_the_watchdog_answers_timeout_then_exits():
    proc = subprocess.run([sys.executable, "-c", SPIN], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == CPU_EXCEEDED, proc.stderr
    assert [json.loads(line) for line in proc.stdout.splitlines()] == [{"timeout": 0.05}]


def test_a_compile_stopped_in_time_gets_no_timeout_answer():
    code = ("import sys, time\nfrom kvserve.constraints.compile_worker import CpuWatchdog\n"
            "dog = CpuWatchdog(sys.stdout)\ndog.start(5.0)\ndog.stop()\ntime.sleep(0.2)\n"
            "print('done', flush=True)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout == "done\n"
