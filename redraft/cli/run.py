"""``redraft run PROMPT``: stream the target model's reply to one prompt, with speculative decoding.

The reply goes to stdout as it is generated; the end-of-run report (tokens/forward, acceptance per draft source,
speed, and with ``--tokens`` the id lines ``redraft freeze --from-log`` reads) goes to stderr.
"""

from __future__ import annotations

import os
import sys

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
    open_corpus_or_exit,
    prompt_fits_or_exit,
    prompt_text_or_exit,
    resolve_draft_args,
    sampling_from_args,
)
from redraft.decoding.runstats import run_report
from redraft.decoding.stopping import StopStrings
from redraft.io.prompts import encode_prompt


def cmd_run(args) -> int:
    # everything that can be checked without the model is, before it loads (and before torch is imported)
    config = config_from_args(args)  # flags, then REDRAFT_*, then COLI_*, then the defaults (redraft.compose)
    corpus_path, k, minacc = resolve_draft_args(args, config)
    check_draft_args(args, corpus_path, k)
    prompt = prompt_text_or_exit(sys.stdin.read() if args.prompt == "-" else args.prompt, "run")
    check_model_or_exit(args.model)
    corpus = open_corpus_or_exit(corpus_path)  # format and every token now; vocabulary and tokenizer once loaded
    sampling = sampling_from_args(args)
    loaded = load_model_or_exit(args.model, dtype=args.dtype)
    announce_generation_config(loaded, args)
    corpus = corpus_fits_model_or_exit(corpus, loaded, force=args.force)
    engine = engine_from_args(args, loaded, corpus, config=config)
    ids = prompt_fits_or_exit(encode_prompt(loaded.tokenizer, prompt, chat=False if args.no_chat else None), loaded,
                              "PROMPT", "run")
    stop = StopStrings(loaded.tokenizer, args.stop)
    hold = max((len(x) for x in stop.stops), default=1) - 1  # a stop string may still be completing

    tok = loaded.tokenizer
    out: list[int] = []
    shown = 0

    def stream(new):
        nonlocal shown
        out.extend(new)
        text = tok.decode(out, skip_special_tokens=True)
        # hold back a trailing replacement char (the next token may complete a multi-byte character) and
        # anything that could be the start of a stop string
        safe = len(text.rstrip("\ufffd")) - hold
        if stop.text is not None:  # this step completed a stop string: show exactly what precedes it
            safe = len(stop.text)
        if safe > shown:
            sys.stdout.write(text[shown:safe])
            sys.stdout.flush()
            shown = safe

    res = engine.generate(ids, args.ngen, on_tokens=stream, sampling=sampling, stop=stop if stop else None)
    text = stop.text if res.stop_reason == "stop" else tok.decode(out, skip_special_tokens=True)
    sys.stdout.write(text[shown:] + "\n")
    sys.stdout.flush()
    tokens = args.tokens or os.environ.get("TOKENS") == "1"
    lines = run_report(res, frozen_ids=corpus.n_tokens if corpus is not None else None, tokens=tokens)
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
    p.add_argument("prompt", metavar="PROMPT", help="the user prompt ('-' reads stdin)")
    p.set_defaults(func=cmd_run)
