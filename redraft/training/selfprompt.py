"""Training questions written by the target itself: diverse prompts without a dataset hub.

The target is asked, through its chat template, to write one request of a given *kind* (a question, a coding
task, a letter to write, a word problem, ...) about a given *topic*; the request is sampled (seeded, top-k), cleaned,
de-duplicated and checked against the held-out Spec-Bench questions (any shared 6-word sequence drops it). The
target then answers these requests greedily (:func:`redraft.training.data.build_generation_data` with ``texts``),
which gives self-distillation records over many more topics and task types than the 432 Spec-Bench training
questions. Ours; the idea of letting the model write its own instructions follows Self-Instruct (Wang et al. 2023,
arXiv 2212.10560), without its seed tasks or filtering model.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from redraft.io.atomic import write_json

TOPICS = (
    "cooking", "baking bread", "gardening", "houseplants", "personal finance", "saving for retirement", "budgeting",
    "the stock market", "cryptocurrency", "climate change", "renewable energy", "solar panels", "electric cars",
    "public transport", "city planning", "architecture", "interior design", "ancient Rome", "ancient Egypt",
    "the French Revolution", "World War II", "the Cold War", "the Renaissance", "medieval castles", "philosophy",
    "ethics", "psychology", "sleep", "nutrition", "running", "yoga", "football", "basketball", "tennis", "chess",
    "video games", "board games", "movies", "music theory", "playing guitar", "classical music", "jazz",
    "painting", "photography", "poetry", "novels", "Shakespeare", "learning languages", "Spanish grammar",
    "job interviews", "writing a resume", "remote work", "leadership", "marketing", "starting a small business",
    "customer service", "negotiation", "time management", "productivity", "public speaking", "parenting",
    "pets", "dogs", "cats", "birds", "the ocean", "volcanoes", "earthquakes", "weather", "astronomy", "black holes",
    "the solar system", "space exploration", "physics", "quantum mechanics", "chemistry", "biology", "genetics",
    "evolution", "the human brain", "the immune system", "vaccines", "medicine", "first aid", "mental health",
    "mathematics", "algebra", "geometry", "probability", "statistics", "calculus", "prime numbers",
    "computer science", "algorithms", "sorting", "databases", "SQL", "Python programming", "JavaScript",
    "web development", "operating systems", "computer networks", "cybersecurity", "passwords", "machine learning",
    "neural networks", "robots", "smartphones", "social media", "the internet", "law", "human rights",
    "democracy", "economics", "inflation", "international trade", "travel", "Japan", "Italy", "Brazil", "Kenya",
    "mountains", "deserts", "rainforests", "recycling", "fashion", "coffee", "tea", "wine", "friendship",
    "moving to a new city", "buying a house", "cars", "bicycles", "airplanes", "trains", "farming", "bees",
)

KINDS = (
    ("a short factual question", "question"),
    ("a question that asks for an explanation", "question"),
    ("a question that asks for advice", "question"),
    ("a request to write a short story", "request"),
    ("a request to write a poem", "request"),
    ("a request to write an email or a letter", "request"),
    ("a request to write a Python function", "request"),
    ("a math word problem", "problem"),
    ("a logic puzzle", "puzzle"),
    ("a request to compare two things", "request"),
    ("a request for a list of tips", "request"),
    ("a request to summarize a short paragraph, including the paragraph", "request"),
    ("a request to translate a sentence into French, including the sentence", "request"),
    ("a request to explain a term to a child", "request"),
    ("a debate question with two sides", "question"),
    ("a request to plan a step-by-step schedule", "request"),
)

_WORD = re.compile(r"[a-z0-9]+")
_PREAMBLE = re.compile(r"^(sure|here|certainly|of course|okay|ok)\b[^:\n]*:\s*", re.I)


def instruction_for(kind: str, short: str, topic: str) -> str:
    """The request the target answers when it writes one training question."""
    return f"Write {kind} about {topic}. Reply with the {short} only."


def clean_question(text: str, min_words: int = 4, max_words: int = 120) -> str | None:
    """The usable request in a sampled reply, or None.

    Drops a leading "Sure, here is ...:" preamble and surrounding quotes; keeps the first paragraph unless the
    kind needs more (a paragraph to summarise follows a blank line), cut at 1,200 characters.
    """
    t = _PREAMBLE.sub("", text.strip()).strip().strip('"').strip()
    t = re.sub(r"\n{3,}", "\n\n", t)[:1200].strip()
    n = len(t.split())
    if not (min_words <= n <= max_words) or t.lower().startswith(("i'm sorry", "i cannot", "as an ai")):
        return None
    return t


def _key(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


def ngrams(text: str, n: int = 6) -> set[tuple[str, ...]]:
    """Lower-cased word n-grams of ``text``."""
    w = _WORD.findall(text.lower())
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


class QuestionFilter:
    """De-duplicates questions and refuses any sharing a word 6-gram (or its whole text) with a held-out one.

    Args:
        held_out: texts that must never be trained on (the held-out Spec-Bench questions).
    """

    def __init__(self, held_out: Iterable[str]) -> None:
        self.banned: set[tuple[str, ...]] = set()
        self.seen: set[str] = set()
        for t in held_out:
            self.banned |= ngrams(t)
            self.seen.add(_key(t))

    def accept(self, text: str) -> bool:
        """True (and remembered) for a new question that shares nothing with the held-out ones."""
        k = _key(text)
        if not k or k in self.seen or ngrams(text) & self.banned:
            return False
        self.seen.add(k)
        return True


def plan(seed: int = 0) -> list[tuple[str, str, str]]:
    """Every (kind, short name, topic) combination, in a seeded random order."""
    combos = list(itertools.product(KINDS, TOPICS))
    random.Random(seed).shuffle(combos)
    return [(k, s, t) for (k, s), t in combos]


@torch.inference_mode()
def sample_questions(model, tokenizer, n: int, *, held_out: Sequence[str], seed: int = 0, batch: int = 64,
                     max_new_tokens: int = 96, temperature: float = 1.0, top_k: int = 40, progress=None,
                     existing: Sequence[str] = ()) -> list[str]:
    """Up to ``n`` distinct requests written by the target (see the module docstring).

    Args:
        model, tokenizer: the target (a transformers causal LM) and its tokenizer.
        held_out: texts no returned question may overlap (6-word sequences).
        seed: seeds the topic/kind order and the sampling (each batch: ``seed`` + its first index).
        batch: most requests sampled in one ``generate`` call (fewer when fewer are missing: twice those).
        existing: questions already made (kept first, counted in ``n``; a resumed run passes them).
        progress: optional callable(n_questions_so_far) after each batch.
    Returns:
        the questions, ``existing`` first, in the order made.
    """
    from redraft.io.prompts import encode_prompt

    filt = QuestionFilter(held_out)
    out = [q for q in existing if filt.accept(q)]
    combos = plan(seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = tokenizer.eos_token_id
    start = len(existing)  # a resumed run continues with the next combinations
    i = start
    while len(out) < n and i < start + 4 * len(combos):
        # at most twice the questions still missing (the filter drops some): a test's two questions are not
        # sampled as a batch of 64
        size = min(batch, 2 * (n - len(out)))
        chunk = [combos[j % len(combos)] for j in range(i, i + size)]
        prompts = [encode_prompt(tokenizer, instruction_for(k, s, t)) for k, s, t in chunk]
        P = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (P - len(p)) + p for p in prompts])
        att = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
        torch.manual_seed(seed * 1_000_003 + i)
        ids, att = ids.to(model.device), att.to(model.device)
        gen = model.generate(input_ids=ids, attention_mask=att, do_sample=True, temperature=temperature,
                             top_k=top_k, top_p=1.0, max_new_tokens=max_new_tokens, pad_token_id=pad,
                             eos_token_id=eos)
        for row in gen[:, P:].tolist():
            q = clean_question(tokenizer.decode(row, skip_special_tokens=True))
            if q is not None and filt.accept(q) and len(out) < n:
                out.append(q)
        i += size
        if progress is not None:
            progress(len(out))
    return out


def load_or_make(path: Path, model, tokenizer, n: int, **kw) -> list[str]:
    """The questions in ``path`` (JSON list), topped up to ``n`` with :func:`sample_questions` and saved."""
    have = json.loads(path.read_text()) if path.is_file() else []
    if len(have) >= n:
        return have[:n]
    qs = sample_questions(model, tokenizer, n, existing=have, **kw)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, qs, indent=0)
    return qs
