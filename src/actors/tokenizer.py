"""TokenizerActor: text or chat messages -> prompt token ids; refuses bad prompts."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from concurrent.futures import ThreadPoolExecutor

from kvserve.actors.base import Actor, Mailbox
from kvserve.actors.messages import (AbortRequest, Deliver, GenerateRequest, RequestFailed,
                                     TokenizedRequest)
from kvserve.actors.registry import child_request_ids
from kvserve.constraints.compiler import ConstraintError
from kvserve.core.sampling_params import SEED_MIN
from kvserve.core.structured_outputs import log_safe
from kvserve.model.tokenizer import TemplateBudgetExceeded

#: Prompts (text, or the summed string lengths of chat messages) shorter than
#: this many characters are tokenized on the event loop. Encoding costs about
#: 0.25 us a character (SmolLM2's BPE), so an inline prompt blocks the loop
#: for at most ~0.25 ms, while a hop to the pool costs every request ~40 us
#: of CPU and ~60 us of latency; a 9,000-token prompt (~20,000 characters)
#: would block it ~10-25 ms. Measured on the 2-core dev machine (issue 11).
INLINE_MAX_CHARS = 1024
#: Seconds a chat template may render on the event loop (a short chat takes
#: well under a millisecond); a slower one is stopped and rendered again on
#: the pool, with the template's full budget, so that the loop (``/health``
#: included) never waits on it.
INLINE_RENDER_BUDGET_S = 0.05
#: Threads that tokenize long prompts. The HF encoder releases the GIL
#: (``Tokenizer.encode`` for long texts), so two long prompts encode in
#: parallel; Jinja chat templates are Python and take the GIL in turns.
NUM_TOKENIZER_THREADS = 2


class PromptError(ValueError):
    """A prompt the engine cannot serve; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_message_count(num_messages: int, min_tokens_per_message: int,
                        max_model_len: int) -> None:
    """Refuse a chat that cannot fit before rendering it.

    Every message costs at least ``min_tokens_per_message`` tokens of the
    chat template (``Tokenizer.min_tokens_per_message``; 1 if unknown), so
    more messages than ``max_model_len`` tokens can hold is a ``PromptError``
    naming ``messages``, found in O(1) rather than after rendering them.
    """
    per = max(1, min_tokens_per_message)
    if num_messages * per > max_model_len:
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"{num_messages:,} messages need at least {num_messages * per:,} tokens ({per} "
            f"per message in this model's chat template). Please send fewer messages.",
            param="messages")


def check_prompt_length(num_prompt: int, max_tokens: int | None, max_model_len: int,
                        prompt_param: str = "prompt") -> None:
    """Refuse empty prompts and prompts that cannot fit the context.

    Mirrors vLLM's check: prompt + ``max_tokens`` must not exceed
    ``max_model_len`` (tokens). ``prompt_param`` names the request field
    that holds the prompt (``prompt`` or ``messages``). Raises ``PromptError``.
    """
    if num_prompt == 0:
        raise PromptError("The prompt is empty.", param=prompt_param)
    if num_prompt >= max_model_len:
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {num_prompt} tokens, which leaves no room to generate.",
            param=prompt_param)
    if max_tokens is not None and num_prompt + max_tokens > max_model_len:
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the length of the prompt or "
            f"max_tokens.", param="max_tokens")


class TokenizerActor(Actor):
    """Renders the chat template, tokenizes, validates length, fans out ``n``.

    Each of the ``n`` samples becomes its own ``TokenizedRequest``
    (``{id}-{index}``, or the id itself when n == 1); a seeded request's
    sample i uses seed + i (vLLM's convention), so samples differ. The ``n``
    samples are always sent together, one after the other.

    Prompts of ``INLINE_MAX_CHARS`` characters or more are rendered and
    encoded on a small thread pool, never on the event loop, and an output
    constraint is compiled by ``compiler`` (a
    ``kvserve.constraints.compiler.ConstraintCompiler``: bounded, off the
    loop and the step thread) before the request is queued; meanwhile the
    actor goes on with the next requests, so requests may leave it out of
    arrival order. A request aborted while it was being prepared is dropped
    when its tokens come back.

    Inbox: ``GenerateRequest`` and ``AbortRequest`` (the engine's, for a
    client gone, a deadline passed or a drain): an abort of a request still
    being prepared ends it here; any other goes on to admission, behind the
    request if it was sent. Refusals go to the detokenizer as ``Deliver``.

    Args:
        tokenizer: the checkpoint's tokenizer.
        max_model_len: tokens a prompt and its output may reach.
        admission, detokenizer: the peers' mailboxes.
        num_threads: threads that tokenize long prompts.
        compiler: the constraint compiler, or None (the worker compiles).
    """

    name = "tokenizer"
    accepts = (GenerateRequest, AbortRequest)

    def __init__(self, tokenizer, max_model_len: int, admission: Mailbox, detokenizer: Mailbox,
                 num_threads: int = NUM_TOKENIZER_THREADS, compiler=None,
                 inbox: Mailbox | None = None) -> None:
        super().__init__(inbox)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.admission = admission
        self.detokenizer = detokenizer
        self.compiler = compiler
        self._executor = ThreadPoolExecutor(max_workers=num_threads,
                                            thread_name_prefix="kvserve-tokenizer")
        # No prompt of more characters can fit: refuse it before tokenizing.
        per_token = getattr(tokenizer, "max_token_bytes", None)
        self.max_prompt_chars = max_model_len * per_token if per_token else None
        self.min_tokens_per_message = getattr(tokenizer, "min_tokens_per_message", 1)
        self._in_flight: set[asyncio.Task[None]] = set()
        #: Requests being prepared off the loop: each sample's id -> the
        #: request's ticket (a new one per request, so that an id reused
        #: after an abort is a different request here).
        self._preparing: dict[str, int] = {}
        self._aborted: set[int] = set()  # tickets of requests aborted while being prepared
        self._tickets = itertools.count()

    async def handle(self, message: GenerateRequest | AbortRequest) -> None:
        if isinstance(message, AbortRequest):
            self._abort(message)
            return
        try:
            if self._constrained(message):
                self.compiler.check_size(message.sampling_params.structured_outputs)
            self._check_token_ids(message)
            self._check_chars(message)
            if message.messages is not None:
                check_message_count(len(message.messages), self.min_tokens_per_message,
                                    self.max_model_len)
            inline = prompt_chars(message) < INLINE_MAX_CHARS
            if inline and not self._constrained(message):
                try:
                    self._admit(message, self._tokenize(message, INLINE_RENDER_BUDGET_S))
                    return
                except TemplateBudgetExceeded:
                    inline = False  # a slow chat template: rendered again on the pool
        except (PromptError, ConstraintError) as exc:
            self._fail(message.request_id, str(exc), exc.param)
            return
        ticket = next(self._tickets)
        for child_id in child_request_ids(message.request_id, message.sampling_params.n):
            self._preparing[child_id] = ticket
        task = asyncio.create_task(self._prepare_off_loop(message, ticket, inline),
                                   name=f"tokenize-{message.request_id}")
        self._in_flight.add(task)
        task.add_done_callback(self._in_flight.discard)

    def _abort(self, message: AbortRequest) -> None:
        """End requests still being prepared here; pass on the others."""
        onward = []
        for request_id in message.request_ids:
            ticket = self._preparing.get(request_id)
            if ticket is None:
                onward.append(request_id)
            else:
                self._aborted.add(ticket)
        if onward:
            self.admission.send(AbortRequest(tuple(onward), message.reason,
                                             message.num_output_tokens))

    async def _prepare_off_loop(self, message: GenerateRequest, ticket: int,
                                inline: bool = True) -> None:
        """Tokenize ``message`` (on the pool when long, or when its chat
        template is slow: ``inline`` False, or past ``INLINE_RENDER_BUDGET_S``
        on the loop) and compile its constraint, then admit it unless it was
        aborted meanwhile."""
        loop = asyncio.get_running_loop()
        rid = message.request_id

        def live() -> bool:
            return ticket not in self._aborted

        try:
            prompt_ids = None
            if inline and prompt_chars(message) < INLINE_MAX_CHARS:
                try:
                    prompt_ids = self._tokenize(message, INLINE_RENDER_BUDGET_S)
                except TemplateBudgetExceeded:
                    pass
            if prompt_ids is None:
                prompt_ids = await loop.run_in_executor(self._executor, self._tokenize, message)
            if self._constrained(message) and live():
                self._check_length(message, prompt_ids)  # before paying for a compile
                message = await self._compile(message)
            if live():
                self._admit(message, prompt_ids)
        except (PromptError, ConstraintError) as exc:
            if live():
                self._fail(rid, str(exc), exc.param, getattr(exc, "status", 400))
        except Exception as exc:  # noqa: BLE001 - as Actor._dispatch: fail the request only
            self.log.exception("actor_error", message_type=type(message).__name__)
            if live():
                self.on_error(message, exc)
        finally:
            for child_id in child_request_ids(rid, message.sampling_params.n):
                if self._preparing.get(child_id) == ticket:
                    del self._preparing[child_id]
            self._aborted.discard(ticket)

    def _constrained(self, message: GenerateRequest) -> bool:
        """Whether ``message`` has an output constraint for the compiler (one
        not compiled yet; without a compiler the worker builds it itself)."""
        constraint = message.sampling_params.structured_outputs
        return (self.compiler is not None and constraint is not None
                and constraint.compiled is None)

    async def _compile(self, message: GenerateRequest) -> GenerateRequest:
        """``message`` with its constraint compiled (``ConstraintError`` if refused)."""
        params = message.sampling_params
        compiled = await self.compiler.compile(params.structured_outputs)
        return dataclasses.replace(message, sampling_params=dataclasses.replace(
            params, structured_outputs=compiled))

    def _admit(self, message: GenerateRequest, prompt_ids: tuple[int, ...]) -> None:
        """Check the length, then send the ``n`` samples to admission.

        Raises ``PromptError`` (before anything is sent) when too long."""
        self._check_length(message, prompt_ids)
        for child in fan_out(message, prompt_ids):
            self.admission.send(child)

    def _check_length(self, message: GenerateRequest, prompt_ids: tuple[int, ...]) -> None:
        """``check_prompt_length`` of ``message`` (``PromptError`` when too long)."""
        check_prompt_length(len(prompt_ids), message.sampling_params.max_tokens,
                            self.max_model_len,
                            "messages" if message.messages is not None else "prompt")

    def _check_chars(self, message: GenerateRequest) -> None:
        """``PromptError`` for a prompt longer in characters than
        ``max_model_len`` tokens can be: rejected without tokenizing it (a
        1,000,000-character prompt took 0.7-1.3 s to tokenize before its 400)."""
        chars = prompt_chars(message)
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise PromptError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt has {chars:,} characters, more than {self.max_model_len} tokens "
                f"can hold (at most {self.max_prompt_chars // self.max_model_len} characters "
                "each). Please reduce the length of the prompt.",
                param="messages" if message.messages is not None else "prompt")

    def _check_token_ids(self, message: GenerateRequest) -> None:
        """Token ids in ``logit_bias`` and ``stop_token_ids`` must be in the vocabulary."""
        params = message.sampling_params
        for param, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                           ("stop_token_ids", params.stop_token_ids)):
            bad = self._first_out_of_vocab(ids)
            if bad is not None:
                raise PromptError(f"{param}: token id {bad} is out of vocabulary "
                                  f"[0, {self.tokenizer.vocab_size}).", param=param)

    def _first_out_of_vocab(self, ids) -> int | None:
        """The first id of ``ids`` outside ``[0, vocab_size)``, or None.

        O(len(ids)) in C (``min``/``max``) when all are valid, so a long
        token-id prompt is checked on the event loop in well under a ms."""
        vocab = self.tokenizer.vocab_size
        if not ids or (min(ids) >= 0 and max(ids) < vocab):
            return None
        return next(t for t in ids if not 0 <= t < vocab)

    def _tokenize(self, message: GenerateRequest,
                  budget: float | None = None) -> tuple[int, ...]:
        """Prompt token ids of ``message``; runs on the loop or on the pool.
        ``budget``: the chat template's render budget (the loop's short one,
        ``INLINE_RENDER_BUDGET_S``: past it ``TemplateBudgetExceeded`` is
        raised for the pool to render again; None: the template's own).

        Raises ``PromptError`` for an out-of-vocabulary id or a chat
        template that fails."""
        if message.prompt_token_ids is not None:
            bad = self._first_out_of_vocab(message.prompt_token_ids)
            if bad is not None:
                raise PromptError(f"Token id {bad} is out of vocabulary "
                                  f"[0, {self.tokenizer.vocab_size}).", param="prompt")
            return tuple(message.prompt_token_ids)
        if message.messages is not None:
            try:  # message contents are text: special-token strings in them stay text
                return tuple(self.tokenizer.encode_chat(
                    list(message.messages), add_generation_prompt=message.add_generation_prompt,
                    continue_final_message=message.continue_final_message,
                    render_budget_s=budget, **(message.chat_template_kwargs or {})))
            except TemplateBudgetExceeded as exc:
                if budget is not None:  # the inline try: the pool renders it again
                    raise
                raise PromptError(f"Cannot apply the chat template: {exc}",
                                  param="messages") from exc
            except ValueError as exc:
                raise PromptError(f"Cannot apply the chat template: {exc}", param="messages") from exc
        return tuple(self.tokenizer.encode(message.prompt or "", add_special_tokens=True,
                                           parse_special=message.parse_special))

    def _fail(self, request_id: str, text: str, param: str | None, status: int = 400) -> None:
        self.log.info("request_rejected", request_id=request_id, reason=log_safe(text),
                      status=status)
        kind = {429: "server_overloaded", 503: "service_unavailable"}.get(
            status, "invalid_request_error")
        self.detokenizer.send(Deliver(request_id, RequestFailed(
            request_id, status, text, type=kind, param=param,
            retry_after=1.0 if status == 429 else None)))

    def on_error(self, message, exc: Exception) -> None:
        if isinstance(message, GenerateRequest):
            self.detokenizer.send(Deliver(message.request_id, RequestFailed(
                message.request_id, 500, f"tokenizer fault: {exc}", type="internal_error")))

    async def stop(self) -> None:
        """Stop the run loop and the constraint compiler (a request still
        compiling fails), let prompts still on the pool finish (and be
        admitted), then shut the pool down."""
        await super().stop()
        if self.compiler is not None:
            await self.compiler.close()
        await asyncio.gather(*self._in_flight, return_exceptions=True)
        self._executor.shutdown(wait=True)



def prompt_chars(message: GenerateRequest) -> int:
    """Size of the text to tokenize, in characters: the prompt's length, or
    the summed lengths of the chat messages' string fields (0 for token ids)."""
    if message.prompt is not None:
        return len(message.prompt)
    if message.messages is not None:
        return sum(len(value) for m in message.messages for value in m.values()
                   if isinstance(value, str))
    return 0


def fan_out(message: GenerateRequest, prompt_ids: tuple[int, ...]) -> list[TokenizedRequest]:
    """One ``TokenizedRequest`` per sample of ``message`` (``n`` of them);
    only sample 0 asks for the prompt's logprobs (issue 47, item 4: ``n``
    samples with ``echo`` and ``logprobs`` scored a 2,000-token prompt n
    times, with no prefix-cache hit between them)."""
    params = message.sampling_params
    n = params.n
    children = []
    for index, child_id in enumerate(child_request_ids(message.request_id, n)):
        child_params = params
        if n > 1:
            seed = None if params.seed is None else _wrap_seed(params.seed + index)
            # one prompt pass scores the prompt: the other samples share sample
            # 0's prompt logprobs (the API copies them) and may take its
            # cached blocks instead of prefilling and scoring it again
            prompt_logprobs = params.prompt_logprobs if index == 0 else None
            child_params = dataclasses.replace(params, n=1, seed=seed,
                                               prompt_logprobs=prompt_logprobs)
        children.append(TokenizedRequest(
            request_id=child_id,
            parent_id=message.request_id, index=index, prompt_token_ids=prompt_ids,
            sampling_params=child_params, arrival_time=message.arrival_time,
            priority=message.priority, request_class=message.request_class, num_samples=n))
    return children


def _wrap_seed(seed: int) -> int:
    """``seed`` wrapped into the signed 64-bit range ``SamplingParams`` accepts."""
    return (seed - SEED_MIN) % 2**64 + SEED_MIN
