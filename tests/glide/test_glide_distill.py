"""Issue 15 additions on tiny targets: the target's top-k in the records, the top-k distillation loss, the newest-entry
path of the cross-attention, training on a chosen device (CPU path), and the filters of self-written questions."""

from __future__ import annotations

import pytest
import torch
from conftest import build_tiny

from redraft.glide.config import GlideConfig
from redraft.glide.network import build_draft, init_from_target, newest_entry
from redraft.glide.positions import apply_rope, block_mask, prefix_mask
from redraft.training.data import FeatureStore, generate_records, text_records
from redraft.training.objective import collate, draft_loss
from redraft.training.selfprompt import QuestionFilter, clean_question
from redraft.training.train import TrainConfig, Trainer


@pytest.fixture(scope="module")
def tiny():
    return build_tiny("llama", "sdpa", seed=6)


@pytest.fixture(scope="module")
def recs(tiny):
    g = generate_records(tiny, [[5, 6, 7], [9, 10, 11, 12]], [1], max_new_tokens=12, qids=[0, 1], topk=4)
    t = text_records(tiny, torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1)).tolist(), [1],
                     topk=4)
    return g + t


def test_records_carry_the_targets_top_k(tiny, recs):
    for r in recs:
        with torch.no_grad():
            logp = torch.log_softmax(tiny(input_ids=r.ids[None]).logits[0].float(), -1)  # [N, V]
        top = logp.topk(4, -1)
        assert r.top_ids.shape == (len(r), 4) and r.top_logp.dtype == torch.float16
        assert torch.equal(r.top_ids.long(), top.indices)
        torch.testing.assert_close(r.top_logp.float(), top.values, atol=2e-2, rtol=2e-3)
        assert torch.equal(r.top_ids[:, 0].long(), r.labels)  # no ties in these random logits


def test_top_k_survives_the_store(tmp_path, recs):
    store = FeatureStore(tmp_path, {"x": 1})
    store.append(recs, 1.0)
    back = store.load()
    assert all(torch.equal(a.top_ids, b.top_ids) and torch.equal(a.top_logp, b.top_logp)
               for a, b in zip(recs, back, strict=True))


def _draft(tiny, **kw):
    torch.manual_seed(0)
    d = build_draft(tiny, GlideConfig.from_target(tiny.config, **kw))
    init_from_target(d, tiny)
    return d


def test_soft_loss_is_cross_entropy_against_the_renormalised_top_k(tiny, recs):
    draft = _draft(tiny)
    b = collate(recs, block=5)
    hard, n = draft_loss(draft, b, backward=False)
    mixed, _ = draft_loss(draft, b, backward=False, soft_weight=0.25)
    soft, _ = draft_loss(draft, b, backward=False, soft_weight=1.0)
    with torch.no_grad():
        logq = torch.log_softmax(draft.logits(draft(b.ids, b.pos, b.kv, b.mask))[b.rows].float(), -1)  # [n, V]
    p = b.top_p[b.rows]
    want = -(p * logq.gather(-1, b.top_ids[b.rows])).sum(-1)  # [n]
    w = b.weights[b.rows]
    assert soft == pytest.approx(float((want * w).sum() / w.sum()), rel=1e-5)
    assert mixed == pytest.approx(0.75 * hard + 0.25 * soft, rel=1e-5)
    assert soft != pytest.approx(hard, rel=1e-3)


def test_soft_loss_drops_top_k_tokens_outside_the_head(tiny, recs):
    draft = _draft(tiny)
    b = collate(recs, block=5)
    ids = torch.arange(0, 96, 2)  # a head of the even ids only
    lut = torch.full((96,), -100, dtype=torch.long)
    lut[ids] = torch.arange(len(ids))
    loss, n = draft_loss(draft, b, head=draft.head_weight[ids], lut=lut, backward=False, soft_weight=1.0)
    assert n == int((b.labels[b.rows] % 2 == 0).sum()) and loss == loss  # finite, only even labels kept


def test_newest_entry_is_the_last_visible_key_unrotated(tiny):
    draft = _draft(tiny, cross_newest=True)
    B, Hkt, T, D = 1, 2, 9, 8
    g = torch.Generator().manual_seed(2)
    raw_k, v = torch.randn(B, Hkt, T, D, generator=g), torch.randn(B, Hkt, T, D, generator=g)
    cos, sin = draft.rotary(torch.arange(T)[None], torch.float32)
    k = apply_rope(raw_k, cos, sin)  # as the target caches it: rotated at its own position
    mask = block_mask(T, T, 5, 2)[None, None]  # visible counts per query: 0,0,0,3,3,3,3,3,8
    feat = newest_entry(k, v, mask, draft.rotary, T)
    count = mask[0, 0].sum(-1)
    for i in range(T):
        if count[i] == 0:
            assert feat[0, i].abs().sum() == 0
        else:
            j = int(count[i]) - 1
            want = torch.cat((raw_k[0, :, j], v[0, :, j])).reshape(-1)
            torch.testing.assert_close(feat[0, i], want, atol=1e-5, rtol=1e-5)
    # the inference prefix mask and "everything visible" pick the same entries
    q = torch.tensor([8, 9])  # the query after the last entry sees them all
    a = newest_entry(k, v, prefix_mask(q, T)[None, None], draft.rotary, 2)
    torch.testing.assert_close(a[0, 1], newest_entry(k, v, None, draft.rotary, 1)[0, 0])


def test_newest_path_starts_at_zero_and_learns(tiny, recs, tmp_path):
    tr = Trainer(tiny, recs, TrainConfig(max_steps=6, train_vocab=0, cross_newest=True, ckpt_every=100,
                                         soft_weight=0.5, device="cpu"), tmp_path / "d")
    w = tr.draft.layers[0].cross_attn.newest.weight
    assert w.abs().sum() == 0
    tr.train(progress=False)
    assert w.abs().sum() > 0 and w.device.type == "cpu"
    meta = (tmp_path / "d" / "glide.json").read_text()
    assert '"cross_newest": true' in meta and '"device": "cpu"' in meta and '"soft_weight": 0.5' in meta


def test_batch_to_moves_every_tensor(recs):
    b = collate(recs, block=5).to("cpu")
    assert b.top_ids is not None and b.kv[0][0].device.type == "cpu"
    assert b.to(torch.device("cpu")).ids.shape == b.ids.shape


def test_question_cleaning_and_filter():
    assert clean_question('Sure, here is a question:\n"What makes bread rise when it bakes?"') == \
        "What makes bread rise when it bakes?"
    assert clean_question("Hi") is None
    assert clean_question("I'm sorry, I cannot write that for you today.") is None
    f = QuestionFilter(["Compose an engaging travel blog post about a recent trip to Hawaii, highlighting culture"])
    assert f.accept("What is the best way to water houseplants in winter?")
    assert not f.accept("what is the best way to water  houseplants in winter")  # duplicate after normalising
    assert not f.accept("Please compose an engaging travel blog post about a recent trip to Japan")  # 6-gram shared
    assert f.accept("Write a travel blog post about Japan.")


def test_run_training_with_self_questions_and_text_windows(tiny, tmp_path, monkeypatch):
    """`redraft glide train --self-questions N --text-windows M` on the tiny model: the target writes and answers
    its own questions (top-k kept), text windows are labelled, every store is used, the checkpoint says so."""
    import io
    import json
    from types import SimpleNamespace

    import redraft.io.prompts
    from redraft.training.train import run_training

    class Tok:  # the tiny model has 96 ids; map text onto them and back
        pad_token_id = 0
        eos_token_id = 1

        def __call__(self, text):
            return {"input_ids": [3 + ord(c) % 90 for c in text]}

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(f"w{i}" for i in ids)

    monkeypatch.setattr(redraft.io.prompts, "encode_prompt", lambda tok, text: tok(text)["input_ids"][:12])
    loaded = SimpleNamespace(model=tiny, tokenizer=Tok(), eos_token_ids=[])
    cfg = TrainConfig(max_steps=2, batch_tokens=300, ckpt_every=1000, train_vocab=0, soft_weight=0.5)
    state = run_training(loaded, tmp_path / "out", cfg, data_minutes=0.05, max_new_tokens=4, samples=0,
                         self_questions=6, text_windows=2, topk=3, data_dir=tmp_path / "data", progress=False,
                         command="redraft glide train --self-questions 6", log=io.StringIO())
    assert state.step == 2
    qs = json.loads((tmp_path / "data" / "self-questions.json").read_text())
    assert len(qs) == 6 and len(set(qs)) == 6
    store = FeatureStore(tmp_path / "data" / "self-k3", json.loads((tmp_path / "data" / "self-k3" / "index.json")
                                                                   .read_text())["meta"])
    recs = store.load()
    assert recs and all(r.top_ids.shape == (len(r), 3) for r in recs) and max(r.qid for r in recs) < 6
    info = json.loads((tmp_path / "out" / "glide.json").read_text())["training"]["data"]
    assert info["self_questions"] == len(recs) and info["text_windows"] == 2 and info["topk"] == 3
    assert info["command"] == "redraft glide train --self-questions 6" and "self-k3" in info["per_store"]
    assert info["per_store"]["self-k3"]["cpu_seconds"] > 0 and info["per_store"]["text-k3"]["cpu_seconds"] > 0


@pytest.mark.parametrize("argv", [["--soft-weight", "1.5"], ["--soft-weight", "nan"], ["--device", "tpu"],
                                  ["--topk", "0"], ["--self-questions", "-1"]])
def test_train_refuses_bad_new_flags(argv, capsys):
    import argparse

    from redraft.cli import glide

    parser = argparse.ArgumentParser(prog="redraft")
    glide.register(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["glide", "train", "--out", "x", *argv])
    assert argv[0] in capsys.readouterr().err


def test_train_without_cuda_refuses_device_cuda(tmp_path, monkeypatch, capsys):
    import argparse

    from redraft.cli import glide

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parser = argparse.ArgumentParser(prog="redraft")
    glide.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["glide", "train", "--out", str(tmp_path / "o"), "--device", "cuda"])
    with pytest.raises(SystemExit, match="no CUDA device"):
        args.func(args)


def test_export_is_compact_and_drafts_like_the_original(tiny, tmp_path):
    from redraft.glide.checkpoint import export_draft, load_draft, save_draft

    draft = _draft(tiny, cross_newest=True)
    torch.nn.init.normal_(draft.layers[0].cross_attn.o_proj.weight, std=0.3)
    save_draft(tmp_path / "full", draft, tiny, vocab_rank=torch.arange(96).flip(0), training={"command": "x"})
    export_draft(tmp_path / "full", tmp_path / "small", tiny)
    full, small = (tmp_path / n / "draft.safetensors" for n in ("full", "small"))
    assert small.stat().st_size < 0.6 * full.stat().st_size
    a, b = load_draft(tmp_path / "full", tiny), load_draft(tmp_path / "small", tiny, head_vocab=10)
    assert b.meta["training"]["command"] == "x" and b.cfg.cross_newest
    assert torch.equal(b.vocab_ids, torch.arange(86, 96)) and b.layers[0].mlp.up_proj.weight.dtype == torch.float32
    b.set_vocab(None)
    rec = generate_records(tiny, [[5, 6, 7, 8]], [1], max_new_tokens=10)[0]
    bt = collate([rec], block=5)
    with torch.no_grad():
        la, lb = (d.logits(d(bt.ids, bt.pos, bt.kv, bt.mask)) for d in (a, b))
    torch.testing.assert_close(la, lb, atol=5e-2, rtol=1e-2)


def test_run_uses_the_shipped_draft_by_default(tiny, tmp_path, monkeypatch):
    import argparse
    from types import SimpleNamespace

    import redraft.cli.glide_args as common
    import redraft.glide.checkpoint as ckpt
    from redraft.cli.common import add_glide_draft_args, glide_drafter_from_args

    p = argparse.ArgumentParser()
    add_glide_draft_args(p)
    args = p.parse_args(["--draft", "glide"])
    monkeypatch.setattr(common, "SHIPPED_GLIDE_DIR", tmp_path / "none")
    with pytest.raises(SystemExit, match="ships no GliDe draft"):
        glide_drafter_from_args(args, SimpleNamespace(model=tiny))
    ckpt.save_draft(tmp_path / "ship", _draft(tiny), tiny, vocab_rank=torch.arange(96), dtype=torch.float16)
    monkeypatch.setattr(common, "SHIPPED_GLIDE_DIR", tmp_path / "ship")
    assert glide_drafter_from_args(args, SimpleNamespace(model=tiny)).draft.cfg.cross_attention
    with pytest.raises(SystemExit, match="shipped GliDe draft is for the default model"):
        glide_drafter_from_args(args, SimpleNamespace(model=build_tiny("llama", "sdpa", seed=9)))


def test_gated_cross_attention_starts_closed_and_bounds_its_size(tiny, recs):
    """cross_gate: at init the draft equals its vanilla twin (zero gain) although o_proj is the target's; the
    branch's output size is then exactly its gain (RMSNorm), whatever the scale of the target's values."""
    gated, plain = _draft(tiny, cross_gate=True, cross_newest=True), _draft(tiny, cross_attention=False)
    ca = gated.layers[0].cross_attn
    assert ca.gate.weight.abs().sum() == 0 and ca.o_proj.weight.abs().sum() > 0
    b = collate(recs[:1], block=5)
    with torch.no_grad():
        torch.testing.assert_close(gated(b.ids, b.pos, b.kv, b.mask), plain(b.ids, b.pos, b.kv, b.mask))
        ca.gate.weight.fill_(0.05)
        x = torch.randn(1, b.ids.shape[1], gated.cfg.hidden_size)
        cos, sin = gated.rotary(b.pos, torch.float32)
        k, v = b.kv[0]
        out = ca(x, cos, sin, 100 * k, 100 * v, b.mask, b.pos)  # huge target values
    rms = out[0][b.mask[0, 0].any(-1)].pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.full_like(rms, 0.05), atol=1e-4, rtol=1e-3)


def test_training_gates_the_cross_attention_by_default(tiny, recs, tmp_path):
    import argparse

    from redraft.cli import glide

    parser = argparse.ArgumentParser(prog="redraft")
    glide.register(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["glide", "train", "--out", "x"]).cross_gate
    assert not parser.parse_args(["glide", "train", "--out", "x", "--no-cross-gate"]).cross_gate
    assert Trainer(tiny, recs, TrainConfig(train_vocab=0), tmp_path / "a").draft.layers[0].cross_attn.gate is not None
    ungated = Trainer(tiny, recs, TrainConfig(train_vocab=0, cross_gate=False), tmp_path / "b").draft
    assert ungated.layers[0].cross_attn.gate is None and not ungated.layers[0].cross_attn.o_proj.weight.any()
