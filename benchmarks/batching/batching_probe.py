"""Continuous batching on the real model, in one process: concurrent sequences through a StepBatcher against the
same sequences one at a time (ids, aggregate tokens/s), the cost of a packed decode step against one sequence's
step alone, and how far packed rows are from plain decoding's (docs/architecture.md, "Continuous batching").

    python benchmarks/batching/batching_probe.py concurrent --sequences 4 --max-tokens 64
    python benchmarks/batching/batching_probe.py step --sequences 1 4 16 --tokens 500
    python benchmarks/batching/batching_probe.py noise --sequences 4 --max-tokens 32

Figures are ratios measured side by side in one run (the machine is noisy).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def _questions(n: int, tokenizer) -> list[list[int]]:
    """The first turn of ``n`` Spec-Bench questions spread over the file (different categories), chat-templated."""
    from redraft.io.prompts import encode_prompt
    from redraft.io.questions import load_questions

    qs = load_questions()
    step = max(1, len(qs) // n)
    return [encode_prompt(tokenizer, qs[i * step]["turns"][0]) for i in range(n)]


def _one_at_a_time(make_engine, prompts, max_tokens) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    ids = [make_engine().generate(p, max_tokens).output_ids for p in prompts]
    return ids, time.perf_counter() - t0


def _batched(batcher, make_engine, prompts, max_tokens) -> tuple[list[list[int]], float, dict]:
    """The prompts decoded at once, one step loop over them all (:func:`redraft.runtimes.transformers.batching.run_together`):
    (ids, wall seconds, the batcher's steps, rows and forward seconds during the run, and the prompts' rows)."""
    from redraft.runtimes.transformers.batching import run_together

    before = (batcher.steps, batcher.rows, batcher.forward_seconds)
    t0 = time.perf_counter()
    seqs = run_together(batcher, [make_engine(batcher.new_target()).steps(p, max_tokens) for p in prompts])
    for s in seqs:
        if s.error is not None:
            raise s.error
    out = [s.result.output_ids for s in seqs]
    wall = time.perf_counter() - t0
    steps, rows, fwd = (now - then for now, then in zip((batcher.steps, batcher.rows, batcher.forward_seconds), before,
                                                           strict=True))
    # this run's steps, the last ones logged (the logs keep 4,096); a step with a participant of min_chunk rows or
    # more carried a prompt's chunk (or a verify tree that large, rare on novel text)
    last = min(steps, len(batcher.step_log))
    log, times = list(batcher.step_log)[-last:] if last else [], list(batcher.step_seconds)[-last:] if last else []
    chunked = [i for i, step in enumerate(log) if max(r for _, r in step) >= batcher.min_chunk]
    decode = sorted(set(range(len(log))) - set(chunked))
    return out, wall, {"steps": steps, "rows": rows, "prompt_rows": sum(map(len, prompts)),
                       "forward_share_of_wall": round(fwd / wall, 3) if wall else None,
                       "steps_carrying_a_chunk": {"steps": len(chunked), "seconds": round(sum(times[i] for i in chunked), 2),
                                                  "rows": sum(r for i in chunked for _, r in log[i])},
                       "decode_steps": {"steps": len(decode), "seconds": round(sum(times[i] for i in decode), 2),
                                        "rows": sum(r for i in decode for _, r in log[i])}}


def concurrent(n: int, max_tokens: int) -> dict:
    """Plain decoding and the default speculation (n-gram drafts under the policy, exact mode), each one request at
    a time and ``n`` at once through a StepBatcher; ids compared with plain decoding one at a time."""
    from redraft.compose import SpeculationConfig, build_engine, build_policy, plain_engine
    from redraft.compose.build import batched_policy
    from redraft.io.loading import load_model
    from redraft.runtimes.transformers.batching import StepBatcher

    loaded = load_model(None, quiet=True)
    model, eos = loaded.model, sorted(loaded.eos_token_ids)
    prompts = _questions(n, loaded.tokenizer)
    config = SpeculationConfig()
    tenant = build_policy(model, max_nodes=config.policy_nodes)
    batcher = StepBatcher(model)
    runs = {}
    runs["plain, one at a time"] = _one_at_a_time(lambda: plain_engine(model, eos_token_ids=eos), prompts,
                                                  max_tokens)
    runs["plain, batched"] = _batched(batcher, lambda t: plain_engine(t, eos_token_ids=eos), prompts, max_tokens)
    runs["speculative, one at a time"] = _one_at_a_time(
        lambda: build_engine(model, config, eos_token_ids=eos, policy=tenant), prompts, max_tokens)
    runs["speculative, batched"] = _batched(
        batcher, lambda t: build_engine(t, config, eos_token_ids=eos, policy=batched_policy(tenant)), prompts,
        max_tokens)
    ref = runs["plain, one at a time"][0]
    base = sum(map(len, ref)) / runs["plain, one at a time"][1]
    out = {"sequences": n, "max_tokens": max_tokens}
    for name, (ids, secs, *steps) in runs.items():
        tps = sum(map(len, ids)) / secs
        out[name] = {"seconds": round(secs, 3), "tokens_per_s": round(tps, 2), "vs_plain_one_at_a_time":
                     round(tps / base, 2), "identical": sum(a == b for a, b in zip(ids, ref, strict=True)),
                     **(steps[0] if steps else {})}
    return out


def step_cost(sequences: list[int], tokens: int, repeats: int = 5) -> dict:
    """Per S in ``sequences``: S sequences holding ``tokens`` cached tokens each, one decode row each; median time
    of the packed step, of one sequence's step alone, and the throughput gain S x alone / step."""
    import torch

    from redraft.io.loading import load_model
    from redraft.runtimes.transformers.packing import Block, causal_positions, enable_packed_attention, packed_forward
    from redraft.runtimes.transformers.target import HFTarget

    model = load_model(None, quiet=True).model
    enable_packed_attention(model)
    gen = torch.Generator().manual_seed(0)
    out = {"tokens": tokens, "threads": torch.get_num_threads()}
    for s in sequences:
        targets = []
        for _ in range(s):
            t = HFTarget(model)
            t.reset()
            t.forward(torch.randint(100, 40000, (tokens,), generator=gen).tolist())
            targets.append(t)
        steps, solos = [], []
        for _ in range(repeats):
            blocks = [Block(t.length, causal_positions(t.length, 1)) for t in targets]
            t0 = time.perf_counter()
            packed_forward(model, [t.cache for t in targets], blocks, [[42]] * s, [range(1)] * s,
                           cache_kwarg=targets[0].cache_kwarg)
            steps.append(time.perf_counter() - t0)
            for t in targets:
                t.length += 1
                t.crop(tokens)  # the appended row goes again: every repeat sees the same cache
            t = targets[0]  # plain decoding's step for one of them, alone
            t0 = time.perf_counter()
            t.forward([42])
            solos.append(time.perf_counter() - t0)
            t.crop(tokens)
        st, so = statistics.median(steps), statistics.median(solos)
        out[str(s)] = {"step_ms": round(1e3 * st, 1), "one_sequence_alone_ms": round(1e3 * so, 1),
                       "tokens_per_second_gain_x": round(s * so / st, 2),
                       "kv_mb": round(sum(2 * layer.keys.numel() * layer.keys.element_size()
                                          for t in targets for layer in t.cache.layers) / 2**20, 1)}
    return out


def row_noise(n: int, max_tokens: int) -> dict:
    """How far packed rows are from plain decoding's rows: ``n`` questions decoded plain (prompt in one forward, then
    one token per forward), and the same tokens fed packed (prompts in one packed forward, then one row per
    sequence per step, every cache written by packed forwards). Returns the largest |packed - plain| over the rows,
    relative to the plain row's largest |logit| (exact mode's bound for verify rows: ``EXACT_ROW_NOISE``), and the
    largest change of the gap between plain decoding's choice and its 8 closest rivals (what exact mode bounds on
    float32 rows: ``EXACT_GAP_NOISE``, see :func:`redraft.decoding.exactness.measure_gap_noise`) for the packed rows
    and for draft-free rows computed alone on the caches packed forwards wrote (exact mode's recomputes)."""
    import torch

    from redraft.defaults import EXACT_GAP_NOISE, EXACT_ROW_NOISE
    from redraft.io.loading import load_model
    from redraft.runtimes.transformers.packing import Block, causal_positions, enable_packed_attention, packed_forward
    from redraft.runtimes.transformers.target import HFTarget

    loaded = load_model(None, quiet=True)
    model = loaded.model
    enable_packed_attention(model)
    prompts = _questions(n, loaded.tokenizer)
    plain_rows, tokens = [], []
    for p in prompts:
        t = HFTarget(model)
        t.reset()
        rows, ids, nxt = [], [], p
        for _ in range(max_tokens):
            row = t.forward(nxt)[0].float()
            rows.append(row)
            ids.append(int(row.argmax()))
            nxt = [ids[-1]]
        plain_rows.append(torch.stack(rows))
        tokens.append(ids)
    targets = [HFTarget(model) for _ in prompts]
    for t in targets:
        t.reset()
    worst = gap_packed = gap_alone = 0.0

    def gap_change(row, plain) -> float:
        top = plain.topk(9).indices
        return float(((row[top[0]] - row[top[1:]]) - (plain[top[0]] - plain[top[1:]])).abs().max() / plain.abs().max())

    feeds = [list(p) for p in prompts]
    for step in range(max_tokens):
        blocks = [Block(t.length, causal_positions(t.length, len(f))) for t, f in zip(targets, feeds, strict=True)]
        got = packed_forward(model, [t.cache for t in targets], blocks, feeds, [range(len(f) - 1, len(f)) for f in feeds],
                             cache_kwarg=targets[0].cache_kwarg)
        for i, (t, f) in enumerate(zip(targets, feeds, strict=True)):
            t.length += len(f)
            plain = plain_rows[i][step]
            worst = max(worst, float((got[i][0].float() - plain).abs().max() / plain.abs().max()))
            gap_packed = max(gap_packed, gap_change(got[i][0].float(), plain))
        feeds = [[ids[step]] for ids in tokens]
    for t, p, ids, rows in zip(targets, prompts, tokens, plain_rows, strict=True):  # recomputes on packed caches
        for j in reversed(range(max_tokens - 1)):
            t.crop(len(p) + j)
            gap_alone = max(gap_alone, gap_change(t.forward([ids[j]])[0].float(), rows[j + 1]))
    return {"sequences": n, "rows_each": max_tokens, "max_relative_difference": worst,
            "exact_mode_bound_float32": EXACT_ROW_NOISE["float32"], "max_gap_change_packed": gap_packed,
            "max_gap_change_alone_on_packed_cache": gap_alone,
            "exact_mode_gap_bound_float32": EXACT_GAP_NOISE["float32"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/batching/batching_probe.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    c = sub.add_parser("concurrent", help="N questions at once through a StepBatcher vs one at a time")
    c.add_argument("--sequences", type=int, default=4)
    c.add_argument("--max-tokens", type=int, default=64)
    k = sub.add_parser("step", help="a packed decode step over S sequences against one sequence's step alone")
    k.add_argument("--sequences", type=int, nargs="+", default=[4, 16])
    k.add_argument("--tokens", type=int, default=500)
    k.add_argument("--repeats", type=int, default=5)
    r = sub.add_parser("noise", help="packed rows against plain decoding's rows")
    r.add_argument("--sequences", type=int, default=4)
    r.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    if args.what == "concurrent":
        res = concurrent(args.sequences, args.max_tokens)
    elif args.what == "noise":
        res = row_noise(args.sequences, args.max_tokens)
    else:
        res = step_cost(args.sequences, args.tokens, args.repeats)
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
