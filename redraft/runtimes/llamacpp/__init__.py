"""The llama.cpp runtime: a GGUF file run as it is quantized (:mod:`~redraft.runtimes.llamacpp.target`), several
sequences of one context batched per step (:mod:`~redraft.runtimes.llamacpp.batching`), the load probe that runs a
file in child processes and chooses its kernels (:mod:`~redraft.runtimes.llamacpp.probe`), the library's process-wide
set-up (:mod:`~redraft.runtimes.llamacpp.lib`) and ``redraft quantize`` (:mod:`~redraft.runtimes.llamacpp.quantize`).
"""
