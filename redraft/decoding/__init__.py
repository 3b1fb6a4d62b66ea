"""The decode step: the engine's loop, verify forwards, token choice, exact mode, the target model, stopping,
the model's generation_config processors and run statistics; streamed text (:mod:`redraft.decoding.textstream`);
continuous batching, several sequences' rows in one forward per step (:mod:`redraft.decoding.batching`,
:mod:`redraft.decoding.packing`; its chunks priced by :mod:`redraft.pricing.stepcost`). The verify cost curve is
measured through a :class:`~redraft.decoding.target.Target` and cached by :mod:`redraft.pricing`.

Data flows one way through it: a drafted :class:`~redraft.tree.TokenTree` -> verify forward
(:mod:`redraft.decoding.target`, :mod:`redraft.decoding.verify`) -> token choice (:mod:`redraft.decoding.sampling`)
-> accepted tokens (:mod:`redraft.decoding.engine`). It sits above the drafters and the policy and below the
composition point (:mod:`redraft.compose`) and the front ends.
"""
