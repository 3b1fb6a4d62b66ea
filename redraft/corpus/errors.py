"""The one exception type of redraft.corpus."""


class CorpusError(ValueError):
    """Bad corpus input: unreadable file, malformed text or binary, ids outside the vocabulary, wrong tokenizer.

    The message always names the file (when there is one) and the problem. Raised before any Corpus is returned,
    so nothing is ever half-loaded.
    """
