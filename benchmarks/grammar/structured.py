"""A JSON-schema workload: constrained decoding plain, with n-gram drafts, and with grammar + n-gram drafts.

Run (the default model; figures in docs/serving.md come from this command)::

    python benchmarks/grammar/structured.py --max-new-tokens 96 --rounds 2

Each prompt asks the model for a JSON record; every method decodes it under the same JSON schema
(:class:`redraft.grammar.Constraint`), greedily, side by side (the methods alternate per prompt and round, so
machine noise hits them alike). Reported per method: tokens per forward, wall-clock tokens/s, speed relative to
plain constrained decoding, the grammar source's acceptance, and whether the ids equal plain decoding's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "occupation", "hobbies", "employed"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "occupation": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                         "employed": {"type": "boolean"}}}
PEOPLE = ["Alice", "Bob", "Carmen", "Dmitri", "Elena", "Farid"]


def prompts(tokenizer) -> list[list[int]]:
    """The workload's chat prompts as ids (one per person)."""
    from redraft.io.prompts import encode_prompt

    return [encode_prompt(tokenizer, f"Describe a fictional person named {p} as a JSON object with the fields name, "
                                     "age, city, occupation, hobbies and employed.") for p in PEOPLE]


def run(max_new_tokens: int = 96, rounds: int = 2, log=print) -> dict:
    """Decode the workload with each method; returns {method: figures} (see the module doc)."""
    from redraft.compose import SpeculationConfig, drafters_for, engine_with
    from redraft.compose.build import grammar_drafters
    from redraft.decoding.sampling import SamplingParams
    from redraft.grammar import Constraint, grammar_tokenizer
    from redraft.io.loading import load_model

    loaded = load_model()
    tok = loaded.tokenizer
    constraint = Constraint.json_schema(SCHEMA, grammar_tokenizer(tok, loaded.vocab_size, loaded.eos_token_ids),
                                        loaded.vocab_size, "person")
    sampling = SamplingParams(constraint=constraint)
    fixed = SpeculationConfig(policy=False)  # fixed depths: the drafts themselves are compared, not the policy
    methods = {"plain": lambda: [], "ngram": lambda: drafters_for(fixed),
               "grammar+ngram": lambda: grammar_drafters(fixed, constraint) + drafters_for(fixed)}
    totals = {m: {"tokens": 0, "forwards": 0, "seconds": 0.0, "proposed": 0, "accepted": 0, "identical": 0,
                  "runs": 0} for m in methods}
    valid = answers = 0
    for r in range(rounds):
        for i, ids in enumerate(prompts(tok)):
            order = list(methods) if (r + i) % 2 == 0 else list(reversed(methods))
            outputs = {}
            for m in order:
                engine = engine_with(loaded.model, methods[m](), fixed, eos_token_ids=loaded.eos_token_ids)
                t0 = time.perf_counter()
                res = engine.generate(ids, max_new_tokens, sampling=sampling)
                t = totals[m]
                t["seconds"] += time.perf_counter() - t0
                t["tokens"] += len(res.output_ids)
                t["forwards"] += res.forwards
                t["runs"] += 1
                outputs[m] = res.output_ids
                if "grammar" in res.sources:
                    t["proposed"] += res.sources["grammar"].proposed
                    t["accepted"] += res.sources["grammar"].accepted
            for m in methods:
                totals[m]["identical"] += outputs[m] == outputs["plain"]
            text = tok.decode(outputs["plain"], skip_special_tokens=True)
            answers += 1
            try:
                json.loads(text)
                valid += 1
            except ValueError:
                pass
            if r == 0 and i == 0:
                log(f"example answer: {text}")
        log(f"round {r + 1}/{rounds} done")
    out: dict = {}
    plain_tps = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    for m, t in totals.items():
        out[m] = {"tokens_per_forward": round(t["tokens"] / t["forwards"], 3),
                  "tokens_per_second": round(t["tokens"] / t["seconds"], 2),
                  "speed_vs_plain": round((t["tokens"] / t["seconds"]) / plain_tps, 3), "tokens": t["tokens"],
                  "forwards": t["forwards"], "identical_to_plain": f"{t['identical']}/{t['runs']}",
                  "grammar_acceptance": round(t["accepted"] / t["proposed"], 3) if t["proposed"] else None}
    out["plain_answers_that_parse"] = f"{valid}/{answers}"
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/grammar/structured.py", description=__doc__.split("\n")[0])
    p.add_argument("--max-new-tokens", type=int, default=96, help="token cap per answer (default 96)")
    p.add_argument("--rounds", type=int, default=2, help="passes over the 6 prompts (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    figures = run(args.max_new_tokens, args.rounds, log=lambda s: print(s, file=sys.stderr))
    print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
