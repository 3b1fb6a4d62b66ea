"""Tokenizer fingerprints: which tokenizer made a corpus, without importing transformers."""

from __future__ import annotations

import hashlib
import json


def tokenizer_fingerprint(tokenizer) -> str:
    """Short stable hash of a tokenizer's vocabulary and special tokens, e.g. 'sha256:3f1c9a0b2d4e6f81'.

    Duck-types a Hugging Face tokenizer: `get_vocab()` (token -> id) and, when present, `all_special_tokens`
    and `all_special_ids`. Two tokenizers with the same token->id map and the same special tokens get the same
    fingerprint, so a corpus frozen with one drafts correctly for the other. Raises TypeError if the object has
    no get_vocab().
    """
    if not hasattr(tokenizer, "get_vocab"):
        raise TypeError(f"{type(tokenizer).__name__} has no get_vocab(); not a tokenizer")
    vocab = tokenizer.get_vocab()
    specials = list(getattr(tokenizer, "all_special_tokens", []) or [])
    special_ids = [int(i) for i in (getattr(tokenizer, "all_special_ids", []) or [])]
    payload = {
        "vocab": sorted((str(tok), int(i)) for tok, i in vocab.items()),
        "special_tokens": sorted(str(t) for t in specials),
        "special_ids": sorted(special_ids),
    }
    digest = hashlib.sha256(json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()
    return "sha256:" + digest[:16]
