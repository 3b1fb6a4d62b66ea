"""Prefix KV reuse across requests: the target's KV entries of recent sequences (prompt + answer), per tenant.

Agent loops and chat clients resend the whole conversation with every request; each new prompt begins with the
previous prompt and its answer. Serving peers keep the KV entries of such common prefixes (vLLM's automatic prefix
caching, SGLang's RadixAttention, llama.cpp's slot cache) so only the new tail is prefilled. :class:`PrefixCache`
does that for ``redraft serve``:

- **One store** for the whole server, keyed by (tenant, token ids): a request starts from the longest cached
  prefix of its prompt among its own tenant's entries. One tenant's entries never serve another's (a shared
  prefix cache leaks prompts through timing: PromptPeek). The store holds no per-request state, so concurrent
  requests read and fill the same store (methods take a lock).
- **Bounded** by a token budget over all tenants (``--prefix-cache-tokens``), and by what running requests leave
  of the server's KV budget (:mod:`redraft.server.admission`): least recently used entries are evicted first. An
  entry that a new one extends (its ids are a prefix of the new ids) is replaced by it, so a
  conversation holds one entry, its latest turn.
- **Exact**: the entries were computed by other forward shapes than plain decoding of the new prompt would use,
  so the engine judges rows computed on them like verify rows (see ``Engine.generate(prefix=...)``).

- **Durable** with a :class:`~redraft.runtimes.prefix_store.PrefixStore` (``--corpus-dir``): every entry stored
  is also written to disk beside the tenant's corpus, and a lookup whose longest prefix is on disk (written before
  a restart, or by another replica on the directory) reads it there and keeps it in memory from then on.

Memory: an entry costs ``2 x layers x kv_heads x head_dim x dtype bytes`` per token (46 KB in float32 for the
default SmolLM2-135M: 16,384 tokens take ~750 MB).

A runtime that keeps one sequence in a KV cache of its own (llama.cpp) has no entries to copy out: there
:class:`HeldPrefix` stands in for the store, as llama.cpp's server reuses its slot's cache: a request starts from
the longest common prefix of its prompt and the tokens the target still holds from the previous request, which the
server only leaves in place for a request of the same tenant (:meth:`redraft.server.generation.Generator.new_target`
empties it for another tenant's).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from redraft.decoding.engine import GenerationResult
from redraft.runtimes.prefix_store import PrefixStore
from redraft.runtimes.transformers.kvcache import kv_entry, kv_tensors
from redraft.runtimes.transformers.target import HFTarget, PrefixKV

log = logging.getLogger("redraft.server")


@dataclass
class PrefixCacheStats:
    """Counts since start: ``queries`` prompt tokens looked up, ``hits`` prompt tokens served from the store,
    ``evictions`` entries evicted by the budget, ``replaced`` entries replaced by an extension of themselves."""

    queries: int = 0
    hits: int = 0
    evictions: int = 0
    replaced: int = 0


class PrefixCache:
    """KV entries of recent sequences per tenant, least recently used evicted beyond ``max_tokens``.

    Args:
        max_tokens: token budget over all entries of all tenants (0 = store nothing).
        min_hit: shortest prefix worth reusing, in tokens (shorter matches start from an empty cache).
        disk: entries on disk (see the module docstring), or None: memory only.
        layers, dtype: the model's decoder layers and KV dtype (checked on every entry read from ``disk``).

    Attributes:
        stats: :class:`PrefixCacheStats`. tokens: tokens held now.
    """

    def __init__(self, max_tokens: int, min_hit: int = 1, disk: PrefixStore | None = None, layers: int = 0,
                 dtype=None) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens, self.min_hit = int(max_tokens), max(1, int(min_hit))
        self.disk, self.layers, self.dtype = disk, int(layers), dtype
        self.entries: OrderedDict[tuple[str, tuple[int, ...]], PrefixKV] = OrderedDict()  # oldest first
        self.tokens = 0
        self.stats = PrefixCacheStats()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.entries)

    def lookup(self, tenant: str, prompt: Sequence[int]) -> PrefixKV | None:
        """The longest cached prefix of ``prompt`` among ``tenant``'s entries, in memory or on disk (an entry read
        from disk stays in memory after), cut to leave at least one prompt token to feed (the engine needs a row to
        choose the first token from); None when shorter than ``min_hit``. The entry used becomes the most recently
        used. Counts ``len(prompt)`` queried tokens and the hit."""
        prompt = [int(t) for t in prompt]
        with self.lock:
            self.stats.queries += len(prompt)
            best, best_n = None, 0
            for key, entry in self.entries.items():
                if key[0] != tenant:
                    continue
                n = common_prefix(entry.ids, prompt, limit=len(prompt) - 1)
                if n > best_n:
                    best, best_n = key, n
        found = self._from_disk(tenant, prompt, best_n) if self.disk is not None else None
        if found is not None:
            return found
        with self.lock:
            if best is None or best_n < self.min_hit or best not in self.entries:
                return None
            self.entries.move_to_end(best)
            entry = self.entries[best]
            self.stats.hits += best_n
        return cut(entry, best_n)

    def _from_disk(self, tenant: str, prompt: list[int], have: int) -> PrefixKV | None:
        """The disk's entry for ``prompt`` when it shares more than ``have`` tokens (and at least ``min_hit``),
        cut to them; None otherwise or when it fails its checks."""
        assert self.disk is not None
        name, n = self.disk.best(tenant, prompt, len(prompt) - 1)
        if n <= have or n < max(self.min_hit, self.disk.min_tokens):  # a short overlap is not worth a read
            return None
        got = self.disk.read(tenant, name)
        if got is None:
            return None
        try:
            entry = kv_entry(got[0], got[1], self.layers, self.dtype)
        except ValueError as e:
            log.warning("prefix KV entry %s of tenant %s ignored: %s", name, tenant, e)
            return None
        if entry.ids[:n] != tuple(prompt[:n]):
            return None
        self._keep(tenant, PrefixKV(entry.ids, entry.kv), None)  # in memory from now on: later hits are memory's
        with self.lock:
            self.stats.hits += n
        self.disk.stats.hit_tokens += n
        return cut(entry, n)

    def store(self, tenant: str, entry: PrefixKV, room: int | None = None) -> None:
        """Keep ``entry`` for ``tenant`` as the most recently used; drop the tenant's entries it extends, then the
        least recently used entries of any tenant until the budget holds. An entry longer than the whole budget
        is not kept. ``room``: a tighter budget for now (the tokens a shared KV budget leaves the cache, see
        :class:`~redraft.server.admission.KVBudget`); None = ``max_tokens``. An entry computed here is also written
        to ``disk`` (in its writer thread), whatever the memory budget keeps."""
        if self.disk is not None and entry.origin != "disk" and entry.length:
            self.disk.put(tenant, entry.ids, lambda: kv_tensors(entry))
        self._keep(tenant, entry, room)

    def _keep(self, tenant: str, entry: PrefixKV, room: int | None) -> None:
        """:meth:`store` in memory only."""
        limit = self.max_tokens if room is None else min(self.max_tokens, max(0, int(room)))
        if entry.length == 0 or entry.length > limit:
            return
        with self.lock:
            for key in [k for k in self.entries if k[0] == tenant and len(k[1]) <= entry.length
                        and entry.ids[:len(k[1])] == k[1]]:
                self.tokens -= len(key[1])
                del self.entries[key]
                self.stats.replaced += 1
            self.entries[(tenant, entry.ids)] = entry
            self.tokens += entry.length
            self._evict(limit)

    def evict_to(self, limit: int) -> None:
        """Evict least recently used entries (any tenant) until at most ``limit`` tokens are held."""
        with self.lock:
            self._evict(max(0, int(limit)))

    def _evict(self, limit: int) -> None:
        while self.tokens > limit and self.entries:
            (_, ids), _ = self.entries.popitem(last=False)
            self.tokens -= len(ids)
            self.stats.evictions += 1

    def tenant_tokens(self, tenant: str) -> int:
        """Tokens held for ``tenant``."""
        with self.lock:
            return sum(len(ids) for t, ids in self.entries if t == tenant)


class HeldPrefix:
    """The prefix cache of a target that runs one sequence in its own KV cache (llama.cpp's): the tokens it holds.

    The same methods as :class:`PrefixCache`, so the generator, the KV budget and the metrics use it unchanged.
    :meth:`lookup` names the longest common prefix of the prompt and ``target.ids`` (what the target's cache holds
    now, left by the previous request); :meth:`~redraft.runtimes.transformers.target.Target.seed` then keeps those positions and
    drops the rest, recomputing nothing. Tenants never share it: the generator empties the target before a request
    of another tenant than the previous one. It holds no memory beyond the target's own cache, which the running
    request's reservation covers: ``tokens`` is 0 and eviction has nothing to free.

    With a :class:`~redraft.runtimes.prefix_store.PrefixStore`, :meth:`store` also writes the sequence's state
    (llama.cpp's ``llama_state_seq_get_data``) to disk, and :meth:`lookup` loads a longer prefix from there into
    the target (``llama_state_seq_set_data``): after a restart, or one another replica wrote.

    Args:
        target: the shared target (``ids``, ``length``, ``snapshot``; with ``disk`` also ``crop``,
            ``save_state`` and ``load_state``).
        max_tokens: most held tokens one request may start from (0 = none).
        min_hit: shortest prefix worth reusing, in tokens.
        disk: entries on disk, or None.
    Attributes:
        stats: :class:`PrefixCacheStats` (``evictions`` and ``replaced`` stay 0). tokens: 0 (see above).
    """

    tokens = 0

    def __init__(self, target, max_tokens: int, min_hit: int = 1, disk: PrefixStore | None = None) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.target, self.max_tokens, self.min_hit = target, int(max_tokens), max(1, int(min_hit))
        self.disk = disk
        self.stats = PrefixCacheStats()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return 1 if self.target.length else 0

    def lookup(self, tenant: str, prompt: Sequence[int]) -> PrefixKV | None:
        """The longest common prefix of ``prompt`` and the held tokens (at most ``max_tokens``, leaving at least one
        prompt token to feed), or of ``prompt`` and an entry of ``tenant`` on disk when that is longer (loaded into
        the target); None when shorter than ``min_hit``. The held tokens are the current request's tenant's (see
        the class docstring)."""
        prompt = [int(t) for t in prompt]
        limit = min(len(prompt) - 1, self.max_tokens)
        with self.lock:
            self.stats.queries += len(prompt)
            held = self.target.ids[:self.target.length]
            n = common_prefix(held, prompt, limit=limit)
            origin = "memory"
            if self.disk is not None:
                name, n_disk = self.disk.best(tenant, prompt, limit)
                if n_disk > n and n_disk >= max(self.min_hit, self.disk.min_tokens) and self._load(tenant, name):
                    n, origin = n_disk, "disk"
                    self.disk.stats.hit_tokens += n
            if n < self.min_hit:
                return None
            self.stats.hits += n
        entry = self.target.snapshot(prompt[:n])
        return PrefixKV(entry.ids, entry.kv, origin=origin)

    def _load(self, tenant: str, name: str) -> bool:
        """Load a disk entry's state into the target; False (the target then empty) when it cannot be used."""
        assert self.disk is not None
        got = self.disk.read(tenant, name)
        if got is None or "state" not in got[1]:
            return False
        try:
            self.target.load_state(got[0], got[1]["state"].numpy().tobytes())
        except Exception as e:  # noqa: BLE001 (the runtime's own error type; the request then prefills)
            log.warning("prefix KV entry %s of tenant %s not loaded: %s", name, tenant, e)
            return False
        return True

    def store(self, tenant: str, entry: PrefixKV, room: int | None = None) -> None:
        """Nothing to keep in memory: the target's cache still holds the entry's tokens until the next request. With
        ``disk``, the sequence's state of the entry's tokens is copied now and written in the store's thread."""
        if self.disk is None or entry.length < self.disk.min_tokens or not self.disk.writable:
            return
        if self.disk.covered(tenant, entry.ids):
            return  # the disk already starts it (PrefixStore.put would skip it): no state copy
        self.target.crop(entry.length)  # tokens past the entry (cut by a stop) are never reused
        state = self.target.save_state()
        self.disk.put(tenant, entry.ids, lambda: {"state": torch.frombuffer(bytearray(state), dtype=torch.uint8)})

    def evict_to(self, limit: int) -> None:
        """Nothing to free: the held tokens are in the memory the next request runs in."""

    def tenant_tokens(self, tenant: str) -> int:
        """0: the held tokens take no memory of their own (see the class docstring)."""
        return 0


def generate_cached(engine, cache: PrefixCache | HeldPrefix | None, tenant: str, ids: list[int], n: int,
                    **kw) -> GenerationResult:
    """One generation as a process without a step loop runs it (``redraft run``, the Python API): ``engine.generate``
    from ``cache``'s longest prefix of ``ids`` for ``tenant``, then prompt + answer remembered (``cache`` None: a
    plain ``engine.generate``). ``kw``: :meth:`~redraft.decoding.engine.Engine.generate`'s."""
    hit = cache.lookup(tenant, ids) if cache is not None else None
    res = engine.generate(ids, n, prefix=hit, **kw)
    if cache is not None:
        remember(cache, tenant, engine.target, res)
    return res


def open_prefix_cache(model, max_tokens: int, directory=None, *, disk_bytes: int = 0,
                      tenant_bytes: int | None = None, background: bool = True) -> PrefixCache | HeldPrefix:
    """The prefix cache of ``model``: a :class:`PrefixCache` for a transformers causal LM, a :class:`HeldPrefix`
    for a target that keeps one sequence in its own cache (llama.cpp's); with ``directory`` (a corpus directory)
    and ``disk_bytes`` > 0 its entries are also kept on disk there
    (:class:`~redraft.runtimes.prefix_store.PrefixStore`, ``tenant_bytes`` per tenant, ``background`` writes).

    Raises:
        ValueError: max_tokens < 0.
    """
    disk = None
    if directory is not None and disk_bytes > 0:
        from redraft.runtimes.fingerprint import kv_fingerprint

        disk = PrefixStore(directory, kv_fingerprint(model), max_bytes=disk_bytes, tenant_max_bytes=tenant_bytes,
                           background=background)
    if getattr(model, "runtime", "transformers") != "transformers":
        return HeldPrefix(model, max_tokens, disk=disk)
    return PrefixCache(max_tokens, disk=disk, layers=model.config.num_hidden_layers,
                       dtype=next(model.parameters()).dtype)


def cut(entry: PrefixKV, n: int) -> PrefixKV:
    """``entry``'s first ``n`` positions (views; the entry itself when it holds exactly ``n``)."""
    if n == entry.length:
        return entry
    return PrefixKV(entry.ids[:n], tuple((k[:, :, :n], v[:, :, :n]) for k, v in entry.kv), origin=entry.origin)


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """Length of the longest common prefix of two id sequences, at most ``limit``."""
    n = min(len(a), len(b), len(a) if limit is None else max(0, limit))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(diff[0]) if len(diff) else n


def remember(cache: PrefixCache, tenant: str, target: HFTarget, result: GenerationResult,
             room: int | None = None) -> int:
    """Store the target's KV entries of ``result``'s prompt + output after a generation; returns the tokens kept.

    After ``Engine.generate`` the target's cache holds the committed sequence, except the last emitted token
    (no forward has read it yet) and perhaps accepted tokens that a stop cut from the output: the entry is the
    cached positions that belong to prompt + output. ``room``: as :meth:`PrefixCache.store`.
    """
    ids = list(result.prompt_ids) + list(result.output_ids)
    n = min(target.length, len(ids))
    if n <= 0 or cache.max_tokens <= 0:
        return 0
    cache.store(tenant, target.snapshot(ids[:n]), room)
    return n
