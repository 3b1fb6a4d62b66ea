"""The training data recipe of ``redraft glide train``: which records are generated, cached and used.

:func:`build_training_data` builds (or reuses, from the feature cache) every kind of training record for a target
and returns them with the held-out estimate set and the vocabulary ranking:

- ``heldout``: greedy answers to the estimate questions (:data:`redraft.training.data.ESTIMATE_IDS`);
- ``self-k<K>``: greedy answers to questions the target wrote itself (:mod:`redraft.training.selfprompt`);
- ``train``: greedy answers to the Spec-Bench training questions; ``train-s<v>``: sampled answer sets;
- ``text-k<K>``: teacher-forced stdlib text windows.

Generation shares one wall-clock budget (``data_minutes``) in that order; text windows are counted, not timed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from redraft.glide.config import GlideConfig


def default_glide_dir() -> Path:
    """``<cache>/glide``: checkpoints and the feature cache."""
    from redraft.io.loading import cache_dir

    return cache_dir() / "glide"


def build_training_data(loaded, *, n_layers: int = 1, data_minutes: float = 90.0, max_new_tokens: int = 128,
                        text_windows: int = 0, data_dir: str | os.PathLike | None = None, progress: bool = True,
                        samples: int = 8, sample_temperature: float = 0.7, sample_max_prompt: int = 384,
                        self_questions: int = 0, topk: int = 8, command: str | None = None, log=None,
                        gen_batch: int | None = None, gen_tokens: int | None = None, min_batches: int = 0,
                        heldout_questions: int | None = None):
    """Build/reuse the training records for ``loaded`` (a LoadedModel); the arguments are
    :func:`redraft.training.train.run_training`'s, plus ``gen_batch`` / ``gen_tokens``: the most answers and padded
    tokens per generation batch (None = the CPU sizes, 32-64 answers and 8-16k tokens; a GPU takes far more), and
    ``min_batches``: batches of self-question and Spec-Bench answers generated even once the budget is spent, and
    ``heldout_questions``: how many of the estimate questions the held-out set answers (None: all of them).

    Returns:
        (records, heldout records, vocabulary ranking LongTensor [vocab], JSON-able data description).
    Raises:
        SystemExit: no training data at all.
    """
    log = sys.stderr if log is None else log  # the stream current at the call
    from redraft.glide.checkpoint import target_fingerprint
    from redraft.training.data import (
        ESTIMATE_IDS,
        FeatureStore,
        build_generation_data,
        build_text_data,
        is_held_out,
        load_questions,
        stdlib_files,
        training_order,
        vocab_ranking,
    )

    model, tok = loaded.model, loaded.tokenizer
    gcfg = GlideConfig.from_target(model.config, n_layers=n_layers)
    layers = gcfg.target_layers
    fp = target_fingerprint(model)
    root = Path(data_dir).expanduser() if data_dir else default_glide_dir() / "data" / (
        f"{fp}-L{'_'.join(map(str, layers))}-n{max_new_tokens}")
    meta = {"fingerprint": fp, "layers": layers, "max_new_tokens": max_new_tokens}
    train_store = FeatureStore(root / "train", meta)
    heldout_ids = ESTIMATE_IDS if heldout_questions is None else ESTIMATE_IDS[:heldout_questions]
    held_store = FeatureStore(root / "heldout" if heldout_questions is None else root / f"heldout-{len(heldout_ids)}",
                              meta)
    eos = loaded.eos_token_ids

    sizes = {} if gen_batch is None else {"max_batch": gen_batch, "max_tokens": gen_tokens or 16384}
    big = sizes or {"max_batch": 64, "max_tokens": 16384}  # the self-question and sampled sets' batches

    t0 = time.perf_counter()
    build_generation_data(model, tok, held_store, layers, question_ids=heldout_ids, max_new_tokens=max_new_tokens,
                          eos_ids=eos, **sizes)
    self_store = FeatureStore(root / f"self-k{topk}", {**meta, "topk": topk, "source": "self-questions"}) \
        if self_questions else None
    text_store = FeatureStore(root / f"text-k{topk}", {**meta, "topk": topk, "source": "stdlib"}) \
        if text_windows else None
    if data_minutes > 0:
        print(f"glide data: generating training answers for up to {data_minutes:g} min into {root} "
              f"(a started batch is finished)", file=log)
        from redraft.io.progress import Progress

        bar = Progress(desc="glide data", unit="tok", noun="token", file=log, enabled=progress, dynamic_ncols=True)
        budget_end = time.perf_counter() + data_minutes * 60
        if self_store is not None:
            from redraft.training.selfprompt import load_or_make

            qs = load_questions()
            qtexts = load_or_make(root / "self-questions.json", model, tok, self_questions,
                                  held_out=[q["turns"][0] for i, q in enumerate(qs) if is_held_out(i)], seed=0,
                                  batch=big["max_batch"], max_new_tokens=64, temperature=0.8)
            build_generation_data(model, tok, self_store, layers, question_ids=list(range(len(qtexts))),
                                  max_new_tokens=max_new_tokens, eos_ids=eos, **big,
                                  max_prompt=sample_max_prompt, texts=qtexts, topk=topk, min_batches=min_batches,
                                  seconds=max(0.0, budget_end - time.perf_counter()),
                                  progress=lambda r, n: bar.update(n))
        build_generation_data(model, tok, train_store, layers, question_ids=training_order(load_questions()),
                              max_new_tokens=max_new_tokens, eos_ids=eos, **sizes, min_batches=min_batches,
                              seconds=max(0.0, budget_end - time.perf_counter()),
                              progress=lambda r, n: bar.update(n))
        for v in range(1, samples + 1):
            left = budget_end - time.perf_counter()
            if left <= 0:
                break
            # one directory per (temperature, set): another temperature starts new sets, never clashes
            name = f"train-s{v}" if sample_temperature == 0.7 else f"train-t{sample_temperature:g}-s{v}"
            build_generation_data(model, tok, FeatureStore(root / name, {**meta, "temperature":
                                  sample_temperature, "sample": v}), layers,
                                  question_ids=training_order(load_questions()), max_new_tokens=max_new_tokens,
                                  eos_ids=eos, seconds=left, **(sizes or {"max_batch": 64}),
                                  max_prompt=sample_max_prompt,
                                  temperature=sample_temperature, seed=v, progress=lambda r, n: bar.update(n))
        bar.close()
    if text_store is not None:
        build_text_data(model, tok, text_store, layers, n_windows=text_windows, batch=8, topk=topk)
    data_seconds = time.perf_counter() - t0
    sample_stores = [FeatureStore(d, json.loads((d / "index.json").read_text())["meta"])
                     for d in sorted(root.glob("train-*")) if (d / "index.json").is_file()]
    records, heldout = train_store.load(), held_store.load()
    n_sampled = 0
    for st in sample_stores:
        recs = st.load()
        n_sampled += len(recs)
        records += recs
    n_self = n_text = 0
    if self_store is not None:
        recs = self_store.load()
        n_self = len(recs)
        records += recs
    if text_store is not None:
        recs = text_store.load()[:text_windows]
        n_text = len(recs)
        records += recs
    extra_stores = [st for st in (self_store, text_store) if st is not None]
    if not records:
        raise SystemExit("redraft glide train: error: no training data (raise --data-minutes)")
    n_tok = sum(len(r) for r in records)
    n_gen = sum(len(r) - r.gen_start for r in records)
    gen_seconds = sum(st.index["seconds"] for st in [train_store, *sample_stores, *extra_stores])
    print(f"glide data: {len(records)} records, {n_tok} tokens ({n_gen} generated by the target) from "
          f"{len(train_store.done_questions)} Spec-Bench questions ({n_sampled} sampled answers), "
          f"{n_self} self-written questions and {n_text + train_store.index['text_windows']} stdlib windows; "
          f"{data_seconds:.0f} s this call, {gen_seconds:.0f} s in total", file=log)

    # token frequencies: the target's labels (weighted x4) + stdlib docs/sources + the training questions' text
    questions = load_questions()
    texts = [f.read_text(errors="replace") for f in stdlib_files()[:80]]
    texts += [questions[i]["turns"][0] for i in training_order(questions)]
    rank = vocab_ranking(model.config.vocab_size, records, tok, texts)
    info = {"dir": str(root), "records": len(records), "tokens": n_tok, "generated_tokens": n_gen,
            "questions": len(train_store.done_questions),
            "text_windows": n_text + train_store.index["text_windows"], "self_questions": n_self, "topk": topk,
            "sampled_answers": n_sampled, "sample_temperature": sample_temperature if sample_stores else None,
            "heldout_questions": heldout_ids, "generation_seconds": round(gen_seconds, 1), "command": command,
            "per_store": {st.root.name: {"tokens": st.index["tokens"], "seconds": round(st.index["seconds"], 1),
                                         "cpu_seconds": round(st.index.get("cpu_seconds", 0.0), 3)}
                          for st in [train_store, *sample_stores, *extra_stores]}, "layers": layers}
    return records, heldout, rank, info
