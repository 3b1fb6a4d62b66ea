"""The transformers runtime: :class:`~redraft.runtimes.transformers.target.HFTarget` (a causal LM behind the target
interface), its KV cache layers that append in place (:mod:`~redraft.runtimes.transformers.kvcache`), and continuous
batching, several sequences' rows in one packed forward per step (:mod:`~redraft.runtimes.transformers.batching`,
:mod:`~redraft.runtimes.transformers.packing`)."""
