"""``redraft serve --runtime llama.cpp``: the bundled GGUF served by llama.cpp, one request at a time.

Every answer is checked against redraft's plain decoding on the same llama.cpp target (itself checked against
llama.cpp's own greedy decoding in test_llama_target.py): completions, chat, streaming, the answer cache, and a
repeated prompt decoded again from the tokens llama.cpp's cache still holds (the held prefix), which never serves
another tenant. The live-server tests are marked slow and skipped without the ``llama`` extra; the flag checks and
the held-prefix units run everywhere.
"""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import use_session_cache
from llamakit import SKIP_REASON, has_llama
from serverkit import live_server

N_CTX, THREADS, N = 2048, 1, 24
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "List three primary colors."}]


def serve_args(*extra: str):
    from redraft.cli import build_parser

    return build_parser().parse_args(["serve", "--runtime", "llama.cpp", "--n-ctx", str(N_CTX), "--port", "0",
                                      "--quiet", *extra])


@pytest.fixture(scope="module")
def llama():
    if not has_llama():
        pytest.skip(SKIP_REASON)
    from redraft.compose import load_target

    return load_target(None, runtime="llama.cpp", n_ctx=N_CTX, threads=THREADS, quiet=True)


@pytest.fixture
def session_cache(monkeypatch):
    """The run's own redraft cache (the llama.cpp target's cost curve is measured once and kept there)."""
    use_session_cache(monkeypatch)


def plain_text(loaded, ids: list[int], n: int = N) -> str:
    """redraft's plain greedy decoding of ``ids`` on the llama.cpp target, as text."""
    from redraft.compose import plain_engine

    res = plain_engine(loaded.model, eos_token_ids=loaded.eos_token_ids).generate(ids, n)
    return loaded.tokenizer.decode(res.output_ids, skip_special_tokens=True)


# ---- flags: refused before anything slow -----------------------------------------------------------------------------

def test_llama_runs_one_request_at_a_time_unless_asked():
    from redraft.cli.serve import max_running_of

    assert max_running_of(serve_args()) == 1 == max_running_of(serve_args("--max-running", "1"))
    assert max_running_of(serve_args("--max-running", "4")) == 4


def test_llama_refuses_a_model_directory(tmp_path):
    from redraft.cli.serve import build_server

    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match="the llama.cpp runtime runs a .gguf file; this is a directory"):
        build_server(serve_args("--model", str(tmp_path)))
    with pytest.raises(SystemExit, match="--dtype bfloat16: the llama.cpp runtime runs the GGUF file's own"):
        build_server(serve_args("--dtype", "bfloat16"))


def test_llama_flag_errors_from_the_command_line(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "redraft", "serve", "--runtime", "llama.cpp", "--dtype", "float16",
                          "--max-running", "4", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("redraft serve: error: --dtype float16: the llama.cpp "
                                                          "runtime runs the GGUF file's own quantization")
    assert "Traceback" not in out.stderr


# ---- the held prefix (units on a stand-in target) --------------------------------------------------------------------

class _Held:
    """A target stand-in: the ids its cache holds."""

    def __init__(self, ids):
        self.ids, self.length = list(ids), len(ids)

    def snapshot(self, ids):
        from redraft.runtimes.transformers.target import PrefixKV

        assert list(ids) == self.ids[:len(ids)]
        return PrefixKV(tuple(ids), ())


def test_held_prefix_names_the_common_prefix_and_costs_nothing():
    from redraft.server.admission import KVBudget
    from redraft.server.prefix_cache import HeldPrefix

    target = _Held([5, 6, 7, 8, 9])
    held = HeldPrefix(target, max_tokens=16)
    hit = held.lookup("alice", [5, 6, 7, 1, 2])
    assert hit.ids == (5, 6, 7) and hit.kv == ()
    assert held.lookup("alice", [5, 6, 7, 8, 9]).ids == (5, 6, 7, 8)  # one prompt token is left to feed
    assert held.lookup("alice", [4, 6]) is None and len(held) == 1
    assert HeldPrefix(target, max_tokens=2).lookup("alice", [5, 6, 7, 1]).ids == (5, 6)
    assert (held.stats.queries, held.stats.hits) == (12, 7)
    budget = KVBudget(10, held)
    assert budget.try_reserve(10) and budget.used == 10  # the held tokens are the running request's memory
    held.store("alice", hit)
    assert target.ids == [5, 6, 7, 8, 9]


# ---- a live server ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.llama
def test_llama_server_answers_as_plain_decoding(llama, session_cache):
    tok = llama.tokenizer
    ids = tok(PROMPT)["input_ids"]
    want = plain_text(llama, ids)
    chat_ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat_ids = chat_ids["input_ids"] if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys") else chat_ids
    want_chat = plain_text(llama, list(chat_ids))
    with live_server(serve_args(), llama) as srv:
        assert srv.server.scheduler.max_running == 1 and srv.server.generator.batcher is None
        client, model = srv.client(), srv.server.model_id
        first = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0)
        assert first.choices[0].text == want and first.usage.prompt_tokens == len(ids)
        again = client.completions.create(model=model, prompt=PROMPT, max_tokens=N, temperature=0)
        assert again.choices[0].text == want
        assert again.usage.prompt_tokens_details.cached_tokens == len(ids)  # the answer cache: no forward
        chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=N, temperature=0)
        assert chat.choices[0].message.content == want_chat
        scored = httpx.post(srv.url + "/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 0,
                                                            "echo": True, "logprobs": 0}, timeout=60).json()
        assert scored["choices"][0]["logprobs"]["token_logprobs"][0] is None
        assert len(scored["choices"][0]["logprobs"]["tokens"]) == len(ids)
        # decoded after the scoring forward left the prompt in llama.cpp's cache: streamed, still plain decoding's
        # past the stored answer's end: decoded, not replayed
        stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=N + 8, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == plain_text(llama, ids, N + 8)
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(ids) - 1  # the scored prompt, held
        r = httpx.post(srv.url + "/completions", json={"model": model, "prompt": PROMPT, "max_tokens": -1},
                       timeout=60)
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_tokens" and "max_tokens" in err["message"], r.text
        models = httpx.get(srv.url + "/models", timeout=60).json()["data"]
        assert models[0]["max_model_len"] == N_CTX


@pytest.mark.slow
@pytest.mark.llama
def test_llama_server_decodes_again_from_its_held_prefix_per_tenant(llama, session_cache, tmp_path):
    tenants = tmp_path / "tenants.json"
    tenants.write_text(json.dumps({"key-a": "alice", "key-b": "bob"}))
    tok = llama.tokenizer
    ids = tok(PROMPT)["input_ids"]
    want = plain_text(llama, ids, 32)
    with live_server(serve_args("--no-answer-cache", "--tenants", str(tenants)), llama) as srv:
        model = srv.server.model_id
        alice, bob = srv.client("key-a"), srv.client("key-b")
        first = alice.completions.create(model=model, prompt=PROMPT, max_tokens=32, temperature=0)
        assert first.choices[0].text == want and first.usage.prompt_tokens_details.cached_tokens == 0
        # decoded again: from llama.cpp's cache of alice's previous request, drafted from what she learned
        again = alice.completions.create(model=model, prompt=PROMPT, max_tokens=32, temperature=0)
        assert again.choices[0].text == want
        assert again.usage.prompt_tokens_details.cached_tokens == len(ids) - 1
        other = bob.completions.create(model=model, prompt=PROMPT, max_tokens=32, temperature=0)
        assert other.choices[0].text == want
        assert other.usage.prompt_tokens_details.cached_tokens == 0  # alice's tokens never serve bob
        metrics = httpx.get(srv.base + "/metrics", timeout=60).text
        hits = [line for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
        assert [float(line.split()[-1]) for line in hits] == [len(ids) - 1]


SYSTEM = ("You are a careful assistant. Answer in one short sentence, name your source, and never guess. "
          "Rules: be brief; prefer facts; say 'I do not know' when unsure; use plain words; no lists. ") * 3


@pytest.mark.slow
@pytest.mark.llama
def test_llama_server_restarted_on_its_corpus_dir_loads_the_prefix_state_from_disk(llama, session_cache, tmp_path):
    """llama.cpp's sequence state written after a request (``llama_state_seq_get_data``) is what a restarted
    server starts the next request under the same system prompt from; the answer is plain decoding's."""
    tok = llama.tokenizer
    second = SYSTEM + "Question: what is the capital of Italy?"
    want = plain_text(llama, tok(second)["input_ids"], N)
    args = serve_args("--no-answer-cache", "--corpus-dir", str(tmp_path / "c"))
    with live_server(args, llama) as srv:
        srv.client().completions.create(model=srv.server.model_id, prompt=SYSTEM + "Question: what is the capital "
                                        "of France?", max_tokens=N, temperature=0)
    llama.model.reset()  # the next server shares this target: nothing of the first request stays held in it
    with live_server(args, llama) as srv:
        r = srv.client().completions.create(model=srv.server.model_id, prompt=second, max_tokens=N, temperature=0)
        stats = r.model_extra["redraft"]
    assert r.choices[0].text == want
    assert stats["prefix_disk_tokens"] == stats["prefix_hit_tokens"] >= len(tok(SYSTEM)["input_ids"]) - 2


@pytest.mark.slow
@pytest.mark.llama
def test_llama_server_batches_requests_as_sequences_of_one_context(llama, session_cache):
    """``--max-running 3``: three requests at once, each a sequence of one llama.cpp context batched into one
    ``llama_decode`` per step; every answer is plain decoding's (on a context of one sequence)."""
    from concurrent.futures import ThreadPoolExecutor

    from redraft.compose import load_target

    prompts = [PROMPT, "Write a haiku about the sea.", "Name three kinds of trees."]
    want = [plain_text(llama, llama.tokenizer(p)["input_ids"], 32) for p in prompts]
    three = load_target(None, runtime="llama.cpp", n_ctx=N_CTX, threads=THREADS, quiet=True, sequences=3)
    with live_server(serve_args("--max-running", "3", "--no-answer-cache"), three) as srv:
        assert srv.server.scheduler.max_running == 3 and srv.server.generator.prefix_cache is None
        client, model = srv.client(), srv.server.model_id

        def ask(prompt):
            return client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)

        with ThreadPoolExecutor(3) as pool:
            got = list(pool.map(ask, prompts * 2))
        assert [g.choices[0].text for g in got] == want * 2
        batcher = srv.server.generator.batcher
        assert batcher.packed_steps > 0  # steps carried several sequences
        assert sorted(batcher.free) == [0, 1, 2]
    with pytest.raises(ValueError, match="context of 1 sequences for --max-running 3"):
        with live_server(serve_args("--max-running", "3"), llama):
            pass
