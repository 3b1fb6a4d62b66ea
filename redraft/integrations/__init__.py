"""redraft inside other serving engines.

``redraft.integrations.vllm_proposer.RedraftProposer``: redraft's corpus and n-gram drafts as a vLLM speculative
proposer (``speculative_config={"method": "custom_class", "model": "redraft.integrations.vllm_proposer.RedraftProposer",
...}``); see docs/vllm.md. Nothing here imports torch or transformers on the hot path.
"""
