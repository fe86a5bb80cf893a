"""Where the API key comes from (``kvserve.cli.resolve_api_key``): the flag,
a key file (kept out of ``ps``), or ``KVSERVE_API_KEY``; an empty key is a
start-up error, since ``--api-key ''`` used to switch authentication off
silently (issue 14, item 8)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.cli import build_parser, resolve_api_key


def args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_the_first_source_found_wins(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nignored second line\n", encoding="utf-8")
    assert resolve_api_key(args("--api-key", "flag"), {"KVSERVE_API_KEY": "env"}) == "flag"
    assert resolve_api_key(args("--api-key-file", str(key_file)),
                           {"KVSERVE_API_KEY": "env"}) == "from-file"
    assert resolve_api_key(args(), {"KVSERVE_API_KEY": "env"}) == "env"
    assert resolve_api_key(args(), {}) is None


@pytest.mark.parametrize("argv,environ", [
    (("--api-key", ""), {}),
    (("--api-key", "   "), {}),
    ((), {"KVSERVE_API_KEY": ""}),
])
def test_an_empty_key_is_refused(argv, environ, capsys):
    with pytest.raises(SystemExit) as exit_info:
        resolve_api_key(args(*argv), environ)
    assert exit_info.value.code == 2
    assert "is empty" in capsys.readouterr().err


def test_an_empty_or_missing_key_file_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.write_text("\n", encoding="utf-8")
    for path in (empty, tmp_path / "missing"):
        with pytest.raises(SystemExit):
            resolve_api_key(args("--api-key-file", str(path)), {})
    err = capsys.readouterr().err
    assert "--api-key-file is empty" in err and "--api-key-file: " in err


def test_serve_with_an_empty_key_exits_before_loading(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvserve.cli", "serve", "--api-key", "",
                           "--model", str(tmp_path / "no-model-here")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    errors = [line for line in done.stderr.splitlines() if not line.startswith("{")]
    assert errors == ["kvserve: error: --api-key is empty; give a key, or none of --api-key, "
                      "--api-key-file and KVSERVE_API_KEY to serve without one"], done.stderr
