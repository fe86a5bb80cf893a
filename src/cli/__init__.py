"""Command line: ``kvserve serve``, ``kvserve generate``, ``kvserve warmup``,
``kvserve plan``, ``kvserve fetch-model``, ``kvserve analyze LOGFILE``,
``kvserve diagnose --url URL``, ``kvserve bench``.

The only package that turns flags into config objects (``kvserve.config``).
One module per sub-command (``serve``, ``generate``, ``warmup``, ``plan``,
``fetch_model``, ``analyze``, ``diagnose``, ``bench``: its help line, its
flags, its ``run``); ``engine_args`` holds the engine's and the server's
flags as tables, ``engine_config`` turns them into an ``EngineConfig``,
``model_arg`` checks and resolves ``--model``, ``launch`` starts an engine,
``parsing`` is the argparse machinery and ``entry`` the parser and ``main``.

A start speaks and fails fast (as vLLM's and llama.cpp's servers do): the
version and the non-default options are the first lines; a user's mistake
(a bad flag, a ``--model`` that is no checkpoint folder, a busy port, a
setting ``kvserve plan`` can judge from ``config.json``) is one line on
stderr and exit status 2 before any weight loads; ``serve`` listens before
it loads, ``/health`` answering 503 ``{"status": "loading"}`` meanwhile.
"""

from kvserve.cli.engine_args import DTYPES, ENGINE_GROUPS, SERVE_GROUPS
from kvserve.cli.engine_config import (check_disaggregation, engine_config_from_args,
                                       load_chat_template, settled_config)
from kvserve.cli.entry import TOOL_COMMANDS, build_parser, main
from kvserve.cli.errors import StartupError
from kvserve.cli.generate import GENERATE_NOTICE, GENERATE_NOTICE_S
from kvserve.cli.launch import non_default_args, refuse_unfit_max_model_len
from kvserve.cli.model_arg import (CHECKPOINT_FILES, DEFAULT_MODEL, default_quantization,
                                   model_folder_problem)
from kvserve.cli.parsing import HelpFormatter, kvserve_version
from kvserve.cli.serve import DISTRIBUTED_EXTRA, resolve_api_key

# The names these had when the command was one module (tests import them).
_HelpFormatter = HelpFormatter
_StartupError = StartupError
_check_disaggregation = check_disaggregation
_refuse_unfit_max_model_len = refuse_unfit_max_model_len

__all__ = [
    "CHECKPOINT_FILES", "DEFAULT_MODEL", "DISTRIBUTED_EXTRA", "DTYPES", "ENGINE_GROUPS",
    "GENERATE_NOTICE", "GENERATE_NOTICE_S", "SERVE_GROUPS", "TOOL_COMMANDS", "HelpFormatter",
    "StartupError", "build_parser", "check_disaggregation", "default_quantization",
    "engine_config_from_args", "kvserve_version", "load_chat_template", "main",
    "model_folder_problem", "non_default_args", "refuse_unfit_max_model_len", "resolve_api_key",
    "settled_config",
]
