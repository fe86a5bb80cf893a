"""TokenizerActor: text or chat messages -> prompt token ids; refuses bad prompts."""

from __future__ import annotations

import dataclasses

from kvserve.actors.base import Actor
from kvserve.actors.messages import GenerateRequest, RequestFailed, TokenizedRequest
from kvserve.actors.registry import StreamRegistry, child_request_ids
from kvserve.core.sampling_params import SEED_MIN


class PromptError(ValueError):
    """A prompt the engine cannot serve; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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
    sample i uses seed + i (vLLM's convention), so samples differ.
    """

    name = "tokenizer"

    def __init__(self, tokenizer, max_model_len: int, streams: StreamRegistry, admission: Actor) -> None:
        super().__init__()
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.streams = streams
        self.admission = admission

    async def handle(self, message: GenerateRequest) -> None:
        if not self.streams.is_open(message.request_id):
            return  # aborted before it was tokenized
        try:
            self._check_token_ids(message)
            prompt_ids = self._tokenize(message)
            check_prompt_length(len(prompt_ids), message.sampling_params.max_tokens,
                                self.max_model_len,
                                "messages" if message.messages is not None else "prompt")
        except PromptError as exc:
            self._fail(message.request_id, str(exc), exc.param)
            return
        for child in fan_out(message, prompt_ids):
            self.admission.send(child)

    def _check_token_ids(self, message: GenerateRequest) -> None:
        """Token ids in ``logit_bias`` and ``stop_token_ids`` must be in the vocabulary."""
        params, vocab = message.sampling_params, self.tokenizer.vocab_size
        for param, ids in (("logit_bias", [t for t, _ in params.logit_bias]),
                           ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise PromptError(f"{param}: token id {bad[0]} is out of vocabulary "
                                  f"[0, {vocab}).", param=param)

    def _tokenize(self, message: GenerateRequest) -> tuple[int, ...]:
        if message.prompt_token_ids is not None:
            ids = message.prompt_token_ids
            bad = [t for t in ids if not 0 <= t < self.tokenizer.vocab_size]
            if bad:
                raise PromptError(f"Token id {bad[0]} is out of vocabulary "
                                  f"[0, {self.tokenizer.vocab_size}).", param="prompt")
            return tuple(ids)
        if message.messages is not None:
            try:
                text = self.tokenizer.apply_chat_template(list(message.messages))
            except ValueError as exc:
                raise PromptError(f"Cannot apply the chat template: {exc}", param="messages") from exc
            return tuple(self.tokenizer.encode(text, add_special_tokens=False))
        return tuple(self.tokenizer.encode(message.prompt or "", add_special_tokens=True))

    def _fail(self, request_id: str, text: str, param: str | None) -> None:
        self.log.info("request_rejected", request_id=request_id, reason=text, status=400)
        self.streams.fail(RequestFailed(request_id, 400, text, param=param))

    def on_error(self, message, exc: Exception) -> None:
        if isinstance(message, GenerateRequest):
            self.streams.fail(RequestFailed(message.request_id, 500, f"tokenizer fault: {exc}",
                                            type="internal_error"))


def fan_out(message: GenerateRequest, prompt_ids: tuple[int, ...]) -> list[TokenizedRequest]:
    """One ``TokenizedRequest`` per sample of ``message`` (``n`` of them)."""
    params = message.sampling_params
    n = params.n
    children = []
    for index, child_id in enumerate(child_request_ids(message.request_id, n)):
        child_params = params
        if n > 1:
            seed = None if params.seed is None else _wrap_seed(params.seed + index)
            child_params = dataclasses.replace(params, n=1, seed=seed)
        children.append(TokenizedRequest(
            request_id=child_id,
            parent_id=message.request_id, index=index, prompt_token_ids=prompt_ids,
            sampling_params=child_params, arrival_time=message.arrival_time,
            priority=message.priority, request_class=message.request_class))
    return children


def _wrap_seed(seed: int) -> int:
    """``seed`` wrapped into the signed 64-bit range ``SamplingParams`` accepts."""
    return (seed - SEED_MIN) % 2**64 + SEED_MIN
