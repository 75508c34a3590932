"""Dead letters that the server accepts, however large or strange the message that failed.

A letter carries the failed payload as JSON text, and JSON text can be several times the size of
the bytes it holds (a control byte becomes a six-byte escape, an invalid byte a three-byte
replacement character), so the letter is measured after encoding and the payload is cut until it
fits under the server's ``max_payload``; the letter records how much was left off.
"""

from __future__ import annotations

from services.common.bus.contract import DeadLetter

MAX_REASON_CHARS = 2000
# Room for the headers a dead letter is published with (Nats-Msg-Id and the NATS/1.0 preamble).
HEADER_ROOM = 512
# How far under the largest prefix that fits the cut may fall: a few bytes of a payload that
# had to be cut anyway, for a handful of encodings instead of twenty.
CLOSE_ENOUGH = 64


def _utf8_boundary(data: bytes, keep: int) -> int:
    """Step back so the cut does not split a multi-byte UTF-8 character."""
    while 0 < keep < len(data) and data[keep] & 0xC0 == 0x80:
        keep -= 1
    return keep


def encode_dead_letter(*, stream: str, consumer: str, subject: str, reason: str, data: bytes,
                       max_payload: int) -> bytes:
    """The JSON of a DeadLetter for ``data``, at most ``max_payload - HEADER_ROOM`` bytes long.

    Raises ValueError when not even an empty payload fits (a server limit far below anything
    NATS ships with).
    """
    limit = max_payload - HEADER_ROOM

    def build(keep: int, why: str) -> bytes:
        letter = DeadLetter(stream=stream, consumer=consumer, subject=subject, reason=why,
                            payload=data[:keep].decode("utf-8", "replace"),
                            payload_bytes=len(data), payload_cut_bytes=len(data) - keep)
        return letter.model_dump_json().encode()

    why = reason[:MAX_REASON_CHARS]
    whole = build(len(data), why)
    if len(whole) <= limit:
        return whole
    smallest = build(0, why)
    if len(smallest) > limit:
        why = reason[:200]
        smallest = build(0, why)
        if len(smallest) > limit:
            raise ValueError(f"max_payload {max_payload} leaves no room for a dead letter")
    # A prefix that fits within CLOSE_ENOUGH bytes of the largest. Encoded size grows with the
    # prefix (up to a few bytes where a cut falls inside a character, absorbed by checking every
    # candidate), nearly in proportion, so interpolation steps alternate with bisection steps.
    lo, lo_len, best = 0, len(smallest), smallest
    hi, hi_len = len(data), len(whole)
    step = 0
    while hi - lo > CLOSE_ENOUGH:
        if step % 2 == 0:
            guess = lo + (hi - lo) * (limit - lo_len) // max(hi_len - lo_len, 1)
        else:
            guess = (lo + hi) // 2
        keep = _utf8_boundary(data, min(max(guess, lo + 1), hi - 1))
        if keep <= lo:  # a character wider than the bracket: bisect plainly
            keep = (lo + hi) // 2
        out = build(keep, why)
        if len(out) <= limit:
            lo, lo_len, best = keep, len(out), out
        else:
            hi, hi_len = keep, len(out)
        step += 1
    return best
