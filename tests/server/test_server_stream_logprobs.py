"""Streamed log-probabilities (``stream: true`` with chat ``logprobs``/``top_logprobs`` and completions
``logprobs``), read with the ``openai`` client from a live server (tiny saved model): the chunks' entries put end to
end equal the non-streamed answer's, for a greedy answer (and its replay from the learned corpus, several tokens a
forward), a seeded sampled one, and an answer-cache hit (the stored entries, exactly).

Two decodings of one request compute their rows in different verify batches, so their log-probabilities agree
within float rounding (1e-3, as in test_server_wire.py); tokens and a cache hit's values are compared exactly.
"""

from __future__ import annotations

import pytest
from serverkit import live_server, serve_args, words

TOL = 1e-3
PROMPT = words([21, 22, 23, 24])


@pytest.fixture(scope="module")
def live(model_dir, loaded):
    """No answer cache: every request decodes (the learned corpus drafts repeats)."""
    with live_server(serve_args(model_dir, "--no-answer-cache"), loaded) as srv:
        yield srv


@pytest.fixture(scope="module")
def cached(model_dir, loaded):
    with live_server(serve_args(model_dir), loaded) as srv:
        yield srv


def chat_kw(live, **kw):
    return dict(model=live.server.model_id, messages=[{"role": "user", "content": PROMPT}], max_tokens=30,
                logprobs=True, top_logprobs=3, **kw)


def streamed_chat(client, **kw):
    """(text, logprob entries put end to end, entries per chunk, the final chunk's redraft statistics)."""
    text, entries, sizes, stats = "", [], [], None
    for ch in client.chat.completions.create(stream=True, **kw):
        c = ch.choices[0]
        text += c.delta.content or ""
        if c.logprobs is not None:
            entries += c.logprobs.content
            sizes.append(len(c.logprobs.content))
        if c.finish_reason is not None:
            stats = (ch.model_extra or {}).get("redraft")
    return text, entries, sizes, stats


def assert_chat_entries(got, want, exact: bool = False):
    assert [e.token for e in got] == [e.token for e in want]
    for g, w in zip(got, want, strict=True):
        assert g.bytes == w.bytes
        assert [t.token for t in g.top_logprobs] == [t.token for t in w.top_logprobs]
        if exact:
            assert g.logprob == w.logprob and [t.logprob for t in g.top_logprobs] == [t.logprob for t in w.top_logprobs]
        else:
            assert abs(g.logprob - w.logprob) < TOL
            assert all(abs(a.logprob - b.logprob) < TOL for a, b in zip(g.top_logprobs, w.top_logprobs, strict=True))


def test_streamed_chat_logprobs_equal_non_streamed_greedy_and_replayed(live):
    client = live.client()
    whole = client.chat.completions.create(**chat_kw(live))
    want = whole.choices[0].logprobs.content
    assert len(want) == whole.usage.completion_tokens >= 8
    text, got, sizes, stats = streamed_chat(client, **chat_kw(live))  # the corpus learned the answer: a replay
    assert text == whole.choices[0].message.content
    assert_chat_entries(got, want)
    assert stats["forwards"] < len(want) and max(sizes) > 1  # several tokens (and entries) in one step


def test_streamed_chat_logprobs_equal_non_streamed_seeded_sampling(live):
    client = live.client()
    kw = chat_kw(live, temperature=0.9, seed=11)
    whole = client.chat.completions.create(**kw)
    text, got, _, _ = streamed_chat(client, **kw)
    assert text == whole.choices[0].message.content
    assert_chat_entries(got, whole.choices[0].logprobs.content)


def test_streamed_completion_logprobs_equal_non_streamed(live):
    client = live.client()
    kw = dict(model=live.server.model_id, prompt=PROMPT + " t14", max_tokens=20, logprobs=2)
    whole = client.completions.create(**kw).choices[0]
    text, lp = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in client.completions.create(stream=True, **kw):
        c = ch.choices[0]
        text += c.text
        if c.logprobs is not None:
            for k in lp:
                lp[k] += getattr(c.logprobs, k)
    assert text == whole.text
    want = whole.logprobs
    assert lp["tokens"] == want.tokens and lp["text_offset"] == want.text_offset
    assert all(abs(a - b) < TOL for a, b in zip(lp["token_logprobs"], want.token_logprobs, strict=True))
    for g, w in zip(lp["top_logprobs"], want.top_logprobs, strict=True):
        assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < TOL for t in g)


def test_streamed_logprobs_of_an_answer_cache_hit_are_the_stored_ones(cached):
    client = cached.client()
    whole = client.chat.completions.create(**chat_kw(cached))
    assert not whole.model_extra["redraft"]["answer_cache_hit"]
    text, got, sizes, stats = streamed_chat(client, **chat_kw(cached))
    assert stats["answer_cache_hit"] and stats["forwards"] == 0
    assert text == whole.choices[0].message.content
    assert_chat_entries(got, whole.choices[0].logprobs.content, exact=True)
    again = client.chat.completions.create(**chat_kw(cached))  # a non-streamed hit: the same entries
    assert again.model_extra["redraft"]["answer_cache_hit"]
    assert_chat_entries(again.choices[0].logprobs.content, whole.choices[0].logprobs.content, exact=True)


# ---- the bytes of a token that splits a character (no server) -------------------------------------------------------

def test_token_bytes_join_into_the_characters_tokens_split():
    """A byte-level BPE tokenizer splits an emoji or a CJK character over tokens that decode alone to U+FFFD: their
    ``bytes`` are the raw bytes, which join into the text's UTF-8 (OpenAI's field); whole tokens keep their text's."""
    from grammarkit import bpe_tokenizer

    from redraft.server.logprobs import chat_logprobs, token_bytes

    tok = bpe_tokenizer()
    text = 'Pizza: "🍕", 中文 and ok'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some token is a piece of a character
    assert b"".join(bytes(token_bytes(tok, t)) for t in ids) == text.encode("utf-8")
    assert all(token_bytes(tok, t) == list(tok.decode([t]).encode()) for t in ids if "\ufffd" not in tok.decode([t]))
    from redraft.decoding.logprobs import TokenLogprob

    entries = [TokenLogprob(token=t, logprob=-0.5, top_ids=[t], top_logprobs=[-0.5]) for t in ids]
    content = chat_logprobs(tok, entries)["content"]
    assert b"".join(bytes(c["bytes"]) for c in content) == text.encode("utf-8")
    assert all(c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)


def test_token_bytes_of_a_byte_fallback_token():
    from redraft.server.logprobs import token_bytes

    class Fallback:  # a SentencePiece vocabulary with byte fallback: <0xF0> is one byte
        def decode(self, ids, skip_special_tokens=False):
            return "\ufffd" if ids == [7] else "ok"

        def convert_ids_to_tokens(self, token):
            return "<0xF0>" if token == 7 else "ok"

    assert token_bytes(Fallback(), 7) == [0xF0] and token_bytes(Fallback(), 8) == list(b"ok")
