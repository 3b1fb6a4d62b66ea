"""Prefix KV on disk: entries of the prefix cache that outlive the process and are shared by every process on a
corpus directory (server replicas, ``redraft run --prompts``, the Python API).

Layout, beside each tenant's learned corpus (:mod:`redraft.corpus.directory`)::

    D/<tenant>/prefix-kv/<key>/key.json          what the key digests (model, dtype, runtime and build, kernels,
                                                 threads, CPU), for an operator to read
    D/<tenant>/prefix-kv/<key>/<ids>.safetensors one entry: its token ids ("ids", int32 [n]) and its KV tensors
                                                 (a runtime's own layout; transformers':
                                                 :func:`redraft.runtimes.transformers.kvcache.kv_tensors`),
                                                 metadata: format, key, token count, XXH3-64 of every tensor
    D/prefix-kv.lock                             held by the one process evicting now (:class:`CompactionLock`)

``<key>`` digests everything that changes the numbers in a KV entry; entries of another model, dtype, build or thread
count live under another key and are never read (a copied file whose metadata names another key is refused too).
``<ids>`` digests the token ids, so two replicas that compute the same entry write one file. An entry is written under
a temporary name, synced and renamed (:func:`redraft.io.atomic.atomic_path`): a process killed while writing leaves
only a temporary, never a torn entry under a real name. A read checks the key, the token count and every tensor's
XXH3-64 (xxhash: on the first token's path, several times faster than CRC-32); an entry that fails is removed and
never used. A read refreshes the file's modification time, so the disk budgets (per directory and tenant) evict the
least recently used first, under the eviction lock. safetensors reads each tensor in one pass from a memory map. After
vLLM's filesystem KV tier and llama.cpp's slot save/restore.

What cannot be promised across builds: an entry is reused only by the same build (torch and transformers versions,
or the llama.cpp libraries), CPU model and flags, and thread count; any other process computes and writes its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from redraft.corpus.directory import tenant_dir
from redraft.corpus.lease import CompactionLock, writer_id
from redraft.io.atomic import atomic_path, is_temporary_name

log = logging.getLogger("redraft.prefix_store")

FORMAT = "redraft-prefix-kv/2"  # 2: XXH3-64 checksums (1: CRC-32, no longer read)
SUBDIR = "prefix-kv"
SUFFIX = ".safetensors"
EVICT_LOCK = "prefix-kv.lock"
MIN_TOKENS = 128  # shorter prefixes prefill in a fraction of a second: not worth a file each
QUEUE = 8  # entries waiting to be written; more are dropped (the memory cache still holds them)
STALE_TEMPORARY = 600.0  # seconds after which a temporary left by a killed writer is removed


def key_digest(fingerprint: dict) -> str:
    """The directory name of a fingerprint: 16 hex digits of SHA-256 over its sorted JSON."""
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:16]


def ids_digest(ids: Sequence[int]) -> str:
    """An entry's file stem: 32 hex digits of SHA-256 over its ids as little-endian int32."""
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()[:32]


def checksum(t: torch.Tensor) -> int:
    """XXH3-64 of a tensor's bytes (contiguous CPU tensor; bfloat16 is read as its raw 16-bit words)."""
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return xxhash.xxh3_64_intdigest(memoryview(np.ascontiguousarray(raw.numpy())).cast("B"))


@dataclass
class StoreStats:
    """Counts since start: ``hit_tokens`` prompt tokens served from disk entries, ``reads`` entries read,
    ``bytes_read``, ``writes`` entries written, ``bytes_written``, ``evictions`` entries removed by the budget (by
    this process), ``replaced`` entries removed because a written one extends them, ``rejected`` entries that failed
    their checks (removed), ``dropped`` writes skipped because the write queue was full, ``errors`` failed writes, ``too_large`` entries
    not written because one alone would exceed the directory's or the tenant's budget, ``covered`` entries not
    written because an entry on disk already shares all but fewer than ``min_tokens`` of their tokens."""

    hit_tokens: int = 0
    reads: int = 0
    bytes_read: int = 0
    writes: int = 0
    bytes_written: int = 0
    evictions: int = 0
    replaced: int = 0
    rejected: int = 0
    dropped: int = 0
    errors: int = 0
    too_large: int = 0
    covered: int = 0


class PrefixStore:
    """Prefix KV entries on disk under a corpus directory, per tenant, for one fingerprint (see the module).

    Args:
        root: the corpus directory (``--corpus-dir``).
        fingerprint: what the entries' numbers depend on (:func:`redraft.runtimes.fingerprint.kv_fingerprint`; JSON-serialisable).
        max_bytes: disk budget of all entries under ``root``, every tenant and key (bytes; > 0).
        tenant_max_bytes: budget of one tenant's entries (bytes; default ``max_bytes``).
        min_tokens: shortest entry written (tokens).
        background: True writes in a background thread (a server: a request never waits for the disk); False in
            the caller's thread (tests, one-shot commands).
    Attributes:
        stats: :class:`StoreStats`. writable: False once a write failed (disk full, read-only directory): the
            process then keeps its prefixes in memory only and says so once in the log.
    """

    def __init__(self, root, fingerprint: dict, *, max_bytes: int, tenant_max_bytes: int | None = None,
                 min_tokens: int = MIN_TOKENS, background: bool = True) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be > 0, got {max_bytes}")
        self.root, self.fingerprint = os.fspath(root), fingerprint
        self.key = key_digest(fingerprint)
        self.max_bytes = int(max_bytes)
        self.tenant_max_bytes = int(tenant_max_bytes) if tenant_max_bytes else self.max_bytes
        self.min_tokens = max(1, int(min_tokens))
        self.writer = writer_id()
        self.stats = StoreStats()
        self.writable = True
        self.entry_bytes = 0.0  # bytes per token of the last entry written (0: none yet)
        self._index: dict[str, dict[str, np.ndarray]] = {}  # tenant -> file name -> ids
        self._lock = threading.Lock()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(QUEUE)
            self._thread = threading.Thread(target=self._run, name="redraft-prefix-store", daemon=True)
            self._thread.start()

    def directory(self, tenant: str) -> str:
        """Where ``tenant``'s entries of this fingerprint live."""
        return os.path.join(tenant_dir(self.root, tenant), SUBDIR, self.key)

    # -- reading --------------------------------------------------------------------------------------------------

    def best(self, tenant: str, prompt: Sequence[int], limit: int) -> tuple[str, int]:
        """The entry of ``tenant`` sharing the longest prefix with ``prompt`` (at most ``limit`` tokens): (file
        name, shared tokens), or ("", 0) when none shares any."""
        want = np.asarray(prompt[:max(0, limit)], dtype=np.int64)
        best, best_n = "", 0
        for name, ids in self._refresh(tenant).items():
            m = min(len(ids), len(want))
            if m <= best_n:
                continue
            diff = np.flatnonzero(ids[:m] != want[:m])
            n = int(diff[0]) if len(diff) else m
            if n > best_n:
                best, best_n = name, n
        return best, best_n

    def read(self, tenant: str, name: str) -> tuple[tuple[int, ...], dict[str, torch.Tensor]] | None:
        """One entry's (ids, tensors), after checking its format, key, token count and every tensor's checksum; None
        (and the file removed) when a check fails, None when it is gone (evicted by another process)."""
        from safetensors import safe_open

        path = os.path.join(self.directory(tenant), name)
        try:
            with safe_open(path, framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
            size = os.path.getsize(path)
        except FileNotFoundError:
            self._forget(tenant, name)
            return None
        except Exception as e:  # noqa: BLE001 (a damaged header raises safetensors' own errors)
            return self._reject(tenant, name, f"unreadable ({type(e).__name__}: {e})")
        problem = self._check(meta, tensors)
        if problem:
            return self._reject(tenant, name, problem)
        ids = tensors.pop("ids")
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used: the budget evicts it last
        self.stats.reads += 1
        self.stats.bytes_read += size
        return tuple(int(t) for t in ids.tolist()), tensors

    def _check(self, meta: dict, tensors: dict[str, torch.Tensor]) -> str:
        if meta.get("format") != FORMAT:
            return f"format {meta.get('format')!r}, expected {FORMAT!r}"
        if meta.get("key") != self.key:
            return f"written for another model or build (key {meta.get('key')!r}, this process {self.key!r})"
        ids = tensors.get("ids")
        if ids is None or ids.dim() != 1 or str(ids.shape[0]) != meta.get("tokens"):
            return f"token count does not match its ids ({meta.get('tokens')!r})"
        try:
            sums = json.loads(meta.get("xxh3_64", ""))
        except ValueError:
            return "no checksums"
        if sorted(sums) != sorted(tensors):
            return "checksums do not name its tensors"
        bad = [k for k, t in tensors.items() if checksum(t) != sums[k]]
        return f"checksum mismatch in {', '.join(bad)}" if bad else ""

    def _reject(self, tenant: str, name: str, why: str) -> None:
        log.warning("prefix KV entry %s ignored and removed: %s", os.path.join(self.directory(tenant), name), why)
        self.stats.rejected += 1
        self._forget(tenant, name)
        with_suppressed_unlink(os.path.join(self.directory(tenant), name))
        return None

    def _forget(self, tenant: str, name: str) -> None:
        with self._lock:
            self._index.get(tenant, {}).pop(name, None)

    def _refresh(self, tenant: str) -> dict[str, np.ndarray]:
        """The tenant's entries now (other processes add and remove them): new files' ids read from their
        headers, vanished ones dropped."""
        from safetensors import safe_open

        d = self.directory(tenant)
        try:
            names = {e.name for e in os.scandir(d) if e.name.endswith(SUFFIX) and not is_temporary_name(e.name)}
        except OSError:
            names = set()
        with self._lock:
            known = self._index.setdefault(tenant, {})
            for gone in set(known) - names:
                del known[gone]
            new = names - set(known)
        for name in new:
            try:
                with safe_open(os.path.join(d, name), framework="np") as f:
                    ids = f.get_tensor("ids").astype(np.int64)
            except FileNotFoundError:
                continue
            except Exception as e:  # noqa: BLE001
                self._reject(tenant, name, f"unreadable ({type(e).__name__}: {e})")
                continue
            with self._lock:
                known[name] = ids
        with self._lock:
            return dict(known)

    # -- writing --------------------------------------------------------------------------------------------------

    def put(self, tenant: str, ids: Sequence[int], tensors: Callable[[], dict[str, torch.Tensor]]) -> bool:
        """Write an entry for ``tenant``: ``ids`` and the tensors ``tensors()`` returns (called in the writer
        thread, so it may copy). Skipped when shorter than ``min_tokens``, when the store is no longer writable,
        when one entry alone would exceed a budget, when an entry on disk already shares all but fewer than
        ``min_tokens`` of its tokens (requests under one system prompt or few-shot block write it once, not once
        each), or when the write queue is full. Returns whether it was queued (or written)."""
        ids = tuple(int(t) for t in ids)
        if len(ids) < self.min_tokens or not self.writable:
            return False
        if self.entry_bytes and self._too_large(len(ids) * self.entry_bytes, len(ids)):
            return False
        if self.covered(tenant, ids):
            self.stats.covered += 1  # the disk already starts it but for a short tail: not worth a file
            return False
        if self._queue is None:
            self._write(tenant, ids, tensors)
            return True
        try:
            self._queue.put_nowait((tenant, ids, tensors))
        except queue.Full:
            self.stats.dropped += 1
            return False
        return True

    def covered(self, tenant: str, ids: Sequence[int]) -> bool:
        """Whether an entry of ``tenant`` on disk already shares all but fewer than ``min_tokens`` of ``ids``."""
        return len(ids) - self.best(tenant, ids, len(ids))[1] < self.min_tokens

    def flush(self) -> None:
        """Wait until every queued entry is written."""
        if self._queue is not None:
            self._queue.join()

    def close(self) -> None:
        """Write what is queued, then stop the writer thread."""
        if self._queue is not None and self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._queue = None

    def _run(self) -> None:
        q = self._queue
        assert q is not None
        while True:
            item = q.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # noqa: BLE001 (the writer thread must outlive one bad entry)
                log.exception("prefix KV entry not written")
                self.stats.errors += 1
            finally:
                q.task_done()

    def _write(self, tenant: str, ids: tuple[int, ...], make: Callable[[], dict[str, torch.Tensor]]) -> None:
        from safetensors.torch import save_file

        d = self.directory(tenant)
        name = ids_digest(ids) + SUFFIX
        path = os.path.join(d, name)
        try:
            if os.path.exists(path):  # another process (or an earlier request) wrote the same entry
                os.utime(path)
                return
            tensors = dict(make())
            if self._too_large(sum(t.nbytes for t in tensors.values()), len(ids)):
                return
            tensors["ids"] = torch.tensor(ids, dtype=torch.int32)
            meta = {"format": FORMAT, "key": self.key, "tokens": str(len(ids)), "writer": self.writer,
                    "xxh3_64": json.dumps({k: checksum(t) for k, t in tensors.items()})}
            os.makedirs(d, exist_ok=True)
            key_file = os.path.join(d, "key.json")
            if not os.path.exists(key_file):
                with atomic_path(key_file) as tmp:
                    tmp.write_text(json.dumps(self.fingerprint, indent=2, sort_keys=True, default=str) + "\n")
            with atomic_path(path) as tmp:
                save_file(tensors, tmp, metadata=meta)
                os.chmod(tmp, 0o644)  # readable by replicas running as other users, as the journals are
        except Exception as e:  # noqa: BLE001 (OSError, or safetensors' own error on a full disk)
            self.stats.errors += 1
            if self.writable:
                self.writable = False
                why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
                log.warning("prefix KV on disk: cannot write %s (%s); prefixes are kept in memory only from now on",
                            getattr(e, "filename", None) or d, why)
            return
        self.stats.writes += 1
        size = os.path.getsize(path)
        self.stats.bytes_written += size
        self.entry_bytes = size / len(ids)  # per token, for the budget check of the next entries
        self._replace(tenant, name, ids)
        self.evict()

    def _too_large(self, nbytes: float, tokens: int) -> bool:
        """Whether an entry of ``nbytes`` alone exceeds a budget (it would evict everything and itself at once);
        counted, and said once in the log."""
        budget = min(self.max_bytes, self.tenant_max_bytes)
        if nbytes <= budget:
            return False
        self.stats.too_large += 1
        if self.stats.too_large == 1:
            log.warning("prefix KV on disk: a %d-token entry (%.0f MB) exceeds the disk budget (%.0f MB); prefixes "
                        "that long are kept in memory only", tokens, nbytes / 1e6, budget / 1e6)
        return True

    def _replace(self, tenant: str, name: str, ids: tuple[int, ...]) -> None:
        """Remove the tenant's entries that the one just written extends (a conversation keeps its latest turn)."""
        have = np.asarray(ids, dtype=np.int64)
        for other, oids in self._refresh(tenant).items():
            if other != name and len(oids) < len(have) and np.array_equal(oids, have[:len(oids)]):
                try:
                    os.unlink(os.path.join(self.directory(tenant), other))
                    self.stats.replaced += 1
                except OSError:
                    pass
                self._forget(tenant, other)

    # -- the budget -----------------------------------------------------------------------------------------------

    def usage(self, files: list[tuple[str, str, int, float]] | None = None) -> tuple[int, dict[str, int]]:
        """Bytes of entries under the root (every tenant and key) and per tenant, of ``files`` (default: now's)."""
        per: dict[str, int] = {}
        for tenant, _, size, _ in self._files() if files is None else files:
            per[tenant] = per.get(tenant, 0) + size
        return sum(per.values()), per

    def largest(self) -> int:
        """Bytes of the largest entry of this fingerprint under the root, any tenant (0: none)."""
        return max((n for _, p, n, _ in self._files() if f"{os.sep}{self.key}{os.sep}" in p), default=0)

    def _files(self) -> list[tuple[str, str, int, float]]:
        """(tenant, path, bytes, last use) of every entry under the root; stale temporaries are removed."""
        out = []
        try:
            tenants = [e.name for e in os.scandir(self.root) if e.is_dir()]
        except OSError:
            return out
        now = time.time()
        for t in tenants:
            base = os.path.join(self.root, t, SUBDIR)
            try:
                keys = [e.path for e in os.scandir(base) if e.is_dir()]
            except OSError:
                continue
            for kd in keys:
                try:
                    entries = list(os.scandir(kd))
                except OSError:
                    continue
                for e in entries:
                    try:
                        st = e.stat()
                    except OSError:
                        continue
                    if is_temporary_name(e.name):
                        if now - st.st_mtime > STALE_TEMPORARY:
                            with_suppressed_unlink(e.path)
                    elif e.name.endswith(SUFFIX):
                        out.append((t, e.path, st.st_size, st.st_mtime))
        return out

    def evict(self) -> int:
        """Remove the least recently used entries until the directory and every tenant are within budget, under
        the eviction lock (another process evicting now: nothing is done). Returns the entries removed."""
        files = self._files()
        total, per = self.usage(files)
        if total <= self.max_bytes and all(v <= self.tenant_max_bytes for v in per.values()):
            return 0
        lock = CompactionLock(self.root, self.writer, name=EVICT_LOCK)
        try:
            if not lock.acquire():
                return 0
        except OSError:
            return 0
        removed = 0
        try:
            for t, path, size, _ in sorted(files, key=lambda f: f[3]):
                if total <= self.max_bytes and per[t] <= self.tenant_max_bytes:
                    continue
                if with_suppressed_unlink(path):
                    total, per[t], removed = total - size, per[t] - size, removed + 1
        finally:
            lock.release()
        self.stats.evictions += removed
        return removed


def with_suppressed_unlink(path: str) -> bool:
    """Remove ``path``; False when it was already gone or cannot be removed."""
    with contextlib.suppress(OSError):
        os.unlink(path)
        return True
    return False
