"""AdmissionActor: decides, before any compute is spent, whether a request enters."""

from __future__ import annotations

from kvserve.actors.base import Actor
from kvserve.actors.messages import RequestAccepted, TokenizedRequest
from kvserve.actors.registry import StreamRegistry


class AdmissionActor(Actor):
    """Admits tokenized requests into the scheduler (and the detokenizer).

    The waiting queue itself (fcfs or priority order) lives in the core
    scheduler, which also needs it for preemption; this actor is where limits
    and backpressure are applied before a request is queued.
    """

    name = "admission"

    def __init__(self, streams: StreamRegistry, scheduler: Actor, detokenizer: Actor) -> None:
        super().__init__()
        self.streams = streams
        self.scheduler = scheduler
        self.detokenizer = detokenizer

    async def handle(self, message: TokenizedRequest) -> None:
        if not self.streams.is_open(message.parent_id):
            return  # the client left while its prompt was being tokenized
        if message.index == 0:
            self.streams.put(message.parent_id,
                             RequestAccepted(message.parent_id, message.prompt_token_ids))
        self.detokenizer.send(message)
        self.scheduler.send(message)
