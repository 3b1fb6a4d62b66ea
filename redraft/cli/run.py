"""``redraft run PROMPT``: stream the target model's reply to one prompt, with speculative decoding; ``redraft run
--prompts FILE``: answer many prompts in one process, one JSON line each on stdout.

The reply goes to stdout as it is generated; the end-of-run report (tokens/forward, acceptance per draft source,
speed, and with ``--tokens`` the id lines ``redraft freeze --from-log`` reads) goes to stderr. With ``--learn`` each
new answer joins the ``--corpus`` file (rewritten atomically in its format), so later prompts and later runs replay it.
With ``--prefix-dir DIR`` (a corpus directory, as ``redraft serve --corpus-dir``) each prompt starts from the longest
prefix whose KV entries this run, an earlier run or a server on that directory computed, and its own are kept there.
"""

from __future__ import annotations

import json
import os
import sys

from redraft.api import add_answer, stats_of
from redraft.cli.common import (
    add_draft_args,
    add_model_args,
    add_sampling_args,
    announce_generation_config,
    check_draft_args,
    check_model_or_exit,
    config_from_args,
    corpus_fits_model_or_exit,
    engine_from_args,
    load_model_or_exit,
    log_to_stderr,
    open_corpus_or_exit,
    prompt_fits_or_exit,
    prompt_text_or_exit,
    prompts_or_exit,
    resolve_draft_args,
    sampling_from_args,
)
from redraft.corpus import CorpusError
from redraft.decoding.runstats import RunSummary, run_report, speculation_line
from redraft.decoding.stopping import StopStrings
from redraft.decoding.textstream import TextStream
from redraft.defaults import PREFIX_CACHE_TOKENS, PREFIX_DISK_BYTES
from redraft.io.prompts import encode_prompt


def cmd_run(args) -> int:
    log_to_stderr("run")
    # everything that can be checked without the model is, before it loads (and before torch is imported)
    config = config_from_args(args)  # flags, then REDRAFT_*, then COLI_*, then the defaults (redraft.compose)
    corpus_path, k, minacc = resolve_draft_args(args, config)
    check_draft_args(args, corpus_path, k)
    if args.prompt is None and args.prompts is None:
        raise SystemExit("redraft run: error: give a PROMPT or --prompts FILE")
    if args.prompt is not None and args.prompts is not None:
        raise SystemExit("redraft run: error: give a PROMPT or --prompts FILE, not both")
    if args.learn and corpus_path is None:
        raise SystemExit("redraft run: error: --learn: only used with a corpus (--corpus FILE or REDRAFT_DRAFT_CORPUS)")
    if args.prompts is not None:
        prompts = prompts_or_exit(args.prompts, "run")
    else:
        prompts = [prompt_text_or_exit(sys.stdin.read() if args.prompt == "-" else args.prompt, "run")]
    check_model_or_exit(args.model)
    new_corpus = args.learn and not os.path.exists(corpus_path)  # created by the first answer learned
    # format and every token now; vocabulary and tokenizer once loaded
    corpus = None if new_corpus else open_corpus_or_exit(corpus_path)
    sampling = sampling_from_args(args)
    loaded = load_model_or_exit(args.model, dtype=args.dtype, runtime=args.runtime, n_ctx=args.n_ctx)
    announce_generation_config(loaded, args)
    corpus = corpus_fits_model_or_exit(corpus, loaded, force=args.force)
    if new_corpus:
        from redraft.corpus import Corpus, tokenizer_fingerprint

        corpus = Corpus.from_spans([], vocab_size=loaded.vocab_size, fingerprint=tokenizer_fingerprint(loaded.tokenizer))
    engine = engine_from_args(args, loaded, corpus, config=config)
    cache = _prefix_cache_or_exit(args.prefix_dir, loaded)
    chat = False if args.no_chat else None
    where = (lambda i: f"{args.prompts}: prompt {i}") if args.prompts is not None else (lambda i: "PROMPT")
    encoded = [prompt_fits_or_exit(encode_prompt(loaded.tokenizer, p, chat=chat), loaded, where(i), "run")
               for i, p in enumerate(prompts, 1)]  # every prompt checked before the first generation
    learn = corpus_path if args.learn else None
    if args.prompts is None:
        return _answer_streamed(args, loaded, engine, encoded[0], sampling, corpus, learn, cache)
    results = []
    for text, ids in zip(prompts, encoded, strict=True):
        stop = StopStrings(loaded.tokenizer, args.stop)
        res = _generate(engine, cache, ids, args.ngen, sampling=sampling, stop=stop if stop else None)
        out = stop.text if res.stop_reason == "stop" else loaded.tokenizer.decode(res.output_ids,
                                                                                  skip_special_tokens=True)
        learned = _learn(corpus, ids, res.output_ids, learn)
        print(json.dumps({"prompt": text, "text": out, "prompt_ids": ids, "ids": res.output_ids,
                          **stats_of(res), "learned": learned}), flush=True)
        results.append(res)
    print(speculation_line(RunSummary.of(results)) + f" over {len(results)} prompts", file=sys.stderr)
    if cache is not None:
        print(prefix_line(cache, results), file=sys.stderr)
    return 0


def _prefix_cache_or_exit(directory: str | None, loaded):
    """``--prefix-dir``'s prefix cache (memory, and the directory's entries on disk, written in this thread), or
    None without the flag. Exits naming the flag when the directory cannot be used or belongs to another
    tokenizer."""
    if directory is None:
        return None
    from redraft.corpus import tokenizer_fingerprint
    from redraft.corpus.directory import check_meta
    from redraft.server.prefix_cache import open_prefix_cache

    try:
        check_meta(directory, loaded.vocab_size, tokenizer_fingerprint(loaded.tokenizer))
    except CorpusError as e:
        raise SystemExit(f"redraft run: error: --prefix-dir {e}") from None
    return open_prefix_cache(loaded.model, PREFIX_CACHE_TOKENS, directory, disk_bytes=PREFIX_DISK_BYTES, background=False)


def _generate(engine, cache, ids: list[int], n: int, **kw):
    """``engine.generate`` from the cache's longest prefix of ``ids`` (the default tenant's, as an open server's)."""
    from redraft.server.prefix_cache import generate_cached
    from redraft.server.tenants import DEFAULT_TENANT

    return generate_cached(engine, cache, DEFAULT_TENANT, ids, n, **kw)


def prefix_line(cache, results) -> str:
    """The end-of-run line on prefix reuse: prompt tokens started from cached entries, and from disk."""
    hit = sum(r.prefix_hit_tokens for r in results)
    disk = sum(r.prefix_disk_tokens for r in results)
    prompt = sum(len(r.prompt_ids) for r in results)
    written = cache.disk.stats.writes if getattr(cache, "disk", None) is not None else 0
    return (f"prefix cache: {hit} of {prompt} prompt tokens reused ({disk} read from disk), {written} entries "
            "written")


def _learn(corpus, ids: list[int], output: list[int], path: str | None) -> bool:
    """With ``--learn`` (``path`` set): add the answer to the corpus and its file; one warning if the write fails."""
    if path is None or corpus is None:
        return False
    try:
        return add_answer(corpus, ids, output, path)
    except (OSError, CorpusError) as e:  # the answer is still right; only the learning failed
        print(f"redraft run: warning: answer not learned ({type(e).__name__}: {e})", file=sys.stderr)
        return False


def _answer_streamed(args, loaded, engine, ids: list[int], sampling, corpus, learn: str | None, cache) -> int:
    """One PROMPT: the reply streamed to stdout as it is generated, the report to stderr."""
    stop = StopStrings(loaded.tokenizer, args.stop)
    stream = TextStream(loaded.tokenizer, stop)

    def show(new: list[int]) -> None:
        delta = stream.feed(new)
        if delta:
            sys.stdout.write(delta)
            sys.stdout.flush()

    res = _generate(engine, cache, ids, args.ngen, on_tokens=show, sampling=sampling, stop=stop if stop else None,
                    streaming=True)
    sys.stdout.write(stream.finish() + "\n")
    sys.stdout.flush()
    _learn(corpus, ids, res.output_ids, learn)
    tokens = args.tokens or os.environ.get("TOKENS") == "1"
    lines = run_report(res, frozen_ids=corpus.n_tokens if corpus is not None else None, tokens=tokens)
    if res.stop_reason == "context":
        hint = "; --n-ctx sets llama.cpp's context" if loaded.runtime == "llama.cpp" else ""
        lines.insert(0, f"redraft run: the answer stopped at the end of the model's context ({len(ids)} prompt + "
                        f"{len(res.output_ids)} generated tokens; --ngen asked for {args.ngen}){hint}")
    if cache is not None:
        lines.append(prefix_line(cache, [res]))
    print("\n".join(lines), file=sys.stderr)
    return 0


def register(sub) -> None:
    """Add ``run`` to the top-level sub-parsers."""
    p = sub.add_parser("run", help="generate a reply to one prompt with speculative decoding",
                       description="Stream the model's reply to PROMPT on stdout (greedy by default, sampled with "
                                   "--temperature > 0); speculation statistics go to stderr. The logits settings of "
                                   "the model's generation_config.json (repetition_penalty, no_repeat_ngram_size, "
                                   "min_new_tokens, ...) apply as in HF generate; its sampling settings do not: "
                                   "decoding is greedy unless --temperature > 0.")
    add_model_args(p)
    add_draft_args(p)
    add_sampling_args(p)
    p.add_argument("--tokens", action="store_true",
                   help="print [PROMPT_TOKENS]/[TOKENS] id lines to stderr (also TOKENS=1); freeze --from-log reads them")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="answer every prompt of FILE (one per line, or JSONL objects with a 'prompt' string or a 'turns' "
                        "list, whose first turn is used) in one process: "
                        "one JSON line each on stdout (prompt, text, ids, statistics) instead of PROMPT")
    p.add_argument("--learn", action="store_true",
                   help="add each new answer (prompt + answer) to the --corpus file, rewritten atomically in its "
                        "format, so later prompts and later runs replay it; a missing file is created: text for a .txt "
                        "name, binary otherwise")
    p.add_argument("--prefix-dir", default=None, metavar="DIR",
                   help="a corpus directory (as redraft serve --corpus-dir, created if missing): each prompt starts "
                        "from the longest prefix whose KV cache an earlier prompt, an earlier run or a server on DIR "
                        "computed (entries of at least 128 tokens, kept on disk for this model, build and thread "
                        "count; least recently used removed beyond 4 GiB), instead of prefilling it")
    p.add_argument("prompt", metavar="PROMPT", nargs="?", default=None,
                   help="the user prompt ('-' reads stdin); or --prompts FILE")
    p.set_defaults(func=cmd_run)
