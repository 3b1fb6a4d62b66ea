"""The raw request body as a JSON object, refused (APIError 400 naming the field where there is one) when it is not
valid JSON (NaN and Infinity included), not an object, nested deeper than :data:`MAX_JSON_DEPTH` levels, holding a
string that is not valid Unicode (a lone UTF-16 surrogate), or holding a number too large to hold; refused with a 415
when its ``Content-Type`` is not JSON (:func:`unsupported_type`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncIterator, Mapping
from typing import Any

from .schemas import APIError, type_name

MAX_JSON_DEPTH = 32  # nesting levels of a request body (the deepest valid request needs 5)
DRAIN_BYTES = 64 * 2**20  # most bytes of a refused body read and dropped before the 413 / 415


async def read_json_body(stream: AsyncIterator[bytes], headers: Mapping[str, str], max_body: int) -> dict:
    """The body of a request as a JSON object (:func:`parse_json`), read from ``stream`` (the ASGI body chunks);
    ``headers`` are the request's (lower-case names, or Starlette's case-insensitive ``Headers``).

    A body whose ``Content-Type`` is not JSON is an APIError 415 (:func:`unsupported_type`). A body over
    ``max_body`` bytes (by its ``Content-Length`` header or as read) is an APIError 413. The rest of such a body is
    read and dropped first, up to :data:`DRAIN_BYTES` more, as nginx's lingering close does: answering while the
    client still sends makes the server close a socket with unread bytes, and the client gets a connection reset
    instead of the error.
    """
    refused = unsupported_type(headers.get("content-type"))
    declared = headers.get("content-length")
    over = declared is not None and declared.isdigit() and int(declared) > max_body
    raw, seen = bytearray(), 0
    async for chunk in stream:
        seen += len(chunk)
        if not over and refused is None:
            raw += chunk
            over = len(raw) > max_body
        if (over or refused is not None) and seen > max_body + DRAIN_BYTES:
            break
    if refused is not None:
        raise refused
    if over:
        size = f"is {declared} bytes" if declared is not None and declared.isdigit() else "exceeds the limit"
        raise APIError(413, f"the request body {size}; the limit is {max_body} bytes")
    return parse_json(bytes(raw))


JSON_MEDIA_TYPE = "application/json"


def unsupported_type(content_type: str | None) -> APIError | None:
    """The refusal of a request body declared as anything but JSON (an APIError 415, ``code:
    "unsupported_content_type"``, its message naming the expected type and the one sent), None for a JSON body. OpenAI
    and vLLM refuse such a body too, instead of reading it as JSON anyway.

    Accepted: ``application/json`` with or without parameters (``application/json; charset=utf-8``) and any
    ``application/<name>+json`` (RFC 6839's structured syntax suffix). ``curl -d`` sends
    ``application/x-www-form-urlencoded`` unless told otherwise: refused, with the header to add. A request with no
    ``Content-Type`` at all (or an empty one) is read as JSON, as FastAPI reads it: nothing then says the body is
    anything else (vLLM refuses it; every client of the API, the openai package, lm-eval and httpx's ``json=``
    among them, sends ``application/json``).
    """
    if content_type is None or not content_type.strip():
        return None
    media = content_type.split(";", 1)[0].strip().lower()
    if media == JSON_MEDIA_TYPE or (media.startswith("application/") and media.endswith("+json")):
        return None
    hint = (" (curl -d sends that type: add -H 'Content-Type: application/json')"
            if media == "application/x-www-form-urlencoded" else "")
    return APIError(415, f"unsupported content type {content_type.strip()!r}: the request body must be JSON, sent as "
                        f"'Content-Type: {JSON_MEDIA_TYPE}'{hint}", code="unsupported_content_type")


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
