"""The raw request body as a JSON object, refused (APIError 400 naming the field where there is one) when it is not
valid JSON (NaN and Infinity included), not an object, nested deeper than :data:`MAX_JSON_DEPTH` levels, holding a
string that is not valid Unicode (a lone UTF-16 surrogate), or holding a number too large to hold.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator
from typing import Any

from .schemas import APIError, type_name

MAX_JSON_DEPTH = 32  # nesting levels of a request body (the deepest valid request needs 5)
DRAIN_BYTES = 64 * 2**20  # most bytes of a body past the limit read and dropped before the 413 is sent


async def read_json_body(stream: AsyncIterator[bytes], declared: str | None, max_body: int) -> dict:
    """The body of a request as a JSON object (:func:`parse_json`), read from ``stream`` (the ASGI body chunks).

    A body over ``max_body`` bytes (by its ``Content-Length`` header, ``declared``, or as read) is an APIError 413.
    The rest of such a body is read and dropped first, up to :data:`DRAIN_BYTES` more, as nginx's lingering close
    does: answering while the client still sends makes the server close a socket with unread bytes, and the client
    gets a connection reset instead of the 413.
    """
    over = declared is not None and declared.isdigit() and int(declared) > max_body
    raw, seen = bytearray(), 0
    async for chunk in stream:
        seen += len(chunk)
        if not over:
            raw += chunk
            over = len(raw) > max_body
        if over and seen > max_body + DRAIN_BYTES:
            break
    if over:
        size = f"is {declared} bytes" if declared is not None and declared.isdigit() else "exceeds the limit"
        raise APIError(413, f"the request body {size}; the limit is {max_body} bytes")
    return parse_json(bytes(raw))


class TooLarge:
    """Stands in (while :func:`parse_json` checks a body) for a JSON number too large to hold: an integer of more
    than :data:`MAX_INT_DIGITS` digits or a float beyond double range. :func:`check_json_values` refuses it with
    the field's path, so the 400 names the field rather than the JSON decoder's own limit."""

    __slots__ = ()


MAX_INT_DIGITS = 4300  # Python's default int-from-str limit (sys.int_info.default_max_str_digits)


def _parse_int(text: str) -> int | TooLarge:
    return TooLarge() if len(text.lstrip("-")) > MAX_INT_DIGITS else int(text)


def _parse_float(text: str) -> float | TooLarge:
    x = float(text)
    return TooLarge() if math.isinf(x) else x


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object; APIError 400 for anything else (NaN and Infinity included, and a number
    too large to hold: an integer of more than :data:`MAX_INT_DIGITS` digits or a float beyond double range, named
    by its field)."""
    def no_constant(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=no_constant, parse_int=_parse_int, parse_float=_parse_float)
    except (ValueError, UnicodeDecodeError) as e:
        too_deep, field = _deep_field(raw)  # nesting past the limit is named first, however the parser failed
        if too_deep:
            raise _too_deep(field) from None
        raise APIError(400, f"the request body is not valid JSON ({e})") from e
    except RecursionError:
        raise _too_deep(_deep_field(raw)[1]) from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, not {type_name(body)}")
    check_json_values(body)
    return body


_JSON_TOKEN = re.compile(rb'("(?:[^"\\]|\\.)*")(\s*:)?|[\[\]{}]', re.S)  # a string (a key?) or a bracket


def _too_deep(field: str | None) -> APIError:
    where = f" (in '{field}')" if field is not None else ""
    return APIError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep{where}", param=field)


def _deep_field(raw: bytes) -> tuple[bool, str | None]:
    """Whether ``raw`` nests deeper than :data:`MAX_JSON_DEPTH` levels, and the top-level field under which it first
    does, as :func:`check_json_values` names it (None when there is none)."""
    depth, key = 0, None
    for m in _JSON_TOKEN.finditer(raw):
        if m.group(1) is not None:
            if m.group(2) and depth == 1:
                key = m.group(1)
            continue
        depth += 1 if m.group() in (b"[", b"{") else -1
        if depth > MAX_JSON_DEPTH:
            try:
                return True, (str(json.loads(key)) if key is not None else None)
            except ValueError:
                return True, None
    return False, None


def check_json_values(body: Any) -> None:
    """Refuse (APIError 400) a decoded body nested deeper than :data:`MAX_JSON_DEPTH`, holding a string that is
    not valid Unicode (a lone UTF-16 surrogate such as ``"\\ud800"``, which JSON's escapes allow) or a
    :class:`TooLarge` number. Iterative; a
    field's path (``messages[0].content``) is built only for the error."""
    todo: list[tuple[Any, int, tuple]] = [(body, 1, ())]
    while todo:
        v, depth, loc = todo.pop()
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(str(loc[0]) if loc else None)
        if isinstance(v, dict):
            for k, x in v.items():
                _check_text(k, loc + (k,))
                if isinstance(x, (dict, list, str, TooLarge)):
                    todo.append((x, depth + 1, loc + (k,)))
        elif isinstance(v, list):
            todo.extend((x, depth + 1, loc + (i,)) for i, x in enumerate(v)
                        if isinstance(x, (dict, list, str, TooLarge)))
        elif isinstance(v, str):
            _check_text(v, loc)
        elif isinstance(v, TooLarge):
            path = _path(loc)
            raise APIError(400, f"'{path}' is too large: the number has more than {MAX_INT_DIGITS} digits or is "
                                "beyond floating-point range", param=path or None)


def _path(loc: tuple) -> str:
    return "".join(f"[{x}]" if isinstance(x, int) else (f".{x}" if i else str(x)) for i, x in enumerate(loc))


def _check_text(s: str, loc: tuple) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        path = _path(loc)
        raise APIError(400, f"'{path}' is not valid Unicode (a lone surrogate at character {e.start})",
                       param=path or None) from None
