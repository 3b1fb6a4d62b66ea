"""Training data for GliDe drafts: the target's own greedy choices, its KV cache, and a vocabulary ranking.

Self-distillation (arXiv 2402.02082, section 4.1 trains on the target's responses): every training record is a
token sequence run through the frozen target once, keeping

- ``ids`` [N]: the input tokens,
- ``labels`` [N]: the target's greedy choice after each position (what the draft must predict),
- ``k``, ``v`` [L_D, Hkt, N, D] (fp16): the target's cached keys/values of the layers the draft reads,
- ``gen_start``: the first position whose token the target generated itself (N for plain text records);
- optionally ``top_ids`` [N, k] (int32) and ``top_logp`` [N, k] (fp16): the target's k most likely next tokens
  at each position and their log-probabilities (full-vocabulary softmax), for distilling its distribution.

Sources, all available offline:

- **target generations**: the target answers Spec-Bench questions of the training split greedily (batched, left
  padded, one pass that yields labels and KV at no extra cost);
- **text**: windows of Python's own standard-library sources and docs (``pydoc_data/topics.py``), labelled by
  the target (its greedy choice at each position).

Spec-Bench questions whose index is a multiple of 10 (48 questions, every category) are held out of training:
:data:`MEASURE_IDS` (10 of them) are used for the speed/acceptance measurements, :data:`ESTIMATE_IDS` for the
acceptance estimate printed at each checkpoint. Records are stored as safetensors shards in a cache directory
keyed by the target fingerprint, so an interrupted or repeated run reuses what it already computed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from redraft.io.atomic import atomic_path, write_json
from redraft.io.questions import load_questions
from redraft.runtimes.transformers.target import cache_kwarg

HELD_OUT_EVERY = 10
MEASURE_IDS = list(range(0, 480, 50))  # 0, 50, ..., 450: every category of Spec-Bench
ESTIMATE_IDS = [10, 130, 250, 370, 170, 430]


# ---- Spec-Bench questions -------------------------------------------------------------------------------------------

def is_held_out(index: int) -> bool:
    """Questions whose 0-based index is a multiple of 10 never enter training."""
    return index % HELD_OUT_EVERY == 0


def training_order(questions: Sequence[dict]) -> list[int]:
    """Indices of the training questions, round-robin over categories (so any prefix is a balanced mix).

    The eight MT-bench categories count as one ("mt_bench"), like Spec-Bench's own grouping.
    """
    mt = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
    groups: dict[str, list[int]] = {}
    for i, q in enumerate(questions):
        if not is_held_out(i):
            groups.setdefault("mt_bench" if q["category"] in mt else q["category"], []).append(i)
    order, lists = [], list(groups.values())
    for j in range(max(len(g) for g in lists)):
        order += [g[j] for g in lists if j < len(g)]
    return order


# ---- records --------------------------------------------------------------------------------------------------------

@dataclass
class Record:
    """One training sequence (see the module docstring for the fields); ``qid`` is -1 for text windows."""

    ids: torch.Tensor
    labels: torch.Tensor
    gen_start: int
    k: torch.Tensor | None
    v: torch.Tensor | None
    qid: int = -1
    top_ids: torch.Tensor | None = None
    top_logp: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])


def _top(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """logits [..., V] -> (argmax [...], top-k ids int32 [..., k] and log-probabilities fp16 [..., k], or Nones)."""
    if k <= 0:
        return logits.argmax(-1), None, None
    logp = torch.log_softmax(logits.float(), -1)
    top = torch.topk(logp, k, dim=-1)
    # argmax, not top.indices[..., 0]: ties must resolve exactly as greedy decoding resolves them
    return logits.argmax(-1), top.indices.int(), top.values.half()


def _chunked_top(hidden: torch.Tensor, head: torch.Tensor, k: int = 0, chunk: int = 64):
    """:func:`_top` of hidden [B, S, H] @ head.T, S in chunks (full logits would take GBs)."""
    parts = [_top(hidden[:, s:s + chunk] @ head.T, k) for s in range(0, hidden.shape[1], chunk)]
    if k <= 0:
        return torch.cat([p[0] for p in parts], 1), None, None
    return tuple(torch.cat([p[i] for p in parts], 1) for i in range(3))


@torch.inference_mode()
def generate_records(model, prompts: Sequence[Sequence[int]], layers: Sequence[int], *, max_new_tokens: int = 128,
                     eos_ids: Iterable[int] = (), qids: Sequence[int] | None = None, pad_id: int = 0,
                     temperature: float = 0.0, top_k: int = 40, seed: int = 0, topk: int = 0) -> list[Record]:
    """Answers of the target for a batch of prompts, with its greedy labels and the chosen layers' KV cache.

    The prompts are left-padded into one batch; the prefill computes the target's choice at every prompt
    position, and each decode step feeds the next input. With ``temperature`` 0 the input is the target's greedy
    choice (so the answer is exactly what greedy decoding produces); above 0 it is sampled from the top
    ``top_k`` tokens at that temperature (seeded), which gives new target-written contexts for the same
    questions while every label stays the target's greedy choice. A row stops at its first EOS input choice
    (the EOS is its last label, never an input).

    Args:
        model: a transformers causal LM (``base_model``, ``get_output_embeddings``).
        prompts: B prompt id lists.
        layers: target layer indices whose KV to keep.
        max_new_tokens: most generated tokens per row.
        topk: also keep the target's ``topk`` most likely tokens and log-probabilities per position (0 = no).
    Returns:
        B :class:`Record` objects (ids = prompt + generated inputs; k/v fp16 [len(layers), Hkt, N, D]).
    """
    from transformers import DynamicCache

    base, head = model.base_model, model.get_output_embeddings().weight
    dev = head.device  # the model's device: a GPU run generates there, the records come back to the CPU
    eos = set(int(e) for e in eos_ids)
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, P), pad_id, dtype=torch.long)
    att = torch.zeros(B, P, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(list(p), dtype=torch.long)
        att[b, P - len(p):] = 1
    ids, att = ids.to(dev), att.to(dev)
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    kw = {cache_kwarg(base): cache}  # "cache", or "past_key_values" before transformers 5.2x
    h = base(input_ids=ids, attention_mask=att, position_ids=pos, use_cache=True, **kw).last_hidden_state
    prompt_labels, prompt_ti, prompt_tl = _chunked_top(h, head, topk)  # [B, P], [B, P, k]
    gen_rng = torch.Generator(device=dev).manual_seed(seed)

    def choose(h_last: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
        """The next input ids [B]: the greedy choice, or a top-k sample at ``temperature``."""
        if temperature <= 0:
            return greedy
        top = torch.topk(h_last @ head.T, top_k, dim=-1)  # values/indices [B, top_k]
        probs = torch.softmax(top.values / temperature, -1)
        return top.indices.gather(-1, torch.multinomial(probs, 1, generator=gen_rng))[:, 0]

    nxt = choose(h[:, -1], prompt_labels[:, -1])
    nxt_ids = nxt.tolist()  # one device sync per step, not one per row
    gen = [[] for _ in range(B)]  # generated inputs per row
    done = [False] * B
    for b in range(B):
        done[b] = nxt_ids[b] in eos or max_new_tokens <= 1
    step_labels, step_ti, step_tl = [], [], []
    for _ in range(max_new_tokens - 1):
        if all(done):
            break
        for b in range(B):
            if not done[b]:
                gen[b].append(nxt_ids[b])
        att = torch.cat((att, torch.ones(B, 1, dtype=torch.long, device=dev)), 1)
        pos = pos[:, -1:] + 1
        h = base(input_ids=nxt[:, None], attention_mask=att, position_ids=pos, use_cache=True,
                 **kw).last_hidden_state
        greedy, ti, tl = _top(h[:, -1] @ head.T, topk)
        step_labels.append(greedy)
        step_ti.append(ti)
        step_tl.append(tl)
        nxt = choose(h[:, -1], greedy)
        nxt_ids = nxt.tolist()
        for b in range(B):
            if not done[b] and (nxt_ids[b] in eos or len(gen[b]) >= max_new_tokens - 1):
                done[b] = True
    records = []
    prompt_labels = prompt_labels.cpu()
    steps = torch.stack(step_labels, 1).cpu() if step_labels else None  # [B, steps]
    if topk > 0:
        prompt_ti, prompt_tl = prompt_ti.cpu(), prompt_tl.cpu()
        step_ti, step_tl = [t.cpu() for t in step_ti], [t.cpu() for t in step_tl]
    for b, p in enumerate(prompts):
        n_gen = len(gen[b])
        seq = list(p) + gen[b]
        # labels: the prompt positions' argmax, then each generated input's successor choice
        labels = prompt_labels[b, P - len(p):].tolist() + (steps[b, :n_gen].tolist() if n_gen else [])
        cols = torch.cat((torch.arange(P - len(p), P), torch.arange(P, P + n_gen))).to(dev)  # this row's columns
        k = torch.stack([cache.layers[i].keys[b][:, cols] for i in layers]).half().cpu()  # [Ld, Hkt, N, D]
        v = torch.stack([cache.layers[i].values[b][:, cols] for i in layers]).half().cpu()
        rec = Record(torch.tensor(seq), torch.tensor(labels), len(p), k, v, -1 if qids is None else int(qids[b]))
        if topk > 0:
            rec.top_ids = torch.cat([prompt_ti[b, P - len(p):]] + [step_ti[t][b:b + 1] for t in range(n_gen)])
            rec.top_logp = torch.cat([prompt_tl[b, P - len(p):]] + [step_tl[t][b:b + 1] for t in range(n_gen)])
        records.append(rec)
    return records


@torch.inference_mode()
def text_records(model, windows: Sequence[Sequence[int]], layers: Sequence[int], topk: int = 0) -> list[Record]:
    """Target labels and KV for plain-text windows of equal length (one batched forward, no generation).

    Teacher forcing: the inputs are the text, the labels the target's greedy choice after each position, so one
    forward labels a whole window (a generated answer costs one forward per token). ``topk`` as in
    :func:`generate_records`.
    """
    from transformers import DynamicCache

    head = model.get_output_embeddings().weight
    ids = torch.tensor([list(w) for w in windows], dtype=torch.long)
    cache = DynamicCache(config=model.config)
    h = model.base_model(input_ids=ids.to(head.device), use_cache=True,
                         **{cache_kwarg(model.base_model): cache}).last_hidden_state
    labels, ti, tl = (None if t is None else t.cpu() for t in _chunked_top(h, head, topk))
    out = []
    for b in range(ids.shape[0]):
        k = torch.stack([cache.layers[i].keys[b] for i in layers]).half().cpu()
        v = torch.stack([cache.layers[i].values[b] for i in layers]).half().cpu()
        out.append(Record(ids[b], labels[b], ids.shape[1], k, v, top_ids=None if ti is None else ti[b],
                          top_logp=None if tl is None else tl[b]))
    return out


# ---- plain text -----------------------------------------------------------------------------------------------------

def stdlib_files() -> list[Path]:
    """Python's standard-library docs (``pydoc_data/topics.py``) first, then its ``.py`` sources, sorted."""
    lib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    docs = lib / "pydoc_data" / "topics.py"
    srcs = sorted(p for p in lib.glob("*.py") if p.is_file())
    return ([docs] if docs.is_file() else []) + srcs


def text_windows(tokenizer, n_windows: int, length: int = 256, files: Sequence[Path] | None = None) -> list[list[int]]:
    """``n_windows`` consecutive token windows of ``length`` ids from the stdlib texts (deterministic)."""
    out: list[list[int]] = []
    for f in files if files is not None else stdlib_files():
        if len(out) >= n_windows:
            break
        ids = tokenizer(f.read_text(errors="replace"))["input_ids"]
        for s in range(0, len(ids) - length + 1, length):
            out.append(ids[s:s + length])
            if len(out) >= n_windows:
                break
    return out


def vocab_ranking(vocab_size: int, records: Sequence[Record], tokenizer=None, texts: Iterable[str] = (),
                  label_weight: int = 4) -> torch.Tensor:
    """Token ids by descending frequency: the target's labels (weighted) plus tokenised extra texts.

    Returns:
        LongTensor [vocab_size], every id exactly once (ties broken by id), for a reduced-vocabulary head.
    """
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        counts += label_weight * torch.bincount(r.labels.long(), minlength=vocab_size)[:vocab_size].double()
    if tokenizer is not None:
        for t in texts:
            ids = torch.tensor(tokenizer(t)["input_ids"], dtype=torch.long)
            counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size].double()
    # stable: sort by id first, then by count descending
    return torch.sort(-counts, stable=True).indices


# ---- the on-disk store ----------------------------------------------------------------------------------------------

class FeatureStore:
    """Records in safetensors shards under ``root`` plus ``index.json`` (which questions/windows are done).

    Args:
        root: directory (created when missing).
        meta: identity of the data (target fingerprint, layers, max_new_tokens); a store whose index records
            another identity is refused.
    Raises:
        ValueError: the directory holds data for another identity.
    """

    def __init__(self, root: str | os.PathLike, meta: dict) -> None:
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self.index_path = self.root / "index.json"
        if self.index_path.is_file():
            self.index = json.loads(self.index_path.read_text())
            if self.index.get("meta") != meta:
                raise ValueError(f"{self.root}: feature cache for {self.index.get('meta')}, not {meta}")
        else:
            self.index = {"meta": meta, "shards": [], "questions": [], "text_windows": 0, "seconds": 0.0,
                          "tokens": 0}

    @property
    def done_questions(self) -> set[int]:
        return set(self.index["questions"])

    def append(self, records: Sequence[Record], seconds: float, *, text_windows: int = 0,
               cpu_seconds: float | None = None) -> None:
        """Write ``records`` as one new shard and record them in the index (``seconds`` of wall-clock and, when
        given, ``cpu_seconds`` of this process's CPU time: tokens per core-minute on a shared machine)."""
        from safetensors.torch import save_file

        if not records:
            return
        lens = torch.tensor([len(r) for r in records])
        t = {"ids": torch.cat([r.ids for r in records]).int(), "labels": torch.cat([r.labels for r in records]).int(),
             "offsets": torch.cat((torch.zeros(1, dtype=torch.long), lens.cumsum(0))),
             "gen_start": torch.tensor([r.gen_start for r in records]), "qid": torch.tensor([r.qid for r in records])}
        if records[0].k is not None:
            t["k"] = torch.cat([r.k for r in records], 2).contiguous()
            t["v"] = torch.cat([r.v for r in records], 2).contiguous()
        if records[0].top_ids is not None:
            t["top_ids"] = torch.cat([r.top_ids for r in records]).contiguous()
            t["top_logp"] = torch.cat([r.top_logp for r in records]).contiguous()
        name = f"shard-{len(self.index['shards']):05d}.safetensors"
        with atomic_path(self.root / name) as tmp:
            save_file(t, str(tmp))
        self.index["shards"].append(name)
        self.index["questions"] += [r.qid for r in records if r.qid >= 0]
        self.index["text_windows"] += text_windows
        self.index["seconds"] += seconds
        if cpu_seconds is not None:
            self.index["cpu_seconds"] = self.index.get("cpu_seconds", 0.0) + cpu_seconds
        self.index["tokens"] += int(lens.sum())
        write_json(self.index_path, self.index, indent=1)

    def load(self) -> list[Record]:
        """Every stored record, in the order written."""
        from safetensors.torch import load_file

        out = []
        for name in self.index["shards"]:
            t = load_file(str(self.root / name))
            off = t["offsets"].tolist()
            for r in range(len(off) - 1):
                a, b = off[r], off[r + 1]
                out.append(Record(t["ids"][a:b].long(), t["labels"][a:b].long(), int(t["gen_start"][r]),
                                  t["k"][:, :, a:b] if "k" in t else None, t["v"][:, :, a:b] if "v" in t else None,
                                  int(t["qid"][r]), t["top_ids"][a:b] if "top_ids" in t else None,
                                  t["top_logp"][a:b] if "top_logp" in t else None))
        return out


def batches_by_length(order: Sequence[int], lengths: Sequence[int], max_tokens: int, max_batch: int) -> list[list[int]]:
    """Group ``order`` (kept as the priority order, in chunks) into batches of similar length.

    Each chunk of 4 * max_batch consecutive items is sorted by length and cut into batches whose padded size
    (batch x longest) stays within ``max_tokens`` (a single longer item still forms its own batch).
    """
    out: list[list[int]] = []
    for c in range(0, len(order), 4 * max_batch):
        chunk = sorted(order[c:c + 4 * max_batch], key=lambda i: lengths[i])
        cur: list[int] = []
        for i in chunk:
            if cur and (len(cur) >= max_batch or (len(cur) + 1) * max(lengths[j] for j in cur + [i]) > max_tokens):
                out.append(cur)
                cur = []
            cur.append(i)
        if cur:
            out.append(cur)
    return out


def build_generation_data(model, tokenizer, store: FeatureStore, layers: Sequence[int], *, question_ids: Sequence[int],
                          max_new_tokens: int, eos_ids: Iterable[int], seconds: float | None = None,
                          max_batch: int = 32, max_tokens: int = 8192, max_prompt: int = 1024, progress=None,
                          temperature: float = 0.0, seed: int = 0, texts: Sequence[str] | None = None,
                          topk: int = 0, min_batches: int = 0) -> int:
    """Generate answers for ``question_ids`` not yet in ``store`` (in the given order), until ``seconds`` run out.

    Args:
        seconds: wall-clock budget for this call (None = no limit); a batch that started is finished.
        max_prompt: questions whose prompt is longer are skipped.
        temperature, seed: 0 = greedy answers; above 0, sampled answers (see :func:`generate_records`); the
            seed of each batch is ``seed`` plus its first question id, so a resumed store stays reproducible.
        progress: optional callable(n_records, n_tokens) after each batch.
        texts: the questions as plain strings (``question_ids`` index them); None = Spec-Bench's first turns.
        topk: keep the target's top-k next tokens per position (see :func:`generate_records`).
        min_batches: this many batches run whatever ``seconds`` says (a bounded run still gets some data).
    Returns:
        number of records added.
    """
    from redraft.io.prompts import encode_prompt

    if texts is None:
        texts = [q["turns"][0] for q in load_questions()]
    todo = [i for i in question_ids if i not in store.done_questions]
    prompts = {i: encode_prompt(tokenizer, texts[i]) for i in todo}
    todo = [i for i in todo if len(prompts[i]) <= max_prompt]
    lengths = {i: len(prompts[i]) + max_new_tokens for i in todo}
    t0, added = time.perf_counter(), 0
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    for n_batch, batch in enumerate(batches_by_length(todo, lengths, max_tokens, max_batch)):
        if seconds is not None and time.perf_counter() - t0 >= seconds and n_batch >= min_batches:
            break
        t1, c1 = time.perf_counter(), time.process_time()
        recs = generate_records(model, [prompts[i] for i in batch], layers, max_new_tokens=max_new_tokens,
                                eos_ids=eos_ids, qids=batch, pad_id=pad, temperature=temperature,
                                seed=seed * 100_003 + batch[0], topk=topk)
        store.append(recs, time.perf_counter() - t1, cpu_seconds=time.process_time() - c1)
        added += len(recs)
        if progress is not None:
            progress(len(recs), sum(len(r) for r in recs))
    return added


def build_text_data(model, tokenizer, store: FeatureStore, layers: Sequence[int], *, n_windows: int,
                    length: int = 256, batch: int = 4, files: Sequence[Path] | None = None, topk: int = 0,
                    seconds: float | None = None) -> int:
    """Add text windows (default: the stdlib's, see :func:`stdlib_files`) up to ``n_windows`` in total (the store
    remembers how many it has), until ``seconds`` run out; returns the number of windows added."""
    have = store.index["text_windows"]
    if have >= n_windows:
        return 0
    windows = text_windows(tokenizer, n_windows, length, files)[have:]
    t0, added = time.perf_counter(), 0
    for s in range(0, len(windows), batch):
        if seconds is not None and time.perf_counter() - t0 >= seconds:
            break
        t1, c1 = time.perf_counter(), time.process_time()
        chunk = windows[s:s + batch]
        store.append(text_records(model, chunk, layers, topk), time.perf_counter() - t1, text_windows=len(chunk),
                     cpu_seconds=time.process_time() - c1)
        added += len(chunk)
    return added
