"""Helpers for the server tests: a tiny saved model with a word-level tokenizer and a chat template, and a live
``redraft serve`` (uvicorn on a free 127.0.0.1 port, in a background thread of the test process)."""

from __future__ import annotations

import json
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import build_tiny

VOCAB = 64
EOS = 1
CONTEXT = 640  # long enough that a generation runs for many steps (the disconnect test needs that)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def save_tiny_model(d: Path) -> Path:
    """A tiny random Llama plus a word-level tokenizer ("t00".."t63" are ids 0..63, "t01" is EOS) in ``d``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={f"t{i:02d}": i for i in range(VOCAB)}, unk_token="t00"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="t00", eos_token="t01")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(d)
    build_tiny("llama", "sdpa", seed=11, vocab_size=VOCAB, eos_token_id=EOS, max_position_embeddings=CONTEXT
               ).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model saved once per test module (conftest.py shares this fixture with every test module). While the module runs,
    redraft's cache (the server's cost curve) is a temporary directory: never the user's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("REDRAFT_CACHE", str(tmp_path_factory.mktemp("serve-cache")))
        yield save_tiny_model(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    """A ``--tenants`` file of two API keys: ``key-a`` is tenant alice, ``key-b`` bob."""
    path = tmp_path_factory.mktemp("tenants") / "tenants.json"
    path.write_text(json.dumps({"key-a": "alice", "key-b": "bob"}))
    return path


@pytest.fixture(scope="module")
def loaded(model_dir):
    """The tiny model loaded as ``redraft serve`` loads it."""
    from redraft.io.loading import load_model

    return load_model(model_dir)


def words(ids) -> str:
    return " ".join(f"t{i:02d}" for i in ids)


def serve_args(model_dir, *extra: str, quiet: bool = True):
    """Parsed ``redraft serve`` arguments for the tiny model; ``--quiet`` unless asked (access-log lines are written
    after each response is sent, so they would spill into other tests' output)."""
    from redraft.cli import build_parser

    return build_parser().parse_args(["serve", "--model", str(model_dir), "--port", "0", *extra,
                                      *(["--quiet"] if quiet else [])])


class Live:
    """A running server: ``url`` (…/v1), ``server`` (redraft.server.app.Server), ``client(key)``."""

    def __init__(self, server, port: int) -> None:
        self.server, self.port = server, port
        self.base = f"http://127.0.0.1:{port}"
        self.url = f"{self.base}/v1"

    def client(self, key: str = "none", **kw):
        from openai import OpenAI

        return OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=kw.pop("timeout", 60), **kw)


@contextmanager
def live_server(args, loaded=None, start_timeout: float = 30.0):
    """Build the server from parsed ``serve`` args (and an already loaded model), run it, stop it at exit."""
    import uvicorn

    from redraft.cli.serve import build_server, listen

    server = build_server(args, loaded)
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(server.app(), log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Live(server, port)
    finally:
        uv.should_exit = True
        thread.join(timeout=15)
        sock.close()
