"""The detokenizer's U+FFFD hold-back: a token that ends inside a multi-byte
UTF-8 character releases no text until the character is complete, so a
client never sees U+FFFD for a character that the next token finishes; only
a sample that really ends mid-character ends with U+FFFD (as the whole text
decoded at once would)."""

import asyncio

from actor_support import Inbox

from kvserve.actors.detokenizer import DetokenizerActor
from kvserve.actors.messages import OpenStream, RequestOutput, TokenDelta, TokenizedRequest
from kvserve.actors.stream import RequestStream
from kvserve.core.sampling_params import SamplingParams


class OneByteTokenizer:
    """Byte-level vocabulary: token id i is the single byte i (0..255)."""

    all_special_ids = ()

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")

    def id_to_bytes(self, token_id):
        return bytes([token_id])


def stream_bytes(data: bytes, finish_reason: str = "length") -> list[RequestOutput]:
    """Feed ``data`` one byte (token) per step; the last step finishes the sample."""
    actor = DetokenizerActor(OneByteTokenizer(), Inbox())
    stream = RequestStream("r", 1)

    async def run():
        await actor.handle(OpenStream("r", 1, stream))
        await actor.handle(TokenizedRequest("r", "r", 0, (1, 2), SamplingParams(),
                                            arrival_time=0.0))
        for i, byte in enumerate(data):
            last = i == len(data) - 1
            await actor.handle(TokenDelta("r", (byte,), finish_reason if last else None,
                                          num_prompt_tokens=2))
        return [event async for event in stream]

    return [e for e in asyncio.run(run()) if isinstance(e, RequestOutput)]


def test_a_split_character_is_held_back_until_its_last_byte() -> None:
    # "a€b🎉c": € is E2 82 AC (3 bytes), 🎉 is F0 9F 8E 89 (4 bytes).
    outputs = stream_bytes("a€b🎉c".encode())
    assert [o.text for o in outputs] == ["a", "€", "b", "🎉", "c"]
    assert [o.token_ids for o in outputs] == [
        (0x61,), (0xE2, 0x82, 0xAC), (0x62,), (0xF0, 0x9F, 0x8E, 0x89), (0x63,)]
    # each token's offset: the characters completed before it
    assert [o.text_offsets for o in outputs] == [(0,), (1, 1, 1), (2,), (3, 3, 3, 3), (4,)]
    assert outputs[-1].finish_reason == "length"
    assert outputs[-1].num_output_tokens == 10  # 1 + 3 + 1 + 4 + 1 bytes


def test_a_sample_that_ends_mid_character_flushes_one_replacement_char() -> None:
    # b"\xe2\x82" is a truncated € : decoded whole, it is one U+FFFD.
    outputs = stream_bytes(b"a\xe2\x82")
    assert [o.text for o in outputs] == ["a", "\ufffd"]
    assert [o.token_ids for o in outputs] == [(0x61,), (0xE2, 0x82)]
    assert outputs[-1].finish_reason == "length"
