"""Freeze generations into a corpus: run prompts greedily, or read the ``[TOKENS]`` lines of earlier runs.

A frozen span is the prompt's ids followed by the generated ids, so a replayed question is matched from its first
generated token on (the prompt's own tail is in the corpus). Spans are appended to a text corpus, one per line,
with a ``-1`` line between spans (the COLI_DRAFT_CORPUS text format).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from redraft.corpus import CorpusError
from redraft.corpus.sources import read_log


class PromptFileError(ValueError):
    """A prompts file could not be read; the message names the file, the line and what was expected."""


def read_prompts(path: str | os.PathLike) -> list[str]:
    """Prompts from a file: one per line, or JSONL objects with a ``prompt`` string or a ``turns`` list.

    For ``turns`` the first turn is used. Blank lines are skipped. Surrounding whitespace is not part of a prompt
    (:func:`redraft.io.prompts.encode_prompt` drops it the same way for every command), so lines come back stripped.

    Raises:
        PromptFileError: unreadable file, invalid JSON on a line that starts with ``{``, an object with
            neither field, or an empty one.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise PromptFileError(f"{path}: cannot read prompts ({e})") from e
    prompts = []
    for no, line in enumerate(lines, start=1):
        s = line.strip()
        if not s:
            continue
        if s.startswith("{"):
            try:
                obj = json.loads(s)
            except json.JSONDecodeError as e:
                raise PromptFileError(f"{path}:{no}: invalid JSON ({e.msg})") from e
            if isinstance(obj.get("prompt"), str):
                text = obj["prompt"]
            elif isinstance(obj.get("turns"), list) and obj["turns"] and isinstance(obj["turns"][0], str):
                text = obj["turns"][0]
            else:
                raise PromptFileError(f"{path}:{no}: expected a 'prompt' string or a non-empty 'turns' list")
            if not text.strip():  # an empty prompt has nothing to answer (surrounding whitespace is dropped)
                raise PromptFileError(f"{path}:{no}: the prompt is empty")
            prompts.append(text)
        else:
            prompts.append(s)
    return prompts


def parse_token_log(path: str | os.PathLike) -> list[list[int]]:
    """Spans from a log of ``redraft run --tokens`` (or Colibri ``TOKENS=1``) output: prompt ids + generated ids.

    A thin wrapper over :func:`redraft.corpus.sources.read_log` that reports problems as :class:`PromptFileError`.

    Raises:
        PromptFileError: unreadable log, or a line whose count disagrees with its ids.
    """
    try:
        return read_log(path)
    except OSError as e:
        raise PromptFileError(f"{path}: cannot read log ({e.strerror or e})") from e
    except CorpusError as e:
        raise PromptFileError(str(e)) from e


def append_spans(path: str | os.PathLike, spans: Iterable[Sequence[int]]) -> int:
    """Append spans to a text corpus (created if missing, with its folder), one line each, a ``-1`` line between.

    The corpus package's one text writer (:func:`redraft.corpus.format.append_text`): O(new ids), the existing
    file is never rewritten. Returns the number of (non-empty) spans written.

    Raises:
        redraft.corpus.CorpusError: a negative id, or the file cannot be written (the message names it).
    """
    from redraft.corpus.format import append_text

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return append_text(path, spans)
