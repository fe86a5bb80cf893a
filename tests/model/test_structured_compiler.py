"""``ConstraintCompiler`` (issue 25): constraints compile bounded, in a
child process that may crash or be killed alone, and are refused with a
400 naming the field and the limit.

Needs the default model's ``tokenizer.json`` (no weights are loaded).
"""

from __future__ import annotations

import asyncio
import pickle
import sys

import pytest

from kvserve.api.tool_calls import tool_grammar
from kvserve.config import StructuredOutputsConfig
from kvserve.constraints.compile_worker import NORMAL_PRIORITY_CPU_SECONDS
from kvserve.constraints.compiler import ConstraintCompiler, ConstraintError
from kvserve.core.structured_outputs import StructuredOutputsParams

pytestmark = pytest.mark.model

VOCAB, EOS = 49152, (2,)


def optional_properties(count: int, salt: str = "p") -> StructuredOutputsParams:
    """A JSON object of ``count`` optional string properties: llguidance's
    matcher costs grow faster than linearly in ``count`` (~3 s at 4,000)."""
    schema = {"type": "object", "properties": {f"{salt}{i}": {"type": "string"}
                                               for i in range(count)}}
    return StructuredOutputsParams.from_schema(schema).named("guided_json")


@pytest.fixture
def with_compiler(default_model_path):
    """``with_compiler(body, **limits)``: run ``await body(compiler)`` on a
    new ``ConstraintCompiler`` and close it, all on one event loop."""

    def run(body, normal_cpu_seconds=NORMAL_PRIORITY_CPU_SECONDS, **limits):
        async def go():
            compiler = ConstraintCompiler(default_model_path / "tokenizer.json", VOCAB, EOS,
                                          StructuredOutputsConfig(**limits),
                                          normal_cpu_seconds=normal_cpu_seconds)
            try:
                return compiler, await body(compiler)
            finally:
                await compiler.close()

        return asyncio.run(go())

    return run


async def refusal(compiler: ConstraintCompiler, params: StructuredOutputsParams) -> ConstraintError:
    with pytest.raises(ConstraintError) as info:
        await compiler.compile(params)
    return info.value


def test_a_compiled_constraint_gives_fresh_matchers_and_is_compiled_once(with_compiler) -> None:
    async def body(compiler):
        first = await compiler.compile(StructuredOutputsParams(regex="(yes|no)",
                                                               field="guided_regex"))
        second = await compiler.compile(StructuredOutputsParams(regex="(yes|no)"))
        return first, second, compiler._tokenizer.tokenize_str("yes")

    compiler, (first, second, yes) = with_compiler(body)
    assert compiler.num_compiled == 1  # the second one came from the cache
    assert first.compiled is second.compiled and first == second
    matcher = first.compiled.new_matcher()
    assert not matcher.is_error()
    assert matcher.consume_tokens(list(yes)) and matcher.is_accepting()
    assert not first.compiled.new_matcher().is_accepting()  # the template never advances


def test_over_the_size_limit_is_refused_without_compiling(with_compiler) -> None:
    params = StructuredOutputsParams(choice=tuple(f"option {i}" for i in range(200)),
                                     field="guided_choice")

    async def body(compiler):
        return await refusal(compiler, params), compiler._child.proc

    _, (error, child) = with_compiler(body, max_bytes=1000)
    assert error.status == 400 and error.param == "guided_choice"
    message = str(error)
    assert f"{params.size_bytes:,} bytes" in message and "1,000" in message, message
    assert "--structured-outputs-max-bytes" in message
    assert child is None  # nothing was started


def test_a_compile_past_the_deadline_kills_the_child_and_the_next_compiles(with_compiler) -> None:
    async def body(compiler):
        slow = await refusal(compiler, optional_properties(6000, "slow"))
        again = await refusal(compiler, optional_properties(6000, "slow"))  # cached refusal
        ok = await compiler.compile(StructuredOutputsParams(regex="[a-z]+", field="guided_regex"))
        return slow, again, ok, compiler._child.proc.returncode

    # The whole budget at normal priority: on idle CPU only, a machine whose
    # cores other processes keep busy gives it no CPU within the wall deadline
    # (a 503, "too busy", which another test checks).
    compiler, (slow, again, ok, returncode) = with_compiler(body, timeout=0.3, max_bytes=1 << 20,
                                                            normal_cpu_seconds=0.3)
    message = str(slow)
    assert slow.status == 400 and slow.param == "guided_json"
    assert "did not compile within 0.3 s of CPU" in message, message
    assert "--structured-outputs-timeout" in message
    assert str(again) == message and compiler.num_refused == 1
    assert ok.compiled is not None and returncode is None  # a new child, alive


def test_a_crashing_compiler_fails_the_request_alone(with_compiler) -> None:
    crash = [sys.executable, "-c", "import os, sys; print('{\"ready\": true}', flush=True); "
             "sys.stdin.readline(); os.abort()"]

    async def body(compiler):
        real_argv, compiler._child.argv = compiler._child.argv, crash
        crashed = await refusal(compiler, StructuredOutputsParams(regex="a+",
                                                                  field="guided_regex"))
        compiler._child.argv = real_argv
        ok = await compiler.compile(StructuredOutputsParams(regex="b+", field="guided_regex"))
        return crashed, ok

    _, (crashed, ok) = with_compiler(body)
    assert crashed.status == 400 and crashed.param == "guided_regex"
    # "killed by signal 6" (SIGABRT), or "exit status 255" when another
    # waiter reaped the child first (asyncio then cannot know its status)
    assert "crashed the grammar compiler (" in str(crashed), str(crashed)
    assert ok.compiled is not None


def test_a_deeply_chained_grammar_compiles_on_the_large_stack(with_compiler) -> None:
    # 5,000 chained rules: 3,000 overflowed an 8 MiB stack inside llguidance (SIGSEGV).
    lark = "start: r0\n" + "".join(f'r{i}: "z" r{i + 1}\n' for i in range(5000)) + 'r5000: "."\n'

    async def body(compiler):
        params = await compiler.compile(StructuredOutputsParams(grammar=lark,
                                                                field="guided_grammar"))
        return params.compiled.new_matcher().is_error()

    _, is_error = with_compiler(body, max_bytes=1 << 20)
    assert is_error is False


def test_an_invalid_tool_schema_is_named_in_its_own_terms(with_compiler) -> None:
    tools = [{"type": "function", "function": {"name": "ok", "parameters": {
                 "type": "object", "properties": {"q": {"type": "string"}}}}},
             {"type": "function", "function": {"name": "bad", "parameters": {
                 "type": "object", "properties": {"n": {"type": "integer", "maximum": "ten"}}}}}]

    async def body(compiler):
        return await refusal(compiler, tool_grammar(tools, None, parallel=True))

    _, error = with_compiler(body)
    message = str(error)
    assert error.param == "tools[1].function.parameters"
    assert message.startswith("tools[1].function.parameters: the JSON schema is invalid: ")
    assert "maximum" in message and "%json" not in message and "None" not in message, message


def test_more_waiting_compiles_than_the_bound_get_429(with_compiler) -> None:
    params = [StructuredOutputsParams(regex=f"x{i}[0-9]+", field="guided_regex")
              for i in range(5)]

    async def body(compiler):
        return await asyncio.gather(*(compiler.compile(p) for p in params),
                                    return_exceptions=True)

    _, outcomes = with_compiler(body, max_pending=2)
    refused = [o for o in outcomes if isinstance(o, ConstraintError)]
    assert len(refused) == 3 and all(e.status == 429 for e in refused), outcomes
    assert all(o.compiled is not None for o in outcomes if not isinstance(o, Exception))


def test_a_params_object_pickles_without_its_compiled_form(with_compiler) -> None:
    async def body(compiler):
        return await compiler.compile(StructuredOutputsParams(regex="z+", field="x"))

    _, params = with_compiler(body)
    copy = pickle.loads(pickle.dumps(params))
    assert params.compiled is not None
    assert copy == params and copy.compiled is None and copy.field == "x"


def test_a_machine_too_busy_to_compile_gives_503_and_no_cached_refusal(with_compiler,
                                                                        monkeypatch) -> None:
    from kvserve.constraints import compiler as compiler_module

    monkeypatch.setattr(compiler_module, "WALL_FACTOR", 0.01)  # 0.05 s of wall time for 5 s
    params = optional_properties(1500, "busy")

    async def body(compiler):
        first = await refusal(compiler, params)
        second = await refusal(compiler, params)  # tried again: a busy machine is not the schema's fault
        monkeypatch.setattr(compiler_module, "WALL_FACTOR", 10.0)
        return first, second, await compiler.compile(params)

    # The last compile (~0.5 s of CPU) at normal priority throughout: on idle
    # CPU only, other busy processes would starve it into a third 503.
    compiler, (first, second, compiled) = with_compiler(body, normal_cpu_seconds=5.0)
    assert first.status == second.status == 503 and first.param == "guided_json"
    assert "too busy to compile" in str(first) and "retry later" in str(first)
    assert compiled.compiled is not None and compiler.num_refused == 0


def test_the_template_cache_is_bounded_by_the_bytes_of_its_constraints(with_compiler,
                                                                         monkeypatch) -> None:
    from kvserve.constraints import compiler as compiler_module

    monkeypatch.setattr(compiler_module, "CACHE_TEMPLATE_BYTES", 2500)
    params = [StructuredOutputsParams(choice=tuple(f"{tag} {i}" for i in range(100)))
              for tag in ("first", "second", "third")]  # ~1,000 bytes each

    async def body(compiler):
        for p in params:
            await compiler.compile(p)
        await compiler.compile(params[0])  # evicted: compiled again
        return compiler._cache.template_bytes

    compiler, cached_bytes = with_compiler(body)
    assert compiler.num_compiled == 4
    assert cached_bytes == params[2].size_bytes + params[0].size_bytes <= 2500
