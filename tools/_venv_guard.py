"""Imported first by every tools/ script run as a script: run with a Python
that lacks the kvserve package (not the repository's venv), a script says in
one line how to run it and exits with status 2, instead of a
``ModuleNotFoundError`` traceback from its first import.

Only the standard library here: it runs before anything else is importable.
"""

import importlib.util
import os
import sys

if importlib.util.find_spec("kvserve") is None:
    _repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _venv_python = os.path.relpath(os.path.join(_repo, ".venv", "bin", "python"))
    _script = os.path.relpath(os.path.abspath(sys.argv[0])) if sys.argv[0] else "tools/x.py"
    sys.stderr.write(f"{_script}: needs the kvserve package, which {sys.executable} does not "
                     f"have: run {_venv_python} {_script} (`make install` creates the venv)\n")
    raise SystemExit(2)
