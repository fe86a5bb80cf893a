"""The constraint compiler's child starts without ``fork`` (the soak's wedge).

A fork runs every ``pthread_atfork`` handler in the forking thread; OpenBLAS's
waits for its worker threads, which a step's matrix product holds, and a
constrained request arriving during a step wedged the server's event loop
for good (``tools/soak.py``: the main thread in ``blas_thread_shutdown_``
inside uvloop's ``create_subprocess_exec``). The cause is checked, not a
race: in a fresh interpreter on uvloop (as ``kvserve serve`` runs), a
``pthread_atfork`` handler counts the forks; ``spawn_child`` must cause none,
and uvloop's own subprocess spawn, the control, must cause one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from deadlines import HANG_DEADLINE_S

SCRIPT = textwrap.dedent("""
    import asyncio, ctypes, json, sys
    import uvloop
    from kvserve.constraints.compiler import spawn_child

    forks = [0]

    @ctypes.CFUNCTYPE(None)
    def prepare():
        forks[0] += 1

    # pthread_atfork is glibc's static wrapper of __register_atfork (no DSO handle).
    libc = ctypes.CDLL("libc.so.6")
    assert libc.__register_atfork(prepare, None, None, None) == 0

    async def main():
        child = await spawn_child([sys.executable, "-c",
                                   "import sys; print(sys.stdin.readline().strip()[::-1])"],
                                  1 << 16)
        child.stdin.write(b"olleh\\n")
        await child.stdin.drain()
        line = await child.stdout.readline()
        code = await child.wait()
        by_spawn_child = forks[0]
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        await proc.wait()
        print(json.dumps({"line": line.decode().strip(), "exit": code,
                          "by_spawn_child": by_spawn_child,
                          "by_uvloop": forks[0] - by_spawn_child}))

    uvloop.run(main())
""")


def test_the_compiler_child_is_spawned_without_running_atfork_handlers():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=HANG_DEADLINE_S)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["line"] == "hello" and result["exit"] == 0  # the pipes work both ways
    assert result["by_uvloop"] == 1, "the control: uvloop's spawn forks, the handler sees it"
    assert result["by_spawn_child"] == 0, "spawn_child forked: OpenBLAS's handler would run"
