"""Benchmark workloads built from Spec-Bench questions (Apache-2.0, see redraft/data/SPEC_BENCH_LICENSE).

A workload is a list of prompts, already tokenised. The harness first answers the ``replay`` questions with plain
greedy decoding and freezes prompt + answer into a corpus; every workload then runs against that same corpus:

- ``replay``: the frozen questions themselves (one per MT-Bench category, round-robin): the corpus holds the answer.
- ``novel``: questions of categories absent from the corpus (translation, qa, math_reasoning): unrelated to it.
- ``near``: close to the frozen ones: the second turn of a frozen MT-Bench question (the conversation holds the
  frozen first answer, and many second turns ask to rewrite it), alternating with another question of a frozen
  question's category.
- ``copy``: summarization and RAG prompts, whose answers reuse the prompt's text (prompt lookup's home ground).
- ``specbench``: a round-robin sample over all 13 Spec-Bench categories, frozen questions excluded.

Prompts are token ids, so the harness runs without a tokenizer: :class:`ChatEncoder` wraps a real tokenizer (prompts
encoded as in ``redraft run``), :class:`ByteEncoder` is a tokenizer-free stand-in for tests, and a
:class:`Workload` can also be built directly from id lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from redraft.io.prompts import encode_prompt, uses_chat_template

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
NOVEL = ("translation", "qa", "math_reasoning")
COPY = ("summarization", "rag")
WORKLOADS = ("replay", "novel", "near", "copy", "specbench")
DESCRIPTIONS = {
    "replay": "frozen questions: their plain greedy answers are in the corpus",
    "novel": "categories absent from the corpus (translation, qa, math_reasoning)",
    "near": "second turns of frozen questions, alternating with other questions of the frozen categories",
    "copy": "summarization and RAG prompts (answers reuse the prompt)",
    "specbench": "round-robin sample over all Spec-Bench categories, frozen questions excluded",
}


class Encoder(Protocol):
    """Turns chat messages into prompt ids and ids back into text (the only tokenizer use in the harness)."""

    def encode(self, messages: list[dict]) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ChatEncoder:
    """A real tokenizer, encoding as every command does (:func:`redraft.io.prompts.encode_prompt`: instruct models get
    their chat template; ``chat`` forces it on or off)."""

    def __init__(self, tokenizer, chat: bool | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat = uses_chat_template(tokenizer, chat)

    def encode(self, messages: list[dict]) -> list[int]:
        return encode_prompt(self.tokenizer, messages, chat=self.chat)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class ByteEncoder:
    """Tokenizer-free stand-in: one id per UTF-8 byte (mod ``vocab_size``); for tests and tiny random models."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, messages: list[dict]) -> list[int]:
        text = "\n".join(f"{m['role']}: {m['content']}" for m in messages) + "\nassistant:"
        return [b % self.vocab_size for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(32 + int(i) % 95) for i in ids)


@dataclass
class Item:
    """One prompt of a workload: ``qid`` is unique within the workload (``81`` or ``81/t2`` for a second turn)."""

    qid: str
    category: str
    prompt_ids: list[int]
    turn: int = 1


@dataclass
class Workload:
    name: str
    items: list[Item] = field(default_factory=list)
    description: str = ""


def _by_category(questions: Sequence[dict]) -> dict[str, list[dict]]:
    cats: dict[str, list[dict]] = {}
    for q in questions:
        cats.setdefault(q["category"], []).append(q)
    return cats


def round_robin(questions: Sequence[dict], categories: Sequence[str], n: int, *,
                exclude: set | frozenset = frozenset(), skip: int = 0) -> list[dict]:
    """Up to n questions, one per category in turn (file order within a category), skipping ``exclude`` ids and
    the first ``skip`` questions of each category."""
    cats = _by_category(questions)
    pools = [[q for q in cats.get(c, [])[skip:] if q["question_id"] not in exclude] for c in categories]
    out: list[dict] = []
    i = 0
    while len(out) < n and any(pools):
        pool = pools[i % len(pools)]
        if pool:
            out.append(pool.pop(0))
        i += 1
    return out


def _clip(ids: list[int], max_prompt_tokens: int | None) -> list[int]:
    # keep the tail: with a chat template, the generation prompt that opens the answer is at the end
    return ids[-max_prompt_tokens:] if max_prompt_tokens and len(ids) > max_prompt_tokens else ids


def item_for(q: dict, encoder: Encoder, max_prompt_tokens: int | None = None) -> Item:
    """The first turn of a Spec-Bench question as a workload item."""
    ids = encoder.encode([{"role": "user", "content": q["turns"][0]}])
    return Item(str(q["question_id"]), q["category"], _clip(ids, max_prompt_tokens))


def replay_questions(questions: Sequence[dict], n: int) -> list[dict]:
    """The questions whose answers the harness freezes: MT-Bench categories round-robin."""
    return round_robin(questions, MT_BENCH, n)


def build_workloads(questions: Sequence[dict], counts: dict[str, int], encoder: Encoder,
                    frozen: Sequence[tuple[dict, list[int]]], *,
                    max_prompt_tokens: int | None = None) -> list[Workload]:
    """Build the named workloads (``counts``: name -> question count, in run order).

    Args:
        questions: Spec-Bench questions (``redraft.io.questions.load_questions()``).
        encoder: see :class:`Encoder`.
        frozen: (question, plain greedy answer ids) for every frozen question, in freeze order.
        max_prompt_tokens: keep only the last N prompt ids (for models with a short context).
    """
    frozen_ids = {q["question_id"] for q, _ in frozen}
    frozen_cats = list(dict.fromkeys(q["category"] for q, _ in frozen)) or list(MT_BENCH)
    out = []
    for name, n in counts.items():
        if name not in WORKLOADS:
            raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
        items: list[Item] = []
        if name == "replay":
            items = [item_for(q, encoder, max_prompt_tokens) for q, _ in frozen[:n]]
        elif name == "novel":
            items = [item_for(q, encoder, max_prompt_tokens) for q in round_robin(questions, NOVEL, n)]
        elif name == "copy":
            items = [item_for(q, encoder, max_prompt_tokens) for q in round_robin(questions, COPY, n)]
        elif name == "specbench":
            cats = list(_by_category(questions))
            items = [item_for(q, encoder, max_prompt_tokens)
                     for q in round_robin(questions, cats, n, exclude=frozen_ids)]
        elif name == "near":
            seconds = [(q, ans) for q, ans in frozen if len(q.get("turns", [])) > 1]
            others = round_robin(questions, frozen_cats, n, exclude=frozen_ids)
            while len(items) < n and (seconds or others):
                if seconds and (len(items) % 2 == 0 or not others):
                    q, ans = seconds.pop(0)
                    msgs = [{"role": "user", "content": q["turns"][0]},
                            {"role": "assistant", "content": encoder.decode(ans)},
                            {"role": "user", "content": q["turns"][1]}]
                    items.append(Item(f"{q['question_id']}/t2", q["category"],
                                      _clip(encoder.encode(msgs), max_prompt_tokens), turn=2))
                elif others:
                    items.append(item_for(others.pop(0), encoder, max_prompt_tokens))
        out.append(Workload(name, items, DESCRIPTIONS[name]))
    return out


def parse_workloads(spec: str, default_n: int) -> dict[str, int]:
    """``"replay,novel:10"`` -> {"replay": default_n, "novel": 10}; ``"all"`` = every workload."""
    counts: dict[str, int] = {}
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        name, _, n = part.partition(":")
        names = WORKLOADS if name == "all" else (name,)
        for nm in names:
            if nm not in WORKLOADS:
                raise ValueError(f"unknown workload {nm!r}; choose from {', '.join(WORKLOADS)} (or all)")
            try:
                counts[nm] = int(n) if n else default_n
            except ValueError:
                raise ValueError(f"workload {part!r}: count {n!r} is not an integer") from None
            if counts[nm] < 1:
                raise ValueError(f"workload {part!r}: count must be at least 1")
    if not counts:
        raise ValueError("no workload given")
    return counts
