"""One KV budget in tokens for the running requests and the prefix cache, and how long a refused client should wait.

A running request holds KV entries for its prompt and answer; the prefix cache holds the entries of finished ones.
Both live in the same memory, so :class:`KVBudget` bounds their sum (``--kv-tokens``). A request is admitted
with a **reservation** of its worst case, ``prompt + max_tokens`` tokens, taken only while it fits beside the
reservations already running; it is never preempted afterwards (what vLLM does when its paged KV runs out, at the
price of recomputing the preempted request). Reservations come before cached prefixes: each admission evicts the
least recently used prefix entries until the cache fits in what the reservations leave. The prefix cache keeps its
own cap too (``--prefix-cache-tokens``); the smaller bound wins.

Memory: one token of KV costs ``2 x layers x KV heads x head dim x dtype bytes`` (:func:`kv_bytes_per_token`):
46,080 bytes in float32 for the default SmolLM2-135M (30 layers, 3 KV heads of 64), so the default budget of
32,768 tokens is ~1.5 GB at most.
"""

from __future__ import annotations

import threading

DEFAULT_KV_TOKENS = 32_768


def kv_bytes_per_token(config, dtype_bytes: int = 4) -> int:
    """Bytes of KV cache one token takes in ``config``'s model (a transformers config): 2 (keys and values) x
    ``num_hidden_layers`` x ``num_key_value_heads`` (default: attention heads) x head dim x ``dtype_bytes``."""
    layers = int(getattr(config, "num_hidden_layers", 1))
    heads = int(getattr(config, "num_attention_heads", 1))
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = getattr(config, "head_dim", None) or int(getattr(config, "hidden_size", heads)) // max(1, heads)
    return 2 * layers * kv_heads * int(head_dim) * int(dtype_bytes)


KV_MEMORY_SHARE = 0.25  # the default KV budget's most share of the memory the cache lives in
KV_ROOM = 1.25  # a growing cache's memory over its tokens' at most (its room to grow)


def default_kv_tokens(context_length: int | None, *, max_running: int = 1, bytes_per_token: int | None = None,
                      memory_bytes: int | None = None) -> int:
    """The default ``--kv-tokens``: room for ``max_running`` requests at the full context (a chat request without
    max_tokens reserves up to the context's end), within :data:`KV_MEMORY_SHARE` of the machine's memory (vLLM sizes
    its KV cache from memory too), and never under :data:`DEFAULT_KV_TOKENS` nor one context (any request the context
    allows can run).

    Args:
        context_length: the model's context in tokens (None: unknown).
        max_running: requests generating at once (``--max-running``).
        bytes_per_token: the model's KV bytes a token (:func:`kv_bytes_per_token`); None: no memory bound.
        memory_bytes: the memory the cache lives in, in bytes (the machine's or container's, or a GPU's free
            memory); None: no memory bound.
    Returns:
        tokens.
    """
    context = int(context_length or 0)
    floor = max(DEFAULT_KV_TOKENS, context)
    want = max(floor, max(1, int(max_running)) * context)
    if bytes_per_token and memory_bytes:
        # a running sequence's cache keeps up to a quarter more room than its tokens (redraft.runtimes.transformers.kvcache)
        want = min(want, max(floor, int(memory_bytes * KV_MEMORY_SHARE / KV_ROOM) // int(bytes_per_token)))
    return want


class KVBudget:
    """Tokens of KV held by running requests (their reservations) plus the prefix cache, at most ``capacity``.

    Args:
        capacity: the budget in tokens (>= 1).
        prefix_cache: a :class:`~redraft.server.prefix_cache.PrefixCache` sharing the budget, or None.
    Raises:
        ValueError: capacity < 1.

    Attributes:
        reserved: tokens reserved by running requests now.
    Thread-safe: the scheduler reserves and releases from its worker threads.
    """

    def __init__(self, capacity: int, prefix_cache=None) -> None:
        if capacity < 1:
            raise ValueError(f"the KV budget must be >= 1 token, got {capacity}")
        self.capacity, self.prefix_cache = int(capacity), prefix_cache
        self.reserved = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        """Tokens in use: the running requests' reservations plus the prefix cache's entries."""
        return self.reserved + (self.prefix_cache.tokens if self.prefix_cache is not None else 0)

    def fits_ever(self, tokens: int) -> bool:
        """Whether a request needing ``tokens`` could run on an otherwise idle server."""
        return tokens <= self.capacity

    def try_reserve(self, tokens: int) -> bool:
        """Reserve ``tokens`` when they fit beside the running reservations, evicting prefix entries (least
        recently used first) so the cache fits in what is left. Returns False, changing nothing, when they do not."""
        with self._lock:
            if self.reserved + tokens > self.capacity:
                return False
            self.reserved += tokens
            room = self.capacity - self.reserved
        if self.prefix_cache is not None:
            self.prefix_cache.evict_to(room)
        return True

    def release(self, tokens: int) -> None:
        """Give back a reservation (the request ended, finished or cancelled)."""
        with self._lock:
            self.reserved = max(0, self.reserved - tokens)

    def prefix_room(self, own: int = 0) -> int:
        """Tokens the prefix cache may hold now: what the reservations leave, counting ``own`` (the reservation of
        the request handing its KV entries to the cache: they are the same memory) as free."""
        with self._lock:
            return max(0, self.capacity - self.reserved + own)


MIN_RETRY_AFTER_S = 2  # OpenAI's clients retry twice by default: two waits of 1 s often end before a place frees


def retry_after(mean_service_s: float | None, elapsed_s: list[float]) -> int:
    """Seconds a refused client should wait (``Retry-After``): until the running request expected to finish first
    is done, which frees a queue place; at least :data:`MIN_RETRY_AFTER_S`. A request already running longer than
    the mean is expected to need a quarter of the mean more (it is a long one), not to end at once.

    Args:
        mean_service_s: recent mean seconds from a request's start to its end (None: none finished yet, answer
            the minimum).
        elapsed_s: seconds each running request has run so far.
    """
    if mean_service_s is None or not elapsed_s:
        return MIN_RETRY_AFTER_S
    left = min(max(0.25 * mean_service_s, mean_service_s - e) for e in elapsed_s)
    return max(MIN_RETRY_AFTER_S, int(-(-left // 1)))
