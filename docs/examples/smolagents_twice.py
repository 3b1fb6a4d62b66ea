"""smolagents' CodeAgent against ``redraft serve``, the same task run twice: seconds per run and identical steps.

Start a server first (a fresh one: its corpus and prefix cache empty), then run this script::

    redraft --threads 1 serve --port 8000 &                               # prefix reuse on (the default)
    python docs/examples/smolagents_twice.py --url http://127.0.0.1:8000/v1

Each agent step resends the whole conversation (the CodeAgent system prompt is ~2,000 tokens); the server
prefills only what its tenant's cached prefix does not cover, and the second run replays the first run's answers
from the corpus it learned. Needs ``pip install 'smolagents[openai]'``. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

TASK = "What is the 12th Fibonacci number? Compute it with a short Python loop."


def run_once(url: str, model_id: str, task: str, max_steps: int, max_tokens: int) -> dict:
    """One CodeAgent run: seconds, the model output of each step, and the final answer (or the error)."""
    from smolagents import CodeAgent, OpenAIServerModel

    model = OpenAIServerModel(model_id=model_id, api_base=url, api_key="none", max_tokens=max_tokens,
                              temperature=0)
    agent = CodeAgent(tools=[], model=model, max_steps=max_steps, verbosity_level=0)
    t0 = time.perf_counter()
    try:
        answer = str(agent.run(task))
    except Exception as e:  # noqa: BLE001 - a weak model's agent may fail; the figures still count
        answer = f"error: {type(e).__name__}: {e}"
    seconds = time.perf_counter() - t0
    outputs = [getattr(s, "model_output", None) for s in agent.memory.steps if hasattr(s, "model_output")]
    return {"seconds": seconds, "steps": len(outputs), "outputs": outputs, "answer": answer}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 address")
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="the served model id")
    ap.add_argument("--task", default=TASK, help="the agent's task")
    ap.add_argument("--max-steps", type=int, default=3, help="agent steps per run (default 3)")
    ap.add_argument("--max-tokens", type=int, default=64, help="max_tokens per step (default 64)")
    args = ap.parse_args()
    first = run_once(args.url, args.model, args.task, args.max_steps, args.max_tokens)
    second = run_once(args.url, args.model, args.task, args.max_steps, args.max_tokens)
    print(json.dumps({"first_seconds": round(first["seconds"], 2), "second_seconds": round(second["seconds"], 2),
                      "second_over_first": round(first["seconds"] / second["seconds"], 2),
                      "steps": [first["steps"], second["steps"]],
                      "identical_steps": first["outputs"] == second["outputs"],
                      "identical_answer": first["answer"] == second["answer"], "answer": first["answer"]}))


if __name__ == "__main__":
    main()
