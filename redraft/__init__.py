"""redraft: lossless speculative decoding for Hugging Face causal language models.

Drafts come from a frozen corpus of earlier outputs, from the live context (n-gram / prompt lookup) and,
optionally, from a GliDe draft model; the target model verifies every proposal in one forward pass and keeps
only what it would have produced anyway.

Python API (imported on first use, so ``import redraft`` loads no torch)::

    from redraft import Redraft
    rd = Redraft.from_pretrained("path/to/model", corpus="answers.corpus")
    out = rd.generate("prompt")            # .ids, .text, .stats

and :func:`redraft.hf.custom_generate` for transformers' ``model.generate(..., custom_generate=...)``.
"""

__version__ = "0.1.0"

__all__ = ["Redraft", "SpeculationConfig", "custom_generate"]


def __getattr__(name: str):
    if name == "Redraft":
        from redraft.api import Redraft

        return Redraft
    if name == "SpeculationConfig":
        from redraft.compose import SpeculationConfig

        return SpeculationConfig
    if name == "custom_generate":
        from redraft.hf import custom_generate

        return custom_generate
    raise AttributeError(f"module 'redraft' has no attribute {name!r}")
