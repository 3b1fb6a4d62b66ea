"""Helpers for the grammar tests: a real byte-level BPE tokenizer trained in milliseconds on JSON text (so
llguidance sees multi-byte tokens such as ``{"`` and ``":``), a tiny random Llama over its vocabulary, and a
reference constrained decoder written independently of the engine."""

from __future__ import annotations

import json

import numpy as np
import torch
from conftest import build_tiny

EOS_TEXT = "<|im_end|>"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "member", "color"],
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "member": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]}}}


def bpe_tokenizer(vocab_size: int = 320):
    """A fast byte-level BPE tokenizer (every byte is a token, plus merges learned from JSON records) with
    ChatML-style special tokens; EOS is ``<|im_end|>``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", EOS_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rows = [json.dumps({"name": n, "age": a, "member": a % 2 == 0, "color": c})
            for a, (n, c) in enumerate([("ann", "red"), ("bob", "green"), ("cy", "blue")] * 40)]
    tk.train_from_iterator(rows + ["the weather in paris is sunny today"] * 10, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token=EOS_TEXT, bos_token="<|im_start|>")


def tiny_for(tokenizer, seed: int = 5, **overrides):
    """A tiny random Llama whose vocabulary is the tokenizer's."""
    return build_tiny("llama", "sdpa", seed=seed, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                      **overrides)


def reference_constrained(model, constraint, prompt: list[int], n: int, eos: int) -> list[int]:
    """Constrained greedy decoding the simplest way: a full forward over prompt + output at every step, a fresh
    llguidance matcher fed the output so far, argmax over the allowed tokens. Independent of the engine, its
    chooser and the grammar state."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out])).logits[0, -1].double()
        m = constraint.matcher()
        assert m.consume_tokens(out) or not out
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[:logits.shape[0]].astype(bool))
        t = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        out.append(t)
        if t == eos:
            break
    return out


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def save_bpe_model(d):
    """The tiny Llama and the BPE tokenizer (with a ChatML template that does not render tools) saved in ``d``,
    loadable by ``redraft serve --model d``."""
    tok = bpe_tokenizer()
    tok.chat_template = CHATML
    tok.save_pretrained(d)
    tiny_for(tok, max_position_embeddings=1024).save_pretrained(d)  # room for the tool instructions
    return d
