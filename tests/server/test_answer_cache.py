"""The server's answer cache (redraft/server/answer_cache.py): a greedy request whose tenant already got an answer for
the identical prompt is answered from it without a forward, cut at its own max_tokens, EOS and stop strings.

Every served answer equals plain greedy decoding of the same prompt (ids and text); sampled and log-probability
requests never come from it; one tenant's answers never serve another; ``--no-answer-cache`` turns it off. The
cut itself (:func:`replay`) is checked without a model against :class:`Engine`-style cuts of plain decoding.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from conftest import plain_greedy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serverkit import EOS, live_server, serve_args, words

from redraft.bench.serve_bench import metric_value
from redraft.decoding.engine import Engine, GenerationResult
from redraft.decoding.sampling import SamplingParams
from redraft.decoding.stopping import StopStrings
from redraft.io.prompts import encode_chat
from redraft.server.answer_cache import Answer, AnswerCache, answer_key, cap_in_key, replay


class WordTokenizer:
    """The serverkit tokenizer's decoding without the model: id i is the word "tNN", EOS is special."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i:02d}" for i in ids if not (skip_special_tokens and i == EOS))


def plain_cut(continuation: list[int], max_tokens: int, stops: list[str]) -> tuple[list[int], str, str | None]:
    """Plain decoding's output along ``continuation`` (the greedy ids), one token a step: max_tokens, EOS, stop;
    with the text before the stop string when one ended it."""
    stop = StopStrings(WordTokenizer(), stops)
    out: list[int] = []
    for t in continuation[:max_tokens]:
        out.append(t)
        if t == EOS:
            return out, "eos", None
        cut = stop.check(out) if stop else None
        if cut is not None:
            return out[:cut], "stop", stop.text
    return out, "length", None


# ---- the cut, without a model ---------------------------------------------------------------------------------------

GREEDY = [12, 30, 7, 44, 9, 51, 23, 8, 17, 40, 2, 61]  # a greedy continuation (no EOS within it)


@pytest.mark.parametrize("max_tokens", [1, 3, 7, 12])
@pytest.mark.parametrize("stops", [[], ["t09"], ["t51 t23"], ["t99"], ["t17", "t30"]])
def test_replay_cuts_a_stored_answer_as_plain_decoding_does(max_tokens, stops):
    stored = Answer(tuple(GREEDY))
    stop = StopStrings(WordTokenizer(), stops)
    got = replay(stored, [5, 6], max_tokens, stop, {EOS})
    want, reason, text = plain_cut(GREEDY, max_tokens, stops)
    assert got is not None and got.output_ids == want and got.stop_reason == reason
    assert got.forwards == 0 and got.prompt_ids == [5, 6]
    assert stop.text == text


def test_replay_past_the_stored_ids_is_a_miss_unless_they_ended_on_eos():
    stop = StopStrings(WordTokenizer(), [])
    assert replay(Answer(tuple(GREEDY)), [5], len(GREEDY) + 1, stop, {EOS}) is None
    assert replay(Answer(tuple(GREEDY)), [5], len(GREEDY) + 1, StopStrings(WordTokenizer(), ["t99"]), {EOS}) is None
    ended = Answer(tuple(GREEDY[:5]) + (EOS,), eos=True)
    got = replay(ended, [5], 100, stop, {EOS})
    assert got.output_ids == GREEDY[:5] + [EOS] and got.stop_reason == "eos"
    shorter = replay(ended, [5], 6, stop, {EOS})  # the cap lands on the EOS itself
    assert shorter.output_ids == GREEDY[:5] + [EOS] and shorter.stop_reason == "eos"
    assert replay(ended, [5], 3, stop, {EOS}).stop_reason == "length"
    # a stop string inside an answer that was stored without one is served
    got = replay(Answer(tuple(GREEDY)), [5], 100, StopStrings(WordTokenizer(), ["t23"]), {EOS})
    assert got.output_ids == GREEDY[:7] and got.stop_reason == "stop"
    assert replay(None, [5], 3, stop, {EOS}) is None


def test_only_greedy_requests_without_a_grammar_have_a_key():
    prompt = [3, 4, 5]
    greedy = SamplingParams()
    assert answer_key("a", prompt, greedy) is not None
    assert answer_key("a", prompt, SamplingParams(temperature=0.7, seed=3)) is None
    assert answer_key("a", prompt, greedy, logprobs=0) not in (None, answer_key("a", prompt, greedy))
    assert answer_key("a", prompt, greedy, logprobs=0) != answer_key("a", prompt, greedy, logprobs=2)
    class Grammar:
        def start(self, prompt_length):
            raise AssertionError("never started here")

    assert answer_key("a", prompt, SamplingParams(constraint=Grammar())) is None
    assert answer_key("a", prompt, greedy) != answer_key("b", prompt, greedy)  # per tenant
    assert answer_key("a", prompt, greedy) != answer_key("a", prompt + [6], greedy)
    assert answer_key("a", prompt, greedy) != answer_key("a", prompt, SamplingParams(repetition_penalty=1.3))
    assert answer_key("a", prompt, greedy) == answer_key("a", list(prompt), SamplingParams(seed=9))  # seed unused
    assert answer_key("a", prompt, greedy, max_tokens=4) != answer_key("a", prompt, greedy, max_tokens=5)


def test_a_forced_eos_at_the_cap_puts_the_cap_in_the_key():
    """A generation_config with forced_eos_token_id makes the last allowed token EOS: the answer depends on
    max_tokens, so only the same cap may be served."""
    from types import SimpleNamespace

    from transformers import GenerationConfig

    forced = SimpleNamespace(generation_config=GenerationConfig(forced_eos_token_id=EOS))
    plain = SimpleNamespace(generation_config=GenerationConfig())
    assert cap_in_key(forced) and not cap_in_key(plain) and not cap_in_key(SimpleNamespace())
    assert not cap_in_key(forced, generation_config=False)  # the server ignores the model's generation_config


def test_store_keeps_the_longer_answer_and_evicts_least_recently_used():
    cache = AnswerCache(max_tokens=10)
    k1, k2, k3 = (answer_key("a", [i], SamplingParams()) for i in (1, 2, 3))
    assert cache.store(k1, GenerationResult([1], output_ids=[4, 5, 6]))
    assert not cache.store(k1, GenerationResult([1], output_ids=[4, 5]))  # shorter: the stored one covers it
    assert cache.store(k1, GenerationResult([1], output_ids=[4, 5, 6, 7]))
    assert cache.get(k1).ids.tolist() == [4, 5, 6, 7] and cache.tokens == 4
    assert cache.store(k2, GenerationResult([2], output_ids=[8, EOS], stop_reason="eos"))
    assert not cache.store(k2, GenerationResult([2], output_ids=[8, 9, 9, 9]))  # EOS: nothing follows
    cache.get(k1)  # k1 most recently used: k2 goes first
    assert cache.store(k3, GenerationResult([3], output_ids=[9] * 5))
    assert cache.get(k2) is None and cache.get(k1) is not None and cache.tokens == 9
    assert not cache.store(k3, GenerationResult([3], output_ids=[9] * 11))  # longer than the budget
    with pytest.raises(ValueError, match="max_tokens"):
        AnswerCache(0)


# ---- a live server --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def live(model_dir, loaded, tenants_file):
    with live_server(serve_args(model_dir, "--tenants", str(tenants_file)), loaded) as srv:
        yield srv


def _complete(srv, prompt, n: int, key: str = "key-a", **extra) -> dict:
    r = httpx.post(f"{srv.url}/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0, **extra},
                   headers={"Authorization": f"Bearer {key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _plain(loaded, prompt, n: int) -> tuple[str, list[int]]:
    out = plain_greedy(loaded.model, prompt, n, eos=[EOS])
    return words([t for t in out if t != EOS]), out


def _hits(srv) -> float:
    return metric_value(httpx.get(f"{srv.base}/metrics", timeout=10).text, "redraft:answer_cache_hits_total")


def test_a_repeated_request_is_answered_from_the_cache_identically(live, loaded):
    prompt = [3, 14, 15, 9, 26, 5, 35]
    want, ids = _plain(loaded, prompt, 24)
    first = _complete(live, prompt, 24)
    assert first["choices"][0]["text"] == want and first["redraft"]["answer_cache_hit"] is False
    assert first["redraft"]["forwards"] > 0
    corpus = live.server.generator.corpora.get("alice").n_tokens
    hits = _hits(live)
    for _ in range(3):
        again = _complete(live, prompt, 24)
        assert again["choices"][0]["text"] == want
        assert again["redraft"]["answer_cache_hit"] is True and again["redraft"]["forwards"] == 0
        assert again["redraft"]["tokens_per_forward"] is None and again["redraft"]["tokens_per_second"] is None
        assert again["redraft"]["learned"] is False
        sources = again["redraft"]["sources"]  # the same sources as a decoded answer's, nothing proposed
        assert "corpus" in sources and all(s["proposed"] == 0 for s in sources.values())
        assert again["usage"]["completion_tokens"] == len(ids) == first["usage"]["completion_tokens"]
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt)  # all of it, from the cache
        assert again["redraft"]["prefix_hit_tokens"] == 0  # the prefix cache was not consulted
        assert again["choices"][0]["finish_reason"] == first["choices"][0]["finish_reason"]
    assert _hits(live) - hits == 3
    assert live.server.generator.corpora.get("alice").n_tokens == corpus  # not learned again


def test_a_shorter_cap_or_a_stop_string_is_served_cut_a_longer_cap_is_decoded(live, loaded):
    prompt = [21, 4, 33, 17, 8, 50, 12]
    want, ids = _plain(loaded, prompt, 30)
    assert EOS not in ids[:20], "pick a prompt whose answer runs past 20 tokens"
    _complete(live, prompt, 20)  # stored: the first 20 tokens
    short = _complete(live, prompt, 9)
    assert short["redraft"]["answer_cache_hit"] is True
    assert short["choices"][0]["text"] == _plain(loaded, prompt, 9)[0]
    assert short["choices"][0]["finish_reason"] == "length"
    stop = words([ids[6]])
    text = words(ids[:20])
    cut = _complete(live, prompt, 20, stop=[stop])
    assert cut["redraft"]["answer_cache_hit"] is True and cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["text"] == text[:text.index(stop)]
    longer = _complete(live, prompt, 30)  # past the stored ids: decoded, identical, and stored as the longer answer
    assert longer["redraft"]["answer_cache_hit"] is False and longer["choices"][0]["text"] == want
    again = _complete(live, prompt, 30)
    assert again["redraft"]["answer_cache_hit"] is True and again["choices"][0]["text"] == want


def test_a_hit_reports_its_whole_prompt_as_cached_in_the_responses_api_too(live):
    body = {"input": words([12, 30, 7, 44]), "max_output_tokens": 8}
    got = [httpx.post(f"{live.url}/responses", json=body, headers={"Authorization": "Bearer key-a"},
                      timeout=60).json() for _ in range(2)]
    assert [g["redraft"]["answer_cache_hit"] for g in got] == [False, True]
    assert got[1]["usage"]["input_tokens_details"]["cached_tokens"] == got[1]["usage"]["input_tokens"] > 0


def test_sampled_requests_never_come_from_the_cache_and_logprobs_have_their_own_answers(live):
    prompt = [40, 41, 7, 3, 19]
    _complete(live, prompt, 10)
    for _ in range(2):
        body = _complete(live, prompt, 10, temperature=0.8, seed=5)
        assert body["redraft"]["answer_cache_hit"] is False and body["redraft"]["forwards"] > 0
    first = _complete(live, prompt, 10, logprobs=2)  # an answer without log-probabilities cannot serve it
    assert first["redraft"]["answer_cache_hit"] is False and first["redraft"]["forwards"] > 0
    hit = _complete(live, prompt, 10, logprobs=2)  # the stored entries, exactly
    assert hit["redraft"]["answer_cache_hit"] is True and hit["choices"][0]["logprobs"] == first["choices"][0]["logprobs"]
    assert _complete(live, prompt, 10, logprobs=1)["redraft"]["answer_cache_hit"] is False
    assert _complete(live, prompt, 10)["redraft"]["answer_cache_hit"] is True


def test_one_tenants_answers_never_serve_another(live, loaded):
    prompt = [60, 2, 45, 13, 29, 6]
    want = _plain(loaded, prompt, 12)[0]
    _complete(live, prompt, 12, key="key-a")
    other = _complete(live, prompt, 12, key="key-b")
    assert other["redraft"]["answer_cache_hit"] is False and other["choices"][0]["text"] == want
    assert _complete(live, prompt, 12, key="key-b")["redraft"]["answer_cache_hit"] is True


def test_a_streamed_repeat_sends_the_answer_as_ordinary_chunks(live, loaded):
    msgs = [{"role": "user", "content": "t31 t32 t07 t44 t05"}]
    body = {"messages": msgs, "max_tokens": 16, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    texts, finals, usages = [], [], []
    for _ in range(2):
        with httpx.stream("POST", f"{live.url}/chat/completions", json=body,
                          headers={"Authorization": "Bearer key-a"}, timeout=60) as r:
            assert r.status_code == 200
            events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        texts.append("".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]))
        finals.append(next(e for e in events if e["choices"] and e["choices"][0]["finish_reason"])["redraft"])
        usages.append(events[-1]["usage"])
    prompt = encode_chat(live.server.generator.tokenizer, msgs)
    assert texts[0] == texts[1] == _plain(loaded, prompt, 16)[0]
    assert finals[0]["answer_cache_hit"] is False and finals[1]["answer_cache_hit"] is True
    assert finals[1]["forwards"] == 0
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] == usages[1]["prompt_tokens"] == len(prompt)


def test_the_access_log_shows_a_hit(model_dir, loaded, capsys):
    with live_server(serve_args(model_dir, quiet=False), loaded) as srv:
        for _ in range(2):
            _complete(srv, [9, 8, 7, 6, 5], 6, key="none")
        lines: list[str] = []
        end = time.monotonic() + 10
        while len(lines) < 2 and time.monotonic() < end:  # a line is written once its response was sent
            lines += [ln for ln in capsys.readouterr().err.splitlines() if '"POST /v1/completions" 200' in ln]
            time.sleep(0.05)
    assert len(lines) == 2, lines
    assert "answer_cache_hits=0" in lines[0] and "answer_cache_hits=1" in lines[1]
    assert "tokens_per_forward=-" in lines[1]


def test_no_answer_cache_decodes_every_request(model_dir, loaded):
    with live_server(serve_args(model_dir, "--no-answer-cache"), loaded) as srv:
        assert srv.server.generator.answers is None
        prompt = [11, 22, 33, 44, 55]
        want = _plain(loaded, prompt, 10)[0]
        for _ in range(2):
            body = _complete(srv, prompt, 10, key="none")
            assert body["redraft"]["answer_cache_hit"] is False and body["redraft"]["forwards"] > 0
            assert body["choices"][0]["text"] == want
        assert _hits(srv) == 0


def _plain_request(loaded, prompt, n: int, stops: list[str]) -> tuple[str, str, int]:
    """Plain greedy decoding (no drafters, one token a forward) of a request: its text, finish reason, token count."""
    stop = StopStrings(loaded.tokenizer, stops)
    res = Engine(loaded.model, [], eos_token_ids=[EOS]).generate(prompt, n, stop=stop if stop else None)
    assert res.forwards == len(res.output_ids) or res.stop_reason == "stop"
    text = stop.text if res.stop_reason == "stop" else loaded.tokenizer.decode(res.output_ids,
                                                                              skip_special_tokens=True)
    return text, "length" if res.stop_reason in ("length", "context") else "stop", len(res.output_ids)


def test_an_answer_stored_with_its_eos_serves_any_larger_cap(live, loaded):
    candidates = ([a, b, c, d, e] for a in (18, 23, 43) for b in (24, 35) for c in (59, 18) for d in (48, 9)
                  for e in (32, 40))
    prompt, ids = next((p, out) for p in candidates if (out := _plain(loaded, p, 30)[1])[-1] == EOS)
    first = _complete(live, prompt, 30, key="key-b")
    assert first["choices"][0]["finish_reason"] == "stop" and first["usage"]["completion_tokens"] == len(ids)
    for cap in (len(ids), 30, 200):
        body = _complete(live, prompt, cap, key="key-b")
        assert body["redraft"]["answer_cache_hit"] is True, cap
        assert body["choices"][0]["text"] == first["choices"][0]["text"]
        assert body["choices"][0]["finish_reason"] == "stop" and body["usage"]["completion_tokens"] == len(ids)


@settings(max_examples=25, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(prompt=st.lists(st.integers(2, 63), min_size=3, max_size=8), first_cap=st.integers(1, 24),
       cap=st.integers(1, 24), stop=st.one_of(st.none(), st.integers(2, 63)))
def test_random_repeats_equal_plain_greedy_whether_served_or_decoded(live, loaded, prompt, first_cap, cap, stop):
    """A request, then the same prompt with another cap and maybe a stop string: the second equals plain greedy
    decoding of it with that cap and stop string, served from the cache or decoded."""
    stops = [] if stop is None else [words([stop])]
    _complete(live, prompt, first_cap)
    body = _complete(live, prompt, cap, stop=stops) if stops else _complete(live, prompt, cap)
    text, reason, n = _plain_request(loaded, prompt, cap, stops)
    assert body["choices"][0]["text"] == text and body["choices"][0]["finish_reason"] == reason
    assert body["usage"]["completion_tokens"] == n
    stored = _plain(loaded, prompt, max(first_cap, 24))[1][:first_cap]
    if n <= len(stored):  # the cut falls inside the first answer: served without a forward
        assert body["redraft"]["answer_cache_hit"] is True and body["redraft"]["forwards"] == 0


def test_with_the_cap_in_the_key_only_the_same_cap_is_served(live, monkeypatch):
    monkeypatch.setattr(live.server.generator, "cap_in_key", True)  # as under a forced EOS at max_tokens
    prompt = [7, 33, 2, 58, 14, 41]
    _complete(live, prompt, 12)
    assert _complete(live, prompt, 6)["redraft"]["answer_cache_hit"] is False
    assert _complete(live, prompt, 12)["redraft"]["answer_cache_hit"] is True
