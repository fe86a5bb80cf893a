"""Make a JSONL workload trace (see ``tools/README.md`` and ``kvserve.bench.workload``).

    # 200 requests, default mix, Poisson at 2 req/s
    python tools/make_trace.py --num-requests 200 --arrival poisson --rate 2 -o trace.jsonl
    # bursty (gamma, burstiness 0.3), only Q&A and agent steps, lengths x0.1
    python tools/make_trace.py -n 50 --arrival gamma --rate 1 --burstiness 0.3 \
        --mix short_qa=0.7,agent=0.3 --scale 0.1 -o small.jsonl
    # closed loop of 8 users
    python tools/make_trace.py -n 64 --arrival concurrency --concurrency 8 -o c8.jsonl
    # record then replay: arrivals and lengths from kvserve's JSON logs
    python tools/make_trace.py --arrival log --log server.log -o recorded.jsonl
"""

from __future__ import annotations

import argparse
import sys

from kvserve.bench import BENCH_VERSION
from kvserve.bench.trace import CLASSES, write_trace
from kvserve.bench.workload import (
    DEFAULT_LENGTHS,
    DEFAULT_MIX,
    LengthDist,
    arrival_offsets,
    make_requests,
    requests_from_logs,
    with_arrivals,
)


def parse_mix(text: str | None) -> dict[str, float]:
    """``short_qa=0.5,rag=0.5`` -> dict (classes left out get 0)."""
    if not text:
        return dict(DEFAULT_MIX)
    mix = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        if not sep or name.strip() not in CLASSES:
            raise ValueError(f"bad --mix item {part!r}: use CLASS=RATIO with CLASS in "
                             f"{', '.join(CLASSES)}")
        mix[name.strip()] = float(value)
    return mix


def parse_lengths(items: list[str] | None) -> dict[str, dict[str, LengthDist]]:
    """``rag.prompt=2048:0.3`` (mean[:cv[:min[:max]]]) -> overrides of DEFAULT_LENGTHS."""
    out: dict[str, dict[str, LengthDist]] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        cls, dot, fld = key.partition(".")
        if not sep or not dot or cls not in DEFAULT_LENGTHS or fld not in DEFAULT_LENGTHS[cls]:
            raise ValueError(f"bad --length {item!r}: use CLASS.FIELD=MEAN[:CV[:MIN[:MAX]]], "
                             "fields: " + "; ".join(f"{c}: {','.join(f)}"
                                                    for c, f in DEFAULT_LENGTHS.items()))
        nums = value.split(":")
        base = DEFAULT_LENGTHS[cls][fld]
        out.setdefault(cls, {})[fld] = LengthDist(
            float(nums[0]), float(nums[1]) if len(nums) > 1 else base.cv,
            int(nums[2]) if len(nums) > 2 else base.min, int(nums[3]) if len(nums) > 3 else base.max)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make_trace", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 2)[2])
    p.add_argument("-o", "--out", required=True, help="trace file to write (JSONL)")
    p.add_argument("-n", "--num-requests", type=int, default=100)
    p.add_argument("--arrival", choices=["poisson", "gamma", "concurrency", "log"],
                   default="poisson")
    p.add_argument("--rate", type=float, default=1.0, help="mean arrival rate, req/s")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape (1 = Poisson, <1 burstier, >1 smoother)")
    p.add_argument("--concurrency", type=int, default=4,
                   help="users of --arrival concurrency (the replay's max concurrency)")
    p.add_argument("--log", action="append", default=None,
                   help="kvserve JSON log file(s) for --arrival log (repeatable)")
    p.add_argument("--mix", default=None,
                   help="class ratios, e.g. short_qa=0.4,rag=0.2,code=0.2,agent=0.2 (the default)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply every length")
    p.add_argument("--length", action="append", default=None, metavar="CLASS.FIELD=MEAN[:CV]",
                   help="override a length distribution (repeatable), e.g. code.output=256:0.3")
    p.add_argument("--agents", type=int, default=2, help="distinct agent prefixes")
    p.add_argument("--rag-docs", type=int, default=8, help="distinct RAG contexts")
    p.add_argument("--priority", action="append", default=None, metavar="CLASS=INT",
                   help="priority for a class's requests (repeatable), e.g. short_qa=0")
    p.add_argument("--no-stream", action="store_true", help="stream: false on every request")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        meta = {"generator": "kvserve.bench.make_trace", "version": BENCH_VERSION,
                "arrival": args.arrival, "seed": args.seed}
        if args.arrival == "log":
            if not args.log:
                raise ValueError("--arrival log needs --log FILE")
            requests, info = requests_from_logs(args.log, seed=args.seed)
            meta.update(info, logs=list(args.log))
        else:
            mix = parse_mix(args.mix)
            requests = make_requests(args.num_requests, mix, args.seed, args.scale,
                                     parse_lengths(args.length), args.agents, args.rag_docs)
            offsets = arrival_offsets(len(requests), args.arrival, args.rate, args.burstiness,
                                      args.seed + 1)
            requests = with_arrivals(requests, offsets)
            meta.update(mix=mix, scale=args.scale)
            if args.arrival in ("poisson", "gamma"):
                meta.update(rate=args.rate, burstiness=args.burstiness)
            else:
                meta.update(concurrency=args.concurrency)
        prios = {}
        for item in args.priority or []:
            cls, _, value = item.partition("=")
            prios[cls] = int(value)
        for r in requests:
            if r.cls in prios:
                r.priority = prios[r.cls]
            if args.no_stream:
                r.stream = False
        write_trace(args.out, requests, meta)
    except (ValueError, OSError) as exc:
        print(f"make_trace: error: {exc}", file=sys.stderr)
        return 2
    counts: dict[str, int] = {}
    for r in requests:
        counts[r.cls] = counts.get(r.cls, 0) + 1
    span = max((r.arrival_s for r in requests), default=0.0)
    print(f"wrote {len(requests)} requests to {args.out} ({args.arrival}; span {span:.1f} s; "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
