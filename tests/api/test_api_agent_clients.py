"""Issue 48's agent frameworks against the API, unmodified: the OpenAI
Agents SDK (its default model, the Responses API) runs an agent with a
function tool to its final answer, and pydantic-ai's default output mode
(a final_result tool) returns a nested pydantic model, through the Responses
and the Chat Completions models. A scripted engine answers (``fake_engine``):
what is checked is that each framework's own requests are accepted and its
own parsing of our answers succeeds."""

from __future__ import annotations

import json

import pydantic
import pytest
from fake_engine import FakeEngine, accepted, sample_outputs
from test_api_responses import client, engine  # noqa: F401 - fixtures: ChatML engine, openai client


pytestmark = pytest.mark.anyio


def call(name: str, arguments: dict) -> str:
    """A Hermes tool call, as Qwen-style models write it."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def answers(engine: FakeEngine, *texts: str) -> None:
    """The engine's answers to its next requests, in order."""
    queue = list(texts)

    def script(req):
        text = queue.pop(0)
        return [accepted(req), *sample_outputs(req, 0, [text[i:i + 7] for i in
                                                        range(0, len(text), 7)])]
    engine.script = script


async def test_the_agents_sdk_default_model_runs_a_tool_to_the_final_answer(client, engine):
    import agents  # the test extra brings it (a missing one fails, never skips)

    agents.set_tracing_disabled(True)  # no network: its traces go to OpenAI
    agents.set_default_openai_client(client, use_for_tracing=False)
    agents.set_default_openai_api("responses")  # the SDK's default, said aloud
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        seen.append(city)
        return "sunny"

    agent = agents.Agent(name="forecaster", instructions="Answer with the tool.",
                         model="fake-model", tools=[get_weather])
    answers(engine, call("get_weather", {"city": "Paris"}), "It is sunny in Paris.")
    result = await agents.Runner.run(agent, "Weather in Paris?")
    assert result.final_output == "It is sunny in Paris." and seen == ["Paris"]
    first, second = engine.requests
    assert first.messages[0]["content"].startswith("Answer with the tool.")  # instructions
    assert any("sunny" in m["content"] for m in second.messages)  # the tool's output


class Country(pydantic.BaseModel):
    name: str
    code: str


class City(pydantic.BaseModel):
    name: str
    country: Country  # nested: its schema is a $ref into $defs


@pytest.mark.parametrize("api", ["responses", "chat"])
async def test_pydantic_ai_default_output_mode_parses_a_nested_model(client, engine, api):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(openai_client=client)
    model = (OpenAIResponsesModel if api == "responses" else OpenAIChatModel)(
        "fake-model", provider=provider)
    agent = Agent(model, output_type=City)  # default: the answer as a final_result tool call
    answers(engine, call("final_result", {"name": "Lyon", "country": {"name": "France",
                                                                      "code": "FR"}}))
    result = await agent.run("Name a French city.")
    assert result.output == City(name="Lyon", country=Country(name="France", code="FR"))
    (request,) = engine.requests
    assert '"final_result"' in request.messages[0]["content"]  # the tool, in the prompt
    grammar = request.sampling_params.structured_outputs.grammar  # tool_choice required
    assert '"$ref": "#/$defs/f0_Country"' in grammar and '"$defs": {"f0_Country"' in grammar
