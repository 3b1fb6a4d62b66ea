"""redraft.corpus: frozen-corpus drafts (numpy only, no torch).

A corpus holds token spans from earlier outputs; `Corpus.propose` finds the longest suffix of the live context in
it and returns what followed its most recent occurrence (after Colibri's COLI_DRAFT_CORPUS), in microseconds at
10^8 tokens thanks to a suffix array over the reversed stream (pydivsufsort).
"""

from .branches import Branches
from .corpus import Corpus, load_corpus
from .errors import CorpusError
from .fingerprint import tokenizer_fingerprint

__all__ = ["Branches", "Corpus", "CorpusError", "load_corpus", "tokenizer_fingerprint"]
