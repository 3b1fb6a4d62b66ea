"""Where the target model runs: one folder per runtime behind the interface of :mod:`redraft.runtimes.base`.

- :mod:`redraft.runtimes.transformers`: any Hugging Face causal LM in torch (:class:`HFTarget`, its in-place KV cache,
  continuous batching of several sequences' rows in one packed forward);
- :mod:`redraft.runtimes.llamacpp`: a GGUF file on llama.cpp as it is quantized (the target, several sequences of
  one context, the load probe that chooses its kernels in a child process, ``redraft quantize``);
- :mod:`redraft.runtimes.sequence`: the step-function protocol between the decode loop and a runtime's batcher (a
  sequence asks for one forward at a time).

Data flows one way: the decode loop (:mod:`redraft.decoding`) drives a target through these modules; nothing here
imports the loop. :func:`redraft.compose.runtime.load_target` picks the runtime.
"""
