"""The grammar package's error type (its own module, so the constraint and the state both import it)."""


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile, or a grammar the vocabulary cannot spell; the message says
    what is wrong."""
