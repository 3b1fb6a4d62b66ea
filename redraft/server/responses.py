"""Response bodies of the generation routes: choices (with log-probabilities and echo), usage, ``redraft`` stats.

``usage`` counts each prompt once (however many choices it has) and every choice's completion tokens.
``system_fingerprint`` names what decides the output besides the request: redraft's version, the model id, its
dtype and size, the transformers and torch versions, and another runtime's name and numerics (llama.cpp's). OpenAI:
"can be used in conjunction with the seed request parameter to understand when backend changes have been made that
might impact determinism".
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from .generation import Outcome
from .logprobs import chat_logprobs, completion_logprobs
from .scheduler import Job
from .schemas import ParsedRequest


def fingerprint(model_id: str, generator) -> str:
    """``fp_`` + 12 hex digits of a hash of what decides outputs (see the module doc)."""
    import torch
    import transformers

    from redraft import __version__

    target = generator.facts
    key = f"{__version__}|{model_id}|{target.dtype}|{target.vocab_size}|{target.max_length}|" \
          f"{transformers.__version__}|{torch.__version__}"
    if target.runtime != "transformers":  # another runtime's output differs: its own fingerprint (llama.cpp's build)
        key += f"|{target.runtime}|{target.numerics}"
    return "fp_" + hashlib.sha256(key.encode()).hexdigest()[:12]


def prompt_text(tokenizer, req: ParsedRequest, index: int, ids: list[int]) -> str:
    """Choice ``index``'s prompt as echoed: a text prompt exactly as sent, token ids decoded (special tokens kept)."""
    prompt = req.prompts[index // req.n] if req.prompts else req.prompt
    return prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=False)


def cached_tokens(out: Outcome) -> int:
    """The prompt tokens served from a cache: all of them for an answer-cache hit (no forward read the prompt),
    else those whose KV entries came from the prefix cache."""
    return len(out.result.prompt_ids) if out.answer_cache_hit else out.result.prefix_hit_tokens


def usage(req: ParsedRequest, jobs: list[Job], outcomes: list[Outcome]) -> dict:
    """OpenAI's usage object, summed over prompts (each counted once) and choices; ``prompt_tokens_details``
    gives ``cached_tokens`` (:func:`cached_tokens`, as OpenAI and vLLM report prompt caching)."""
    p = sum(len(o.result.prompt_ids) for o in outcomes[::req.n])
    c = sum(len(o.result.output_ids) for o in outcomes)
    cached = sum(cached_tokens(o) for o in outcomes[::req.n])
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": cached}}


def stats(job: Job, out: Outcome) -> dict[str, Any]:
    """The ``redraft`` extension field: one generation's speculation statistics and timings; ``answer_cache_hit``:
    the answer came from the answer cache (``forwards`` 0, and ``tokens_per_forward`` / ``tokens_per_second`` null:
    no forward ran to divide by)."""
    res = out.result
    ran = res.forwards > 0
    return {"tokens_per_forward": round(res.tokens_per_forward, 4) if ran else None, "forwards": res.forwards,
            "sources": {name: st.to_dict(digits=4) for name, st in res.sources.items()},
            "queue_seconds": round(job.queue_seconds, 4), "generation_seconds": round(res.seconds, 4),
            "tokens_per_second": round(res.tokens_per_second, 2) if ran else None, "learned": out.learned,
            "prefix_hit_tokens": res.prefix_hit_tokens, "prefix_disk_tokens": res.prefix_disk_tokens,
            "answer_cache_hit": out.answer_cache_hit,
            "seed": job.payload.sampling.seed}


def completion_body(req: ParsedRequest, rid: str, model: str, jobs: list[Job], outcomes: list[Outcome],
                    tokenizer) -> dict:
    """The whole (non-streamed) response. ``redraft`` holds the first choice's statistics, and with several
    choices also ``choices``: each one's."""
    choices = []
    for index, out in enumerate(outcomes):
        res = out.result
        if req.kind == "chat":
            lp = chat_logprobs(tokenizer, res.logprobs) if res.logprobs is not None else None
            message = {"role": "assistant", "content": out.content}
            if out.tool_calls:
                message["tool_calls"] = out.tool_calls
            choices.append({"index": index, "message": message, "logprobs": lp, "finish_reason": out.finish_reason})
            continue
        text, lp = out.text, None
        if req.echo:
            text = prompt_text(tokenizer, req, index, res.prompt_ids) + text
        if res.logprobs is not None:
            ids, entries = res.output_ids, list(res.logprobs)
            if req.echo:
                ids, entries = res.prompt_ids + ids, list(out.prompt_logprobs or [None] * len(res.prompt_ids)) + entries
            lp = completion_logprobs(tokenizer, ids, entries)
        choices.append({"index": index, "text": text, "logprobs": lp, "finish_reason": out.finish_reason})
    redraft = stats(jobs[0], outcomes[0])
    if len(jobs) > 1:
        redraft["choices"] = [stats(j, o) for j, o in zip(jobs, outcomes, strict=True)]
    return {"id": rid, "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": usage(req, jobs, outcomes),
            "redraft": redraft}

