"""The ``agent`` phase of ``redraft bench serve``: agent-shaped traffic, where each request resends the conversation.

An agent loop (smolagents' CodeAgent, a ReAct loop, a coding assistant) sends a long fixed system prompt and a task,
gets a step back, appends it and an observation from its tools, and sends the whole conversation again. Each
request is therefore the previous request + its answer + an observation. Re-prefilling that conversation dominates
the cost of every step; prefix KV reuse (``redraft serve --prefix-cache-tokens``) prefills only the new tail, and
the learned corpus replays the answers of a repeated run, and the answer cache (``redraft serve``'s default, off
with ``--no-answer-cache``) answers an identical greedy request again without a forward.

Runs (every request greedy, the same conversations each time, each server fresh):

1. ``no_reuse``: prefix reuse and the answer cache off: the conversations once (first run without reuse), then
   again (its replay, drafted from the learned corpus);
2. ``reuse``: prefix reuse on, the answer cache off: the same two runs (the replay drafted on cached prefixes);
3. ``answer_cache``: both on (the server's defaults): the same two runs (the replay from the answer cache).

Reported: each run's seconds (client side, all requests), first run without / with reuse, each replay's
second run / first run, prefix-hit tokens, tokens per forward, answer-cache hits, and how many answers are identical
to the first run's without reuse (all must be: reuse, drafts and the answer cache change speed only); when the
server's CPU seconds can be read, each run's CPU seconds and the same ratios of them (less sensitive than wall-clock
time to a loaded machine).

This module imports no server code: the caller hands it a function that starts a server (see
:func:`run_agent_phase`), so it can sit below ``serve_bench``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from redraft.io.questions import load_questions

# A fixed agent system prompt (tools and rules), about 600 tokens with the default model's tokenizer: the part of
# every request that an agent framework sends again and again.
SYSTEM_PROMPT = """You are an expert assistant who solves any task by writing and running short Python programs.
You work in steps. At each step you write a short thought explaining what you will do next and why, then one
code block that does exactly that. The code runs in a sandbox and its printed output comes back to you as an
observation in the next message. Use the observation to decide the next step. When you know the answer, call
final_answer(answer) in a code block; that ends the task.

You have these tools, available as Python functions:
- web_search(query: str) -> str: searches the web and returns the titles, addresses and short excerpts of the
  ten best results. Use it for facts you do not know or that may have changed recently.
- visit_webpage(url: str) -> str: returns the text of a web page as markdown. Long pages are cut after 10,000
  characters; search within the page for the part you need.
- python_interpreter(code: str) -> str: runs Python code and returns what it printed. The standard library,
  numpy, pandas and sympy are installed; no network access from inside the code.
- read_file(path: str) -> str: returns the content of a file in the working directory.
- write_file(path: str, content: str) -> str: writes a file in the working directory and returns its size.
- final_answer(answer: str) -> None: gives the final answer to the task and stops.

Rules you must always follow:
1. Always write a thought, then exactly one code block, ending with '<end_code>'.
2. Use only variables that you have defined. Do not pass tool results you have not printed to other tools
   without checking them first.
3. Call a tool only with the arguments it takes, as keywords: web_search(query="..."), never web_search({...}).
4. Do not chain too many tool calls in one code block when their output format is unpredictable: print the
   result of one call and use it in the next step.
5. Call a tool only when needed, and never repeat a call with exactly the same arguments.
6. Do not name a new variable with the same name as a tool: for instance do not name a variable final_answer.
7. Never create notional variables that you will not use.
8. You may import modules only from this list: collections, datetime, itertools, math, queue, random, re,
   statistics, time, unicodedata, numpy, pandas, sympy.
9. The state persists between code executions: variables and imports from one step stay defined in the next.
10. Do not give up. You are in charge of solving the task, not of giving directions to solve it.

Here is an example of a step:
Thought: I need the population of the two cities to compare them. I will search for each one and print the
results before deciding.
Code:
```py
for city in ["Guangzhou", "Shanghai"]:
    print(f"Population {city}:", web_search(query=f"{city} population"))
```<end_code>

Now begin. Solve the task step by step; keep each step short."""

OBSERVATION = ("Observation:\nExecution logs:\nThe code ran without errors. Printed output:\n"
               "result = 42; elapsed = 0.8 s; no warnings.\n"
               "Continue with the next step, or call final_answer(...) if you have the answer.")


@dataclass
class AgentBenchConfig:
    """``conversations`` agent tasks of ``turns`` requests each, ``max_tokens`` per answer, after the ``system``
    prompt (default: :data:`SYSTEM_PROMPT`) and with ``observation`` after each answer."""

    conversations: int = 2
    turns: int = 5
    max_tokens: int = 48
    system: str = SYSTEM_PROMPT
    observation: str = OBSERVATION


def agent_tasks(n: int) -> list[str]:
    """``n`` tasks: first turns of Spec-Bench questions, one category after another (file order)."""
    from redraft.bench.workloads import round_robin

    qs = load_questions()
    cats = list(dict.fromkeys(q["category"] for q in qs))
    return [q["turns"][0] for q in round_robin(qs, cats, n)]


def run_conversations(client, base: str, tasks: list[str], cfg: AgentBenchConfig,
                      timeout: float = 1800.0) -> dict:
    """Each task as an agent loop of ``cfg.turns`` requests; returns seconds, answers and per-request statistics.

    Raises:
        RuntimeError: a request that did not return HTTP 200.
    """
    answers, stats, seconds = [], [], 0.0
    for task in tasks:
        messages = [{"role": "system", "content": cfg.system}, {"role": "user", "content": f"Task: {task}"}]
        for _ in range(cfg.turns):
            t0 = time.perf_counter()
            r = client.post(f"{base}/v1/chat/completions", timeout=timeout, json={
                "messages": messages, "max_tokens": cfg.max_tokens, "temperature": 0})
            seconds += time.perf_counter() - t0
            if r.status_code != 200:
                raise RuntimeError(f"agent: HTTP {r.status_code}: {r.text[:300]}")
            body = r.json()
            text = body["choices"][0]["message"]["content"]
            answers.append(text)
            stats.append({"prompt_tokens": body["usage"]["prompt_tokens"],
                          "completion_tokens": body["usage"]["completion_tokens"],
                          "forwards": body["redraft"]["forwards"],
                          "prefix_hit_tokens": body["redraft"].get("prefix_hit_tokens", 0),
                          "answer_cache_hit": bool(body["redraft"].get("answer_cache_hit", False))})
            messages = messages + [{"role": "assistant", "content": text},
                                   {"role": "user", "content": cfg.observation}]
    tokens = sum(s["completion_tokens"] for s in stats)
    return {"seconds": seconds, "answers": answers, "requests": len(stats),
            "prompt_tokens": sum(s["prompt_tokens"] for s in stats), "completion_tokens": tokens,
            "prefix_hit_tokens": sum(s["prefix_hit_tokens"] for s in stats),
            "answer_cache_hits": sum(s["answer_cache_hit"] for s in stats),
            "forwards": sum(s["forwards"] for s in stats),
            "tokens_per_forward": tokens / forwards if (forwards := sum(s["forwards"] for s in stats)) else None}


SERVERS = (("no_reuse", False, False), ("reuse", True, False), ("answer_cache", True, True))  # name, prefix, answers


def run_agent_phase(start_server: Callable[[str, bool, bool], tuple], cfg: AgentBenchConfig,
                    timeout: float = 1800.0) -> dict:
    """The phase's six runs (see the module doc) and their figures.

    Args:
        start_server: ``start_server(name, prefix_reuse, answer_cache)`` starts a fresh server and returns (base URL,
            stop), or (base URL, stop, cpu_seconds) where ``cpu_seconds()`` gives the server process's CPU seconds
            so far (user + system, all threads).
    Returns:
        figures: seconds of each run (``{first,second}_{no_reuse,reuse,answer_cache}_seconds``),
        ``first_speedup_with_reuse`` (first run without reuse / with reuse), ``replay_speedup_with_reuse``,
        ``replay_speedup_without_reuse`` and ``replay_speedup_with_answer_cache`` (first run / second run on the same
        server), prefix-hit tokens, forwards, tokens per forward, answer-cache hits, ``identical`` (answers equal
        to the first run's without reuse, over the five other runs) of ``answers`` (their number). With
        ``cpu_seconds``, also each run's server CPU seconds (``*_cpu_seconds``) and the same ratios of them
        (``*_cpu``): on a loaded machine wall-clock seconds mostly measure waiting for a core, CPU seconds much less.
    """
    import httpx

    tasks = agent_tasks(cfg.conversations)
    runs: dict[str, dict] = {}
    for name, reuse, answers in SERVERS:
        base, stop, *cpu = start_server(f"agent-{name}", reuse, answers)
        cpu_seconds = cpu[0] if cpu else None
        try:
            with httpx.Client() as c:
                for run in ("first", "second"):
                    before = cpu_seconds() if cpu_seconds else 0.0
                    runs[f"{run}_{name}"] = run_conversations(c, base, tasks, cfg, timeout)
                    if cpu_seconds:
                        runs[f"{run}_{name}"]["cpu_seconds"] = cpu_seconds() - before
        finally:
            stop()
    ref = runs["first_no_reuse"]["answers"]
    others = [runs[k]["answers"] for k in runs if k != "first_no_reuse"]
    out = {"conversations": cfg.conversations, "turns": cfg.turns, "max_tokens": cfg.max_tokens,
           "requests": runs["first_reuse"]["requests"],
           "mean_prompt_tokens": runs["first_reuse"]["prompt_tokens"] / max(1, runs["first_reuse"]["requests"])}
    for k, r in runs.items():
        out[f"{k}_seconds"] = r["seconds"]
    for k, r in runs.items():
        out[f"{k}_tokens_per_forward"] = r["tokens_per_forward"]
        out[f"{k}_prefix_hit_tokens"] = r["prefix_hit_tokens"]
        out[f"{k}_forwards"] = r["forwards"]
        out[f"{k}_answer_cache_hits"] = r["answer_cache_hits"]
    out["first_speedup_with_reuse"] = _ratio(runs["first_no_reuse"]["seconds"], runs["first_reuse"]["seconds"])
    out["replay_speedup_with_reuse"] = _ratio(runs["first_reuse"]["seconds"], runs["second_reuse"]["seconds"])
    out["replay_speedup_without_reuse"] = _ratio(runs["first_no_reuse"]["seconds"],
                                                 runs["second_no_reuse"]["seconds"])
    out["replay_speedup_with_answer_cache"] = _ratio(runs["first_answer_cache"]["seconds"],
                                                     runs["second_answer_cache"]["seconds"])
    if all("cpu_seconds" in r for r in runs.values()):
        for k, r in runs.items():
            out[f"{k}_cpu_seconds"] = r["cpu_seconds"]
        cpu = {k: r["cpu_seconds"] for k, r in runs.items()}
        out["first_speedup_with_reuse_cpu"] = _ratio(cpu["first_no_reuse"], cpu["first_reuse"])
        out["replay_speedup_with_reuse_cpu"] = _ratio(cpu["first_reuse"], cpu["second_reuse"])
        out["replay_speedup_without_reuse_cpu"] = _ratio(cpu["first_no_reuse"], cpu["second_no_reuse"])
        out["replay_speedup_with_answer_cache_cpu"] = _ratio(cpu["first_answer_cache"], cpu["second_answer_cache"])
    out["identical"] = sum(a == b for answers in others for a, b in zip(ref, answers, strict=True))
    out["answers"] = len(ref) * len(others)
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0
