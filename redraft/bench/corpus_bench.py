"""`redraft bench corpus`: build / open / lookup figures of redraft.corpus at growing sizes.

Token streams: Python's own stdlib sources tokenised by a deterministic word -> id map (vocab 49152, the default
model's size), stretched to the requested size with synthetic Zipf text and planted repeats of earlier real
text (what replay workloads look like). Each size reports build seconds and tokens/s, bytes/token on disk and
resident (tokens + index), open time of the saved binary, and lookup p50/p99 in microseconds for propose() and
propose_tree(). At small sizes a linear numpy scan (the original engine's approach) runs as a baseline and its
answers are checked against the index.
"""

from __future__ import annotations

import gc
import os
import re
import resource
import sys
import sysconfig
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from redraft.corpus import Corpus, load_corpus

VOCAB = 49152
WORD = re.compile(r"\w+|[^\w\s]")
DEFAULT_SIZES = (10**4, 10**6, 10**7, 10**8)


# ---- token streams ----------------------------------------------------------------------------------------------
def stdlib_tokens(limit: int) -> np.ndarray:
    """Up to `limit` ids from the stdlib's .py files (sorted paths, so deterministic). int32 [<= limit]."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out, total, cache = [], 0, {}
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        ids = []
        for w in WORD.findall(text):
            i = cache.get(w)
            if i is None:
                i = cache[w] = zlib.crc32(w.encode()) % VOCAB
            ids.append(i)
        out.append(np.array(ids, dtype=np.int32))
        total += len(ids)
        if total >= limit:
            break
    stream = np.concatenate(out) if out else np.zeros(0, dtype=np.int32)
    return stream[:limit]


def make_stream(n: int, real: np.ndarray, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """n ids: real text first, then ~60% Zipf(1.1) words and ~40% copies of random earlier real-text runs (50-500
    ids), cut into spans of 100-2000 ids. Returns (tokens int32 [n], offsets int64 [n_spans + 1])."""
    rng = np.random.default_rng(seed)
    tokens = np.empty(n, dtype=np.int32)
    head = min(n, len(real))
    tokens[:head] = real[:head]
    pos = head
    while pos < n:
        if rng.random() < 0.6 or head < 600:
            m = min(n - pos, int(rng.integers(2000, 20000)))
            tokens[pos:pos + m] = np.minimum(rng.zipf(1.1, m), VOCAB) - 1
        else:
            m = min(n - pos, int(rng.integers(50, 500)))
            src = int(rng.integers(0, head - m))
            tokens[pos:pos + m] = real[src:src + m]
        pos += m
    cuts = np.cumsum(rng.integers(100, 2000, n // 100 + 2))
    offsets = np.concatenate(([0], cuts[cuts < n], [n])).astype(np.int64)
    return tokens, offsets


def sample_contexts(tokens: np.ndarray, offsets: np.ndarray, count: int, length: int = 32,
                    seed: int = 1) -> list[np.ndarray]:
    """80% contexts cut from inside spans of the corpus (they hit), 20% random ids (they mostly miss)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        if rng.random() < 0.8:
            s = int(rng.integers(0, len(offsets) - 1))
            a, b = int(offsets[s]), int(offsets[s + 1])
            end = int(rng.integers(a + 1, b + 1))
            out.append(tokens[max(a, end - length):end].astype(np.int64))
        else:
            out.append(rng.integers(0, VOCAB, length).astype(np.int64))
    return out


# ---- linear baseline --------------------------------------------------------------------------------------------
def linear_propose(stream: np.ndarray, context: np.ndarray, k: int, min_n: int = 3, max_n: int = 8):
    """The original engine's lookup: scan the whole stream (int64 [L], -1 separators) for every n. O(L * n)."""
    for n in range(min(max_n, len(context)), min_n - 1, -1):
        pat = context[-n:]
        hits = np.ones(len(stream) - n, dtype=bool)  # window starting at j, followed by stream[j + n]
        for j in range(n):
            hits &= stream[j:len(stream) - n + j] == pat[j]
        hits &= stream[n:] != -1
        idx = np.flatnonzero(hits)
        if len(idx):
            start = int(idx[-1]) + n
            cont = stream[start:start + k]
            stop = np.flatnonzero(cont == -1)
            return n, (cont[:stop[0]] if len(stop) else cont)
    return 0, np.zeros(0, dtype=np.int64)


def with_separators(tokens: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    parts = []
    for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True):
        parts.append(tokens[a:b].astype(np.int64))
        parts.append(np.array([-1]))
    return np.concatenate(parts[:-1]) if parts else np.zeros(0, dtype=np.int64)


# ---- measurement ------------------------------------------------------------------------------------------------
def _percentiles_us(samples_ns: list[int]) -> tuple[float, float]:
    arr = np.array(samples_ns, dtype=np.float64) / 1000.0
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def bench_size(n: int, real: np.ndarray, *, lookups: int = 20000, k: int = 8, workdir: str,
               linear_max: int = 10**6, linear_lookups: int = 200, log=print) -> dict:
    """Figures for one corpus size; see the module doc. Keys are self-describing (units in the name)."""
    tokens, offsets = make_stream(n, real)
    gc.collect()
    t0 = time.perf_counter()
    corpus = Corpus.from_flat(tokens, offsets, vocab_size=VOCAB)
    build_s = time.perf_counter() - t0
    path = os.path.join(workdir, f"corpus_{n}.rdc")
    t0 = time.perf_counter()
    corpus.save(path)
    save_s = time.perf_counter() - t0
    disk = os.path.getsize(path)
    del corpus
    gc.collect()
    t0 = time.perf_counter()
    opened = load_corpus(path, vocab_size=VOCAB)
    open_s = time.perf_counter() - t0
    stats = opened.stats()

    contexts = sample_contexts(tokens, offsets, lookups)
    for ctx in contexts[:200]:  # warm the page cache for the touched pages, as a running engine would
        opened.propose(ctx, k)
    times, hits, proposed = [], 0, 0
    clock = time.perf_counter_ns
    for ctx in contexts:
        t0 = clock()
        m, ids = opened.propose(ctx, k)
        times.append(clock() - t0)
        hits += m > 0
        proposed += len(ids)
    p50, p99 = _percentiles_us(times)
    tree_times = []
    for ctx in contexts[: max(1, lookups // 10)]:
        t0 = clock()
        opened.propose_tree(ctx, k, branches=4)
        tree_times.append(clock() - t0)
    t50, t99 = _percentiles_us(tree_times)
    row = {
        "tokens": n,
        "spans": int(len(offsets) - 1),
        "build_s": round(build_s, 3),
        "build_tokens_per_s": round(n / build_s),
        "save_s": round(save_s, 3),
        "disk_bytes_per_token": round(disk / n, 3),
        "resident_bytes_per_token": round(stats["bytes_per_token"], 3),
        "open_s": round(open_s, 5),
        "lookups": len(contexts),
        "hit_rate": round(hits / len(contexts), 3),
        "mean_proposed": round(proposed / len(contexts), 2),
        "propose_p50_us": round(p50, 2),
        "propose_p99_us": round(p99, 2),
        "tree_p50_us": round(t50, 2),
        "tree_p99_us": round(t99, 2),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    if n <= linear_max:
        stream = with_separators(tokens, offsets)
        lin, agree = [], 0
        for ctx in contexts[:linear_lookups]:
            t0 = clock()
            ref = linear_propose(stream, ctx, k)
            lin.append(clock() - t0)
            got = opened.propose(ctx, k)
            agree += ref[0] == got[0] and np.array_equal(ref[1], got[1])
        l50, l99 = _percentiles_us(lin)
        row.update(linear_p50_us=round(l50, 1), linear_p99_us=round(l99, 1),
                   linear_agree=f"{agree}/{len(lin)}")
    del opened
    os.remove(path)
    log(_format_row(row))
    return row


def _format_row(row: dict) -> str:
    parts = [f"{row['tokens']:>11,} tok", f"build {row['build_s']:.2f}s ({row['build_tokens_per_s'] / 1e6:.2f} M tok/s)",
             f"disk {row['disk_bytes_per_token']:.2f} B/tok", f"resident {row['resident_bytes_per_token']:.2f} B/tok",
             f"open {row['open_s'] * 1000:.2f} ms",
             f"propose p50 {row['propose_p50_us']:.1f} us p99 {row['propose_p99_us']:.1f} us",
             f"tree p50 {row['tree_p50_us']:.1f} us p99 {row['tree_p99_us']:.1f} us",
             f"hit {row['hit_rate']:.0%}"]
    if "linear_p50_us" in row:
        parts.append(f"linear scan p50 {row['linear_p50_us']:.0f} us p99 {row['linear_p99_us']:.0f} us "
                     f"(agree {row['linear_agree']})")
    return " | ".join(parts)


def run_corpus_bench(sizes=DEFAULT_SIZES, *, lookups: int = 20000, k: int = 8, workdir: str | None = None,
                     linear_max: int = 10**6, log=print) -> dict:
    """Run bench_size for each size; returns {"sizes": [row, ...], "machine": {...}}. Files go to `workdir`
    (a temporary directory by default) and are removed after each size."""
    real = stdlib_tokens(max(sizes))
    log(f"real text: {len(real):,} ids from the stdlib sources (vocab {VOCAB})")
    rows = []
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        for n in sizes:
            rows.append(bench_size(int(n), real, lookups=lookups, k=k, workdir=tmp, linear_max=linear_max,
                                   log=log))
    return {"sizes": rows, "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                       "numpy": np.__version__}}
