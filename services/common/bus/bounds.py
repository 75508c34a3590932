"""The ranges a message's values must fall in, checked when a message is decoded (and built).

Everything on the bus is input from another process, and some of it from processes we do not
control (a training node, anyone who can publish). A value that decodes as a valid int or float
can still take a service down: a rank of 2^31-1 sizes an array by it, ``Infinity`` makes the hang
threshold infinite for good, ``before_s=0`` makes a severity of inf that no JSON encoder accepts,
a NUL in a string fails the Postgres insert, a CR/LF in an id splits a NATS header. So every
number has a range, every float is finite, every list and string has a length bound, and text
that becomes a name, a subject token or a header has no control characters. A message outside
its bounds fails validation, which the consumer dead-letters and counts (``schema``).

The bounds are generous for real jobs (a million ranks, 11 days per iteration, 2^18 rows per
message) and small enough that nothing sized by them can exhaust a machine.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

from pydantic import AfterValidator, Field, StringConstraints

MAX_RANK = 1 << 20  # ranks are 0 <= rank < MAX_RANK; a world or communicator holds <= MAX_RANK
MAX_ROWS = 1 << 18  # rows of one columnar telemetry message
MAX_LISTED = 1 << 16  # ranks or communicators one event names
MAX_SECONDS = 1e6  # about 11.6 days: no iteration, wait or timing lasts longer
MAX_UNIX_S = 1e11  # a Unix timestamp in seconds (year ~5000)
I64_MIN, U64_END = -(1 << 63), 1 << 64  # 64-bit ids and counters, signed or unsigned
NS_END = 1 << 63  # nanosecond timestamps are int64
MAX_NAME = 255  # host names, kinds, methods
MAX_TEXT = 8192  # summaries, error messages
MAX_JSON_DEPTH = 32
MAX_JSON_ITEMS = 1 << 20  # values in one free-form evidence document

_NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"

Rank = Annotated[int, Field(ge=0, lt=MAX_RANK)]
Size = Annotated[int, Field(ge=1, le=MAX_RANK)]  # world and communicator sizes
CommRank = Annotated[int, Field(ge=-1, lt=MAX_RANK)]  # -1: not known (yet)
CommSize = Annotated[int, Field(ge=0, le=MAX_RANK)]  # 0: not known (yet)
Peer = Annotated[int, Field(ge=-1, lt=MAX_RANK)]  # -1: none (a collective)
Id64 = Annotated[int, Field(ge=I64_MIN, lt=U64_END)]  # communicator ids: signed or unsigned
Counter = Annotated[int, Field(ge=0, lt=U64_END)]
Code = Annotated[int, Field(ge=0, lt=1 << 32)]  # op codes, data types, flags
Nanos = Annotated[int, Field(ge=0, lt=NS_END)]
SignedNanos = Annotated[int, Field(ge=-NS_END, lt=NS_END)]
Iteration = Annotated[int, Field(ge=-1, lt=NS_END)]  # -1: not an iteration (a hang)
Seconds = Annotated[float, Field(gt=0.0, le=MAX_SECONDS, allow_inf_nan=False)]
Age = Annotated[float, Field(ge=0.0, le=MAX_SECONDS, allow_inf_nan=False)]  # 0: none
UnixSeconds = Annotated[float, Field(gt=0.0, le=MAX_UNIX_S, allow_inf_nan=False)]
Severity = Annotated[float, Field(ge=0.0, le=MAX_SECONDS, allow_inf_nan=False)]
MAX_RATE = 1e18  # per second: steps, bytes (an exabyte a second is no link)
Rate = Annotated[float, Field(ge=0.0, le=MAX_RATE, allow_inf_nan=False)]  # 0: unknown
Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME, pattern=_NO_CONTROL)]
Text = Annotated[str, StringConstraints(max_length=MAX_TEXT, pattern=r"^[^\x00]*$")]
# Used as the Nats-Msg-Id header and as database keys: no spaces, no control characters.
EventId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{8,64}$")]
ObjectId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


def storable(value: Any, *, where: str = "evidence") -> Any:
    """``value`` if it is JSON that Postgres can store and the API can serve: finite floats,
    strings without NUL that are valid UTF-8, at most ``MAX_JSON_DEPTH`` deep and
    ``MAX_JSON_ITEMS`` values; ValueError naming the first offending place otherwise."""
    items = 0
    todo: list[tuple[Any, str, int]] = [(value, where, 0)]
    while todo:
        v, at, depth = todo.pop()
        items += 1
        if items > MAX_JSON_ITEMS:
            raise ValueError(f"{where}: more than {MAX_JSON_ITEMS} values")
        if depth > MAX_JSON_DEPTH:
            raise ValueError(f"{at}: nested deeper than {MAX_JSON_DEPTH}")
        if isinstance(v, float):
            if not math.isfinite(v):
                raise ValueError(f"{at}: {v} is not a finite number")
        elif isinstance(v, str):
            _check_text(v, at)
        elif isinstance(v, dict):
            for k, x in v.items():
                _check_text(str(k), f"{at} key")
                todo.append((x, f"{at}.{str(k)[:40]}", depth + 1))
        elif isinstance(v, list | tuple):
            todo.extend((x, f"{at}[{i}]", depth + 1) for i, x in enumerate(v))
        elif v is not None and not isinstance(v, bool | int):
            raise ValueError(f"{at}: {type(v).__name__} is not JSON")
    return value


def _check_text(s: str, at: str) -> None:
    if "\x00" in s:
        raise ValueError(f"{at}: contains a NUL character")
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{at}: is not valid UTF-8 (a lone surrogate)") from None


Evidence = Annotated[dict[str, Any], AfterValidator(storable)]
