"""The corpora a server drafts from: one learned :class:`OnlineCorpus` per tenant, plus fixed shared files.

Layout of ``--corpus-dir DIR`` (:mod:`redraft.corpus.directory`, shared with the vLLM proposer): ``DIR/meta.json``
(the tokenizer fingerprint and vocabulary size the corpora were made with) and ``DIR/<tenant>/`` (that tenant's
journal and binary base, see :mod:`redraft.corpus.online`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from redraft.corpus import Corpus, CorpusError, load_corpus
from redraft.corpus.directory import check_meta, tenant_dir
from redraft.corpus.online import OnlineCorpus


class CorporaError(ValueError):
    """The corpus directory or a shared corpus file cannot be used; the message names it."""


class TenantCorpora:
    """Each tenant's learned corpus (None with ``learn=False``) and the shared read-only corpus (or None).

    Args:
        tenants: tenant names; each gets its corpus now (a persisted one is replayed here).
        directory: ``--corpus-dir`` or None (learned corpora live in memory only).
        vocab_size, fingerprint: the model's; a directory made for another tokenizer is refused.
        cap_tokens: per-tenant cap on learned ids (see :class:`OnlineCorpus`).
        sync: fsync each journal record before a response completes.
        learn: False serves from the shared corpus only.
        shared: paths of fixed corpus files every tenant drafts from (merged, in order).
        compact_tokens: journal ids that start a compaction (see :class:`OnlineCorpus`; None: its default).
        warn: one line per problem found while opening (a damaged journal tail, say).
    Raises:
        CorporaError: unusable directory, meta.json of another tokenizer, or a shared file that is refused.
    """

    def __init__(self, tenants: Sequence[str], directory: str | None, *, vocab_size: int,
                 fingerprint: str | None, cap_tokens: int | None, sync: bool = True, learn: bool = True,
                 shared: Sequence[str] = (), warn: Callable[[str], None] | None = None,
                 compact_tokens: int | None = None) -> None:
        self.directory, self.learn = directory, learn
        kw = {} if warn is None else {"warn": warn}
        if directory is not None and learn:
            _check_meta(directory, vocab_size, fingerprint)
        self.learned: dict[str, OnlineCorpus] = {}
        if learn:
            for t in tenants:
                path = tenant_dir(directory, t) if directory is not None else None
                try:
                    self.learned[t] = OnlineCorpus(path, vocab_size=vocab_size, fingerprint=fingerprint,
                                                   cap_tokens=cap_tokens, sync=sync, compact_tokens=compact_tokens,
                                                   **kw)
                except CorpusError as e:
                    self.close()
                    raise CorporaError(f"--corpus-dir {e}") from e
        self.shared = _load_shared(shared, vocab_size, fingerprint)

    def get(self, tenant: str) -> OnlineCorpus | None:
        return self.learned.get(tenant)

    def learn_span(self, tenant: str, span: Sequence[int]) -> bool:
        """Learn a finished generation (prompt + output ids) into the tenant's corpus unless it already holds them
        (:meth:`OnlineCorpus.learn`). Returns whether the corpus grew; False when not learning. Raises OSError
        (journal write) or CorpusError (id outside the vocabulary); the corpus is then unchanged."""
        c = self.learned.get(tenant)
        return c.learn(span) if c is not None else False

    def close(self) -> None:
        for c in self.learned.values():
            c.close()


def _check_meta(directory: str, vocab_size: int, fingerprint: str | None) -> None:
    try:
        check_meta(directory, vocab_size, fingerprint)
    except CorpusError as e:
        raise CorporaError(f"--corpus-dir {e}") from e


def _load_shared(paths: Sequence[str], vocab_size: int, fingerprint: str | None) -> Corpus | None:
    if not paths:
        return None
    corpora = []
    for p in paths:
        try:
            corpora.append(load_corpus(p, vocab_size=vocab_size, fingerprint=fingerprint))
        except CorpusError as e:
            raise CorporaError(f"--corpus {p} refused: {e}") from e
    if len(corpora) == 1:
        return corpora[0]
    return Corpus.from_spans([s for c in corpora for s in c.span_list()], vocab_size=vocab_size,
                             fingerprint=fingerprint)
