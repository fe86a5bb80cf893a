"""A first start as a newcomer meets it, as a transcript with seconds.

Runs ``make serve`` in a checkout (a fresh clone, for the real thing) with
``KVSERVE_CACHE`` pointing at a folder (an empty one: the default model is
fetched and converted), prefixes each output line with its seconds since
the start, polls ``/health`` every second, sends one chat request without
``temperature`` once it answers 200, stops the server with SIGINT, and
reports the longest silent stretch. Standard library only: it runs before
the checkout's venv exists.

    git clone REPO /tmp/fresh && python3 tools/first_start.py /tmp/fresh /tmp/fresh-cache \\
        --out docs/benchmarks/DATE-first-start.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkout", help="the repository to start (make serve runs there)")
    p.add_argument("cache", help="KVSERVE_CACHE for the run (empty: a real first start)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--deadline", type=float, default=1500.0, help="seconds to wait for 200")
    p.add_argument("--out", default=None, help="write the record (JSON) here")
    args = p.parse_args()
    env = dict(os.environ, KVSERVE_CACHE=args.cache)
    t0 = time.monotonic()
    proc = subprocess.Popen(["make", "serve", f"ARGS=--port {args.port}"], cwd=args.checkout,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, start_new_session=True)
    lines: list[str] = []
    gaps: list[tuple[float, str]] = []
    last = [t0]

    def stamp(text: str) -> None:
        lines.append(f"+{time.monotonic() - t0:7.1f}s  {text}")
        print(lines[-1], flush=True)

    def read() -> None:
        for line in proc.stdout:
            now = time.monotonic()
            gaps.append((round(now - last[0], 1), line.strip()[:100]))
            last[0] = now
            stamp(line.rstrip()[:300])

    threading.Thread(target=read, daemon=True).start()
    base = f"http://127.0.0.1:{args.port}"
    seconds: dict[str, float] = {}
    previous = None
    while time.monotonic() - t0 < args.deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                code, body = r.status, r.read().decode()[:60]
        except urllib.error.HTTPError as e:
            code, body = e.code, e.read().decode()[:60]
        except OSError as e:
            code, body = None, type(e).__name__
        if code != previous:
            stamp(f"[probe] /health -> {code} {body}")
            seconds.setdefault(f"health_{code}_from", round(time.monotonic() - t0, 1))
            previous = code
        if code == 200:
            break
        time.sleep(1)
    answer = None
    if previous == 200:
        body = json.dumps({"model": "SmolLM2-135M-Instruct", "max_tokens": 32, "messages": [
            {"role": "user", "content": "What is the capital of France?"}]}).encode()
        request = urllib.request.Request(base + "/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            answer = json.loads(r.read())["choices"][0]["message"]["content"]
        stamp(f"[probe] answer (no temperature sent): {answer!r}")
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=120)
    time.sleep(0.5)
    longest = max(gaps, default=(0.0, ""))
    record = {"checkout": os.path.abspath(args.checkout), "seconds": seconds,
              "longest_silent_stretch_s": longest[0], "before_line": longest[1],
              "answer_without_temperature": answer, "exit_status": proc.returncode,
              "loadavg_after": [round(x, 2) for x in os.getloadavg()], "transcript": lines}
    print(f"longest silent stretch: {longest[0]} s before {longest[1]!r}; "
          f"load average {record['loadavg_after']}")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(record, f, indent=1)
    return 0 if answer else 1


if __name__ == "__main__":
    raise SystemExit(main())
