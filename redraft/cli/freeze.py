"""``redraft freeze``: build a frozen corpus from prompts (run greedily) or from the ``[TOKENS]`` lines of runs.

Each prompt's ids plus its greedy generation become one span appended to ``--out``. An existing ``--out`` is
checked against the model before any generation; a binary corpus stays binary, otherwise the text format is used.
"""

from __future__ import annotations

import os
import sys

from redraft.cli.common import (
    NGEN_DEFAULT,
    add_model_args,
    announce_generation_config,
    check_model_or_exit,
    load_model_or_exit,
    output_file,
    prompt_fits_or_exit,
    prompts_or_exit,
)
from redraft.compose import plain_engine
from redraft.corpus import CorpusError, load_corpus, tokenizer_fingerprint
from redraft.corpus.format import sniff
from redraft.corpus.tools import append_to_corpus
from redraft.io.freeze import PromptFileError, append_spans, parse_token_log
from redraft.io.progress import Progress
from redraft.io.prompts import encode_prompt


def freeze_logs(logs: list[str], out: str) -> int:
    """``--from-log``: append the spans of the ``[TOKENS]`` lines in ``logs`` to ``out``."""
    try:
        spans = [span for log in logs for span in parse_token_log(log)]
    except PromptFileError as e:
        raise SystemExit(f"redraft freeze: error: {e}") from None
    if not spans:
        raise SystemExit(f"redraft freeze: error: no [TOKENS] lines found in {', '.join(logs)}")
    if os.path.isfile(out):
        try:  # validates the existing corpus, keeps its format
            append_to_corpus(out, logs)
        except CorpusError as e:
            raise SystemExit(f"redraft freeze: error: refusing to extend {out}: {e}") from None
    else:
        append_spans(out, spans)
    print(f"froze {len(spans)} spans ({sum(map(len, spans))} ids) into {out}", file=sys.stderr)
    return 0


def existing_corpus_or_exit(out: str, loaded=None):
    """The corpus already at ``out`` (None if there is none), refused unless it is a valid corpus: its format and
    tokens without a model, then (``loaded``) its ids against the vocabulary and its tokenizer fingerprint."""
    if not os.path.isfile(out):
        return None
    try:
        if loaded is None:
            return load_corpus(out)
        return load_corpus(out, vocab_size=loaded.vocab_size, fingerprint=tokenizer_fingerprint(loaded.tokenizer))
    except CorpusError as e:
        raise SystemExit(f"redraft freeze: error: refusing to extend {out}: {e}") from None


def freeze_prompts(args) -> int:
    """``--prompts``: answer each prompt greedily and append prompt + answer to ``args.out``."""
    # never extend a file that is not a valid corpus: its format before the model loads, its ids once it has
    prompts = prompts_or_exit(args.prompts, "freeze")
    existing = existing_corpus_or_exit(args.out)
    check_model_or_exit(args.model)

    loaded = load_model_or_exit(args.model, dtype=args.dtype, runtime=args.runtime, n_ctx=args.n_ctx)
    announce_generation_config(loaded)
    if existing is not None:
        fingerprint = tokenizer_fingerprint(loaded.tokenizer)
        if existing.max_id >= loaded.vocab_size or existing.fingerprint not in (None, fingerprint):
            existing_corpus_or_exit(args.out, loaded)  # refused, naming the first bad id or both fingerprints
        existing.vocab_size, existing.fingerprint = loaded.vocab_size, fingerprint  # as a load for this model sets
    # a binary corpus is extended in memory and rewritten once at the end (or on interrupt), atomically
    binary = existing if existing is not None and sniff(args.out) == "binary" else None
    chat = False if args.no_chat else None
    # every prompt is encoded and checked before the first generation: a bad one is refused before any work
    encoded = [prompt_fits_or_exit(encode_prompt(loaded.tokenizer, p, chat=chat), loaded, f"{args.prompts}: prompt "
                                   f"{i}", "freeze") for i, p in enumerate(prompts, 1)]
    engine = plain_engine(loaded.model, eos_token_ids=loaded.eos_token_ids)
    total = done = 0
    try:
        try:
            for ids in Progress(encoded, desc="freeze", unit="prompt"):
                res = engine.generate(ids, args.ngen or NGEN_DEFAULT)
                if binary is not None:
                    binary.append(ids + res.output_ids)
                else:
                    append_spans(args.out, [ids + res.output_ids])  # written as we go: an interruption keeps them
                total += len(ids) + len(res.output_ids)
                done += 1
        finally:
            if binary is not None and done:
                binary.save(args.out, fmt="binary")  # atomic: a failed write leaves the corpus as it was
    except CorpusError as e:  # a full disk or a read-only file: one line, not a traceback
        raise SystemExit(f"redraft freeze: error: {e}") from None
    print(f"froze {done} spans ({total} ids) into {args.out}", file=sys.stderr)
    return 0


def cmd_freeze(args) -> int:
    if bool(args.prompts) == bool(args.from_log):
        raise SystemExit("redraft freeze: error: give exactly one of --prompts FILE or --from-log LOG")
    stray = [flag for flag, value in (("--model", args.model), ("--ngen", args.ngen), ("--no-chat", args.no_chat))
             if value]
    if args.from_log and stray:
        raise SystemExit(f"redraft freeze: error: {', '.join(stray)}: only used with --prompts (--from-log copies "
                         f"the logged ids)")
    return freeze_logs(args.from_log, args.out) if args.from_log else freeze_prompts(args)


def register(sub) -> None:
    """Add ``freeze`` to the top-level sub-parsers."""
    p = sub.add_parser("freeze", help="run prompts greedily and append the generations to a corpus",
                       description="Build a frozen corpus: each prompt's ids plus its greedy generation become one "
                                   "span (-1 between spans) appended to --out.")
    add_model_args(p)
    p.set_defaults(ngen=None)  # given or not: --ngen has no effect with --from-log
    p.add_argument("--prompts", help="prompts file: one per line, or JSONL with a 'prompt' or 'turns' field")
    p.add_argument("--from-log", nargs="+", metavar="LOG", help="take the [TOKENS] lines of earlier runs instead")
    p.add_argument("--out", required=True, type=output_file,
                   help="corpus file to extend (an existing binary corpus stays binary; otherwise text, created if "
                        "missing); it is checked before any generation")
    p.set_defaults(func=cmd_freeze)

