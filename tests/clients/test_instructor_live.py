"""Issue 48: instructor's TOOLS mode (its default for OpenAI clients) gets a
parsed object from kvserve, with a model nested two deep (its JSON schema a
``$ref`` into ``$defs``), on the default model: the forced tool call's
grammar must keep those pointers resolvable, and the call must come back as
``tool_calls`` instructor validates.

Not in ``make test`` (marker ``clients``): instructor 1.17 pins ``jiter<0.15``
and the test extra's openai needs ``>=0.16``, so it lives in ``.venv-clients``
(``make bench-clients``); ``make test-clients`` runs this. Without that venv
the test fails and says how to make it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_support import LiveServer  # noqa: E402

pytestmark = [pytest.mark.clients, pytest.mark.model, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv-clients" / "bin" / "python"
SCRIPT = """
import json, sys
import instructor, openai, pydantic

class Country(pydantic.BaseModel):
    name: str
    code: str

class City(pydantic.BaseModel):
    name: str
    country: Country

class Trip(pydantic.BaseModel):
    start: City
    end: City

client = instructor.from_openai(openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="k"),
                                mode=instructor.Mode.TOOLS)
trip = client.chat.completions.create(
    model=sys.argv[2], response_model=Trip, max_retries=0, temperature=0, max_tokens=200,
    messages=[{"role": "user", "content": "A trip from Paris to Rome, as JSON."}])
print(json.dumps(trip.model_dump()))
"""


@pytest.fixture(scope="module")
def server(default_model_path, tmp_path_factory):
    live = LiveServer(default_model_path, tmp_path_factory.mktemp("instructor"),
                      extra_args=["--max-model-len", "2048"])
    yield live
    live.stop()


def test_instructor_tools_mode_parses_a_model_nested_two_deep(server):
    assert PYTHON.exists(), f"{PYTHON} is missing: run `make bench-clients` first"
    model = json.loads(subprocess.run(
        ["curl", "-s", f"{server.base_url}/v1/models"], capture_output=True, text=True,
        timeout=60).stdout)["data"][0]["id"]
    done = subprocess.run([str(PYTHON), "-c", SCRIPT, server.base_url, model],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    trip = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(trip) == {"start", "end"}
    for city in trip.values():  # instructor validated the nesting; the values are the model's
        assert set(city) == {"name", "country"} and set(city["country"]) == {"name", "code"}
