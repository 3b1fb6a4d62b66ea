"""redraft: lossless speculative decoding for Hugging Face causal language models.

Drafts come from a frozen corpus of earlier outputs, from the live context (n-gram / prompt lookup) and,
optionally, from a GliDe draft model; the target model verifies every proposal in one forward pass and keeps
only what it would have produced anyway.
"""

__version__ = "0.1.0"
