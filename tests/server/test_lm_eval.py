"""lm-evaluation-harness against ``redraft serve`` (the default model, a live server): the local tasks in
tests/data/lm_eval (a generate_until and a multiple_choice task) run through ``local-completions`` with the server's
own tokenizer routes (``tokenizer_backend=remote``, no local tokenizer; the server started with
``--enable-tokenizer-info-endpoint``). A rerun of the generate_until task gives identical samples, answered from the
answers the first run stored (the answer cache); the multiple_choice task's loglikelihoods equal the ones computed
with transformers directly. Against a server with the default routes (no ``/tokenizer_info``, as vLLM), lm-eval's
own backend choice with a local tokenizer runs the chat template with ``--batch_size 4`` and ``num_concurrent=4``,
and ``local-chat-completions`` likewise, all with the samples of the one-at-a-time run. Marked slow (the real model;
lm-eval imports take ~20 s here)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import load_default_model
from serverkit import live_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "data" / "lm_eval"


@pytest.fixture(scope="module")
def real():
    from redraft.io.loading import DEFAULT_MODEL_PACKAGE

    if importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is None:
        pytest.skip(f"the default model's package {DEFAULT_MODEL_PACKAGE} is not installed")
    pytest.importorskip("lm_eval", reason="lm-eval is in the test extra: pip install -e '.[test]'")
    return load_default_model()


GENERATE_LIMIT = 4  # of the 8 generate_until questions (docs/serving.md runs all 8): keeps CI's time in bounds


def evaluate(srv, task: str, limit: int | None = None, *, model: str = "local-completions",
             backend: str = "tokenizer_backend=remote", batch_size: int = 4, num_concurrent: int = 1,
             chat: bool = False) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    route = "chat/completions" if model == "local-chat-completions" else "completions"
    args = f"model={srv.server.model_id},base_url={srv.url}/{route},{backend},num_concurrent={num_concurrent}," \
           "max_retries=1"
    return simple_evaluate(model=model, model_args=args, tasks=[task], batch_size=batch_size, limit=limit,
                           log_samples=True, apply_chat_template=chat, task_manager=TaskManager(include_path=str(TASKS)))


def loglikelihood(loaded, context: str, continuation: str) -> float:
    """log p(continuation | context) from one transformers forward, split into tokens as lm-eval splits them."""
    tok = loaded.tokenizer
    whole = tok(context + continuation, add_special_tokens=False)["input_ids"]
    n_ctx = len(tok(context, add_special_tokens=False)["input_ids"])
    with torch.inference_mode():
        lp = torch.log_softmax(loaded.model(torch.tensor([whole])).logits[0].float(), -1)
    return sum(lp[i - 1, whole[i]].item() for i in range(n_ctx, len(whole)))


def test_lm_eval_tasks_against_the_server(real, monkeypatch):
    from redraft.cli import build_parser

    monkeypatch.chdir(ROOT)  # the task YAMLs name their data files relative to the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with live_server(build_parser().parse_args(["serve", "--port", "0", "--enable-tokenizer-info-endpoint"]),
                     real) as srv:
        first = evaluate(srv, "redraft_capitals", limit=GENERATE_LIMIT)
        corpus = srv.server.generator.corpora.get("default")
        stored = corpus.n_tokens
        second = evaluate(srv, "redraft_capitals", limit=GENERATE_LIMIT)
        mc = evaluate(srv, "redraft_capitals_mc")

    def answers(res):
        return [s["resps"] for s in res["samples"]["redraft_capitals"]]

    assert len(answers(first)) == GENERATE_LIMIT and answers(first) == answers(second)
    assert sum(bool(r[0][0].strip()) for r in answers(first)) >= GENERATE_LIMIT - 1  # real answers, few-shot
    assert stored > 0
    assert first["results"]["redraft_capitals"]["exact_match,city"] == \
        second["results"]["redraft_capitals"]["exact_match,city"]

    samples = mc["samples"]["redraft_capitals_mc"]
    assert len(samples) == 6 and "acc,none" in mc["results"]["redraft_capitals_mc"]
    for s in samples:
        args = s["arguments"]  # (context, continuation) per choice; a dict of them in the saved samples files
        pairs = [(a["arg_0"], a["arg_1"]) for a in args.values()] if isinstance(args, dict) else [tuple(a) for a in args]
        assert [c for _, c in pairs] == [" " + c for c in s["doc"]["choices"]]
        for (context, continuation), resp in zip(pairs, s["resps"], strict=True):
            got = float(resp[0][0])
            assert abs(got - loglikelihood(real, context, continuation)) < 1e-3, (context, continuation)


def samples(res, task: str = "redraft_capitals") -> list[tuple]:
    """(doc id, the prompt lm-eval sent, its answers) of each sample, in document order."""
    return sorted((s["doc_id"], str(s["arguments"]), s["resps"]) for s in res["samples"][task])


def test_chat_template_batches_and_concurrency_against_default_routes(real, monkeypatch):
    """The documented commands with ``--apply_chat_template``: ``local-completions`` given the model directory as
    ``tokenizer`` (lm-eval's default backend choice: it picks ``remote`` only when ``/tokenizer_info`` answers, which
    it does not by default) one at a time, with ``--batch_size 4`` and with ``num_concurrent=4``, and
    ``local-chat-completions`` with ``num_concurrent=4``: every run finishes, with the one-at-a-time run's samples.
    No answer cache, so each run decodes (the corpus drafts the repeats)."""
    from redraft.cli import build_parser
    from redraft.io.loading import resolve_model_dir

    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    local = f"tokenizer={resolve_model_dir(None, quiet=True)[1]}"
    with live_server(build_parser().parse_args(["serve", "--port", "0", "--no-answer-cache"]), real) as srv:
        one = evaluate(srv, "redraft_capitals", GENERATE_LIMIT, backend=local, batch_size=1, chat=True)
        batched = evaluate(srv, "redraft_capitals", GENERATE_LIMIT, backend=local, batch_size=4, chat=True)
        concurrent = evaluate(srv, "redraft_capitals", GENERATE_LIMIT, backend=local, batch_size=1, num_concurrent=4,
                              chat=True)
        chat = evaluate(srv, "redraft_capitals", GENERATE_LIMIT, model="local-chat-completions",
                        backend="tokenizer_backend=none", batch_size=1, num_concurrent=4, chat=True)

    assert len(samples(one)) == GENERATE_LIMIT and "<|im_start|>" in samples(one)[0][1]  # templated prompts
    assert samples(batched) == samples(one) and samples(concurrent) == samples(one)
    answers = [r for _, _, r in samples(one)]
    assert sum(bool(r[0][0].strip()) for r in answers) >= GENERATE_LIMIT - 1
    assert [r for _, _, r in samples(chat)] == answers  # the server's chat template = lm-eval's rendering of it
