"""The decode step: the engine's loop, verify forwards, token choice, exact mode, stopping, the model's
generation_config processors and run statistics; streamed text (:mod:`redraft.decoding.textstream`). The target it
drives runs in :mod:`redraft.runtimes` (transformers or llama.cpp, and their batchers); the verify cost curve is
measured through a :class:`~redraft.runtimes.base.Target` and cached by :mod:`redraft.pricing`.

Data flows one way through it: a drafted :class:`~redraft.tree.TokenTree` -> verify forward
(:mod:`redraft.runtimes`, :mod:`redraft.decoding.verify`) -> token choice (:mod:`redraft.decoding.sampling`)
-> accepted tokens (:mod:`redraft.decoding.engine`). It sits above the runtimes, the drafters and the policy and
below the composition point (:mod:`redraft.compose`) and the front ends.
"""
