#!/usr/bin/env python3
"""Draw kvserve's architecture: docs/images/architecture.png and .svg.

The picture the README and docs/architecture.md show, drawn from this script
so that it can be redrawn when an actor, a message or a backend changes:

- the HTTP API in front (``kvserve.api``);
- one engine's five actors (``kvserve.actors``: tokenizer, admission,
  scheduler, worker, detokenizer) and the typed messages between them
  (``kvserve.actors.messages``), with the stats actor beside them;
- the worker's backends (``kvserve.cpu``: Numba/NumPy kernels; ``kvserve.cuda``:
  Numba CUDA kernels on CuPy buffers);
- the Ray scale-out (``kvserve.distributed``): data-parallel replicas behind
  the router, disaggregated prefill and decode replicas, the KV offload tier.

Usage (matplotlib comes with the ``bench`` extra, which ``make install`` brings):

    .venv/bin/python tools/draw_architecture.py [--out-dir docs/images]

Coordinates are in a 100 x 74 box, y up; sizes are in points.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: outside the venv, say how to run this script
    import _venv_guard  # noqa: F401

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Fill colours per kind of box.
COLOURS = {
    "api": "#dbe9f6",
    "actor": "#fdf0d5",
    "stats": "#eeeeee",
    "backend": "#e2f0d9",
    "ray": "#ead9f2",
    "panel": "#fbfbfb",
}
MESSAGE_FONT = {"family": "DejaVu Sans Mono", "size": 9.0, "color": "#303030"}


def _pyplot():
    """matplotlib's pyplot on the Agg backend; without it, one line and exit status 1."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        sys.exit("draw_architecture.py needs matplotlib (the bench extra): run it as "
                 ".venv/bin/python tools/draw_architecture.py after `make install`")
    matplotlib.use("Agg")
    matplotlib.rcParams["svg.hashsalt"] = "kvserve-architecture"  # stable SVG ids
    matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text: small and searchable
    import matplotlib.pyplot as plt

    return plt


def box(ax, x, y, w, h, title, body="", kind="actor", title_size=11.0, body_size=9.2,
        dashed=False):
    """A rounded box at (x, y) (lower left) of w x h with a bold title and body lines."""
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.3,rounding_size=0.8",
                                facecolor=COLOURS[kind], edgecolor="#555555",
                                linewidth=1.0, linestyle="--" if dashed else "-"))
    cx = x + w / 2
    if body:
        ax.text(cx, y + h - 1.0, title, ha="center", va="top", fontsize=title_size,
                fontweight="bold")
        ax.text(cx, y + h - 1.0 - title_size / 4.2, body, ha="center", va="top",
                fontsize=body_size, linespacing=1.25)
    else:
        ax.text(cx, y + h / 2, title, ha="center", va="center", fontsize=title_size,
                fontweight="bold")


def arrow(ax, start, end, label="", side="above", offset=0.9, style="-|>", dashed=False,
          label_at=0.5):
    """An arrow from ``start`` to ``end`` with a message label beside it."""
    ax.annotate("", xy=end, xytext=start,
                arrowprops={"arrowstyle": style, "color": "#333333", "lw": 1.2,
                            "shrinkA": 0, "shrinkB": 0,
                            "linestyle": "--" if dashed else "-"})
    if not label:
        return
    lx = start[0] + (end[0] - start[0]) * label_at
    ly = start[1] + (end[1] - start[1]) * label_at
    if start[1] == end[1]:  # horizontal: label above or below
        ly += offset if side == "above" else -offset
        va = "bottom" if side == "above" else "top"
        ax.text(lx, ly, label, ha="center", va=va, **MESSAGE_FONT)
    else:  # vertical or slanted: label right or left
        lx += offset if side == "right" else -offset
        ax.text(lx, ly, label, ha="left" if side == "right" else "right", va="center",
                **MESSAGE_FONT)


def draw_api(ax):
    """The HTTP API across the top."""
    box(ax, 1, 66, 98, 6.5, "HTTP API",
        "OpenAI routes (/v1/chat/completions, /v1/completions, /v1/models), SSE streams, "
        "/tokenize, /metrics, /health  (Starlette + uvicorn, kvserve.api)", kind="api")


def draw_engine(ax):
    """One engine: the five actors, their messages, the stats actor and the backends."""
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((0.5, 23.5), 99, 39.5, boxstyle="round,pad=0,rounding_size=1",
                                facecolor=COLOURS["panel"], edgecolor="#999999", lw=0.8))
    ax.text(98.5, 62, "One engine (kvserve serve): five actors and a stats actor, each "
            "reached only through its typed inbox", fontsize=10, fontstyle="italic",
            ha="right", va="top", color="#444444")

    y, h = 45, 10
    box(ax, 2, y, 16, h, "Tokenizer", "chat template, tokens,\nconstraints, n > 1")
    box(ax, 29, y, 17, h, "Admission", "the waiting queue:\nfcfs / priority, 429")
    box(ax, 56, y, 17, h, "Scheduler", "core.Scheduler: batches,\nKV blocks, prefix cache")
    box(ax, 82, y, 16, h, "Worker", "runner and sampler\non a backend (thread)")

    arrow(ax, (10, 66), (10, y + h + 0.4), "GenerateRequest", side="right", offset=0.8,
          label_at=0.55)
    arrow(ax, (18.3, 51.5), (28.7, 51.5), "TokenizedRequest")
    arrow(ax, (46.3, 51.5), (55.7, 51.5), "ReleaseRequests")
    arrow(ax, (55.7, 48), (46.3, 48), "CapacityReport", side="below")
    arrow(ax, (73.3, 51.5), (81.7, 51.5), "ExecuteStep")
    arrow(ax, (81.7, 48), (73.3, 48), "StepResult", side="below")

    box(ax, 2, 27, 71, 7, "Detokenizer",
        "the only writer of client streams: incremental text, stop strings, refusals "
        "(RequestOutput -> SSE)")
    arrow(ax, (6, y - 0.4), (6, 34.4), "Deliver", side="right", offset=0.8)
    arrow(ax, (35, y - 0.4), (35, 34.4), "TokenizedRequest,\nDeliver,\nTokenDelta", side="left",
          offset=0.8)
    arrow(ax, (40, 34.4), (40, y - 0.4), "AbortRequest", side="right", offset=0.8)
    arrow(ax, (64.5, y - 0.4), (64.5, 34.4), "TokenDelta", side="right", offset=0.8)
    # The detokenizer writes the client streams the API sends: up the left margin.
    ax.plot([2, 0.9, 0.9], [30.5, 30.5, 42], color="#333333", lw=1.2)
    arrow(ax, (0.9, 42), (0.9, 65.7))
    ax.text(1.6, 39.5, "SSE", rotation=90, ha="left", va="center", **MESSAGE_FONT)

    box(ax, 77, 35.5, 21, 7.5, "Backends (model.Ops)", "the Llama model, written once",
        kind="backend", title_size=9.5, body_size=8.3)
    arrow(ax, (90, y - 0.4), (90, 43.4))
    box(ax, 77, 28.3, 10, 6.2, "CPU", "Numba and\nNumPy", kind="backend", title_size=9.5,
        body_size=8.0)
    box(ax, 88, 28.3, 10, 6.2, "CUDA", "Numba CUDA\non CuPy", kind="backend", title_size=9.5,
        body_size=8.0)
    ax.text(87.5, 27.4, "CPU: float32, int8, q4, w4a8 kernels\nCUDA: float16, cuBLAS, CUDA graphs",
            ha="center", va="top", fontsize=8.2, color="#333333", linespacing=1.2)

    box(ax, 22, 24.2, 51, 2.2, "Stats actor: metrics and engine_stats lines "
        "(reports of the engine, admission, scheduler)", kind="stats",
        title_size=8.0, dashed=True)


def draw_scale_out(ax):
    """The Ray scale-out: replicas behind the router, prefill/decode, the offload tier."""
    from matplotlib.patches import FancyBboxPatch

    ax.add_patch(FancyBboxPatch((0.5, 0.5), 99, 21, boxstyle="round,pad=0,rounding_size=1",
                                facecolor=COLOURS["panel"], edgecolor="#999999", lw=0.8))
    ax.text(1.5, 21, "Scale-out on Ray (kvserve.distributed): every replica is a whole "
            "engine, in its own process", fontsize=10, fontstyle="italic", va="top",
            color="#444444")

    box(ax, 2, 7, 19, 10, "API process", "HTTP, a tokenizer,\nthe router: longest\n"
        "cached prefix, else\nleast loaded", kind="api", title_size=10, body_size=8.3)

    for i, dy in enumerate((2.0, 1.0, 0.0)):
        box(ax, 29 + (2 - i) * 0.8, 7.5 + dy, 20, 8, "replicas" if i == 2 else "",
            "--data-parallel-size N\nengine + KV cache each" if i == 2 else "",
            kind="ray", title_size=10, body_size=8.3)
    arrow(ax, (21.3, 12.5), (28.7, 12.5), "requests", offset=0.7)
    arrow(ax, (28.7, 9.5), (21.3, 9.5), "KV events", side="below", offset=0.7)

    box(ax, 57, 8, 16, 9, "prefill", "--prefill-replicas P\nexport KV blocks",
        kind="ray", title_size=10, body_size=8.3)
    box(ax, 82, 8, 16, 9, "decode", "--decode-replicas D\nadopt, then decode",
        kind="ray", title_size=10, body_size=8.3)
    arrow(ax, (73.3, 12.5), (81.7, 12.5), "KV blocks", offset=0.7)
    ax.text(77.5, 18.2, "or disaggregated: prefilled on one replica, decoded on another",
            ha="center", va="center", fontsize=8.5, fontstyle="italic", color="#333333")
    ax.text(77.5, 11.2, "Ray object\nstore", ha="center", va="top", fontsize=7.8,
            color="#333333", linespacing=1.1)

    box(ax, 29, 1.5, 69, 4, "KV offload tier in /dev/shm: evicted prefix blocks, shared by "
        "the node's replicas (--kv-offloading-size)", kind="backend", title_size=8.8)


def draw(out_dir: Path) -> list[Path]:
    """Draw the picture into ``out_dir`` as architecture.png and .svg; return the paths."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(12, 8.9))
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 74)
    ax.axis("off")
    fig.subplots_adjust(left=0.005, right=0.995, bottom=0.005, top=0.995)
    draw_api(ax)
    draw_engine(ax)
    draw_scale_out(ax)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "architecture.png", out_dir / "architecture.svg"]
    fig.savefig(paths[0], dpi=150, metadata={"Software": None})
    fig.savefig(paths[1], metadata={"Date": None, "Creator": None})
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments, draw, print the paths written."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "images",
                        help="folder for architecture.png and .svg (default: docs/images)")
    args = parser.parse_args(argv)
    for path in draw(args.out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
