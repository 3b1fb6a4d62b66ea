"""GliDe training on tiny targets: data records, the loss falls, checkpoints round-trip, wrong targets are refused."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import build_tiny

from redraft.glide.checkpoint import CheckpointError, TargetMismatchError, load_draft, save_draft, target_fingerprint
from redraft.glide.config import GlideConfig
from redraft.glide.network import build_draft
from redraft.training.data import (
    FeatureStore,
    batches_by_length,
    generate_records,
    is_held_out,
    load_questions,
    text_records,
    training_order,
    vocab_ranking,
)
from redraft.training.objective import collate, draft_loss, estimate_acceptance
from redraft.training.train import TrainConfig, Trainer, lr_at


@pytest.fixture(scope="module")
def tiny():
    return build_tiny("llama", "sdpa", seed=4)


@pytest.fixture(scope="module")
def records(tiny):
    g = torch.Generator().manual_seed(0)
    return text_records(tiny, torch.randint(0, 96, (6, 30), generator=g).tolist(), [1])


@pytest.fixture(scope="module")
def heldout(tiny):
    return generate_records(tiny, [[5, 6, 7], [9, 10, 11, 12, 13]], [1], max_new_tokens=25, qids=[0, 1])


def test_generated_records_carry_the_targets_choices_and_cache(tiny, heldout):
    from transformers import DynamicCache

    for r in heldout:
        n = len(r)
        assert r.labels.shape == r.ids.shape and r.k.shape == (1, 2, n, 8) and r.k.dtype == torch.float16
        # generated part: each input is the previous position's label (the target's own greedy path)
        assert torch.equal(r.ids[r.gen_start:], r.labels[r.gen_start - 1:n - 1])
        cache = DynamicCache(config=tiny.config)
        with torch.no_grad():
            out = tiny(input_ids=r.ids[None], cache=cache, use_cache=True)
        assert torch.equal(out.logits[0].argmax(-1), r.labels)
        torch.testing.assert_close(r.k[0].float(), cache.layers[1].keys[0], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(r.v[0].float(), cache.layers[1].values[0], atol=2e-3, rtol=2e-3)


def test_sampled_records_keep_greedy_labels(tiny, heldout):
    """Sampled answers are new contexts, but every label is still the target's greedy choice there."""
    from transformers import DynamicCache

    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    a = generate_records(tiny, prompts, [1], max_new_tokens=25, temperature=1.0, seed=3)
    b = generate_records(tiny, prompts, [1], max_new_tokens=25, temperature=1.0, seed=3)
    assert all(torch.equal(x.ids, y.ids) for x, y in zip(a, b, strict=True))  # seeded: reproducible
    assert any(not torch.equal(x.ids, g.ids) for x, g in zip(a, heldout, strict=True))  # not the greedy path
    for r in a:
        with torch.no_grad():
            out = tiny(input_ids=r.ids[None], cache=DynamicCache(config=tiny.config), use_cache=True)
        assert torch.equal(out.logits[0].argmax(-1), r.labels)


def test_feature_store_round_trip(tmp_path, records, heldout):
    meta = {"fingerprint": "x", "layers": [1], "max_new_tokens": 25}
    store = FeatureStore(tmp_path, meta)
    store.append(records[:3], 1.0)
    store.append(heldout, 2.0)
    back = FeatureStore(tmp_path, meta).load()
    assert len(back) == 5 and FeatureStore(tmp_path, meta).done_questions == {0, 1}
    for a, b in zip(records[:3] + heldout, back, strict=True):
        assert torch.equal(a.ids, b.ids) and torch.equal(a.labels, b.labels) and torch.equal(a.k, b.k)
        assert a.gen_start == b.gen_start and a.qid == b.qid
    with pytest.raises(ValueError):
        FeatureStore(tmp_path, dict(meta, fingerprint="y"))


def test_question_split_holds_out_every_tenth():
    qs = load_questions()
    order = training_order(qs)
    assert len(order) == len(set(order)) == len(qs) - len(qs) // 10
    assert not any(is_held_out(i) for i in order)
    cats = [qs[i]["category"] for i in order[:6]]
    assert len(set(cats)) == 6  # round-robin: the first six come from six different groups


def test_batches_by_length_respects_the_budget():
    lengths = [5, 50, 7, 48, 6, 49, 100]
    batches = batches_by_length(list(range(7)), lengths, max_tokens=120, max_batch=3)
    assert sorted(i for b in batches for i in b) == list(range(7))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 120


def test_collate_masks_and_rows(records):
    b = collate(records[:2], block=5)
    S = len(records[0])
    assert b.ids.shape == (2, S) and b.mask.shape == (1, 1, S, S)
    assert not b.rows[:, :5].any() and b.rows[:, 5:].all()
    assert b.kv[0][0].shape == (2, 2, S, 8) and b.kv[0][0].dtype == torch.float32
    shifted = collate(records[:1], block=5, offset=3)
    assert not shifted.rows[0, :2].any() and shifted.rows[0, 2:].all()


def test_prompt_weight(records, tiny):
    assert collate(records[:2], prompt_weight=0.0).n_tokens == 0  # text windows are all "prompt"
    r = generate_records(tiny, [list(range(20, 32))], [1], max_new_tokens=10)[0]
    b = collate([r], prompt_weight=0.0)
    g = r.gen_start - 1
    assert not b.rows[0, :g].any() and b.rows[0, max(g, 5):].all()
    half = collate([r], prompt_weight=0.5)
    assert half.weights[0, :g].eq(0.5).all() and half.weights[0, g:].eq(1.0).all()
    draft = build_draft(tiny, GlideConfig.from_target(tiny.config))
    loss_all, n_all = draft_loss(draft, collate([r]), backward=False)
    loss_gen, n_gen = draft_loss(draft, b, backward=False)
    assert n_gen < n_all and loss_gen != loss_all


def test_vocab_ranking_orders_by_frequency(records):
    rank = vocab_ranking(96, records)
    assert sorted(rank.tolist()) == list(range(96))
    counts = torch.bincount(torch.cat([r.labels for r in records]), minlength=96)
    assert (counts[rank][:-1] >= counts[rank][1:]).all()


def test_lr_schedule():
    cfg = TrainConfig(lr=1e-3, warmup=10, max_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4) and lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(0.55e-3) and lr_at(110, cfg) == pytest.approx(1e-4)


@pytest.mark.parametrize("vanilla", [False, True])
def test_a_few_steps_lower_the_loss(tiny, records, heldout, tmp_path, vanilla):
    torch.manual_seed(0)
    cfg = TrainConfig(max_steps=25, lr=3e-3, warmup=2, batch_tokens=100, ckpt_every=1000, vanilla=vanilla,
                      offset_jitter=False)
    tr = Trainer(tiny, records, cfg, tmp_path, heldout=heldout, vocab_rank=vocab_ranking(96, records))
    batch = collate(records, block=5)

    def loss():
        with torch.no_grad():
            return draft_loss(tr.draft, batch, backward=False)[0]

    before = loss()
    state = tr.train(progress=False)
    assert state.step == 25 and loss() < 0.7 * before
    assert (tmp_path / "glide.json").is_file() and (tmp_path / "optimizer.safetensors").is_file()
    est = state.history[-1]
    assert 0.0 <= est["acceptance"] <= 1.0 and est["blocks"] > 0


def test_reduced_vocabulary_loss(tiny, records, tmp_path):
    rank = vocab_ranking(96, records)
    cfg = TrainConfig(max_steps=2, batch_tokens=100, train_vocab=40)
    tr = Trainer(tiny, records, cfg, tmp_path, vocab_rank=rank)
    assert tr.head.shape == (40, 32)
    loss, n = draft_loss(tr.draft, collate(records, block=5), head=tr.head, lut=tr.lut, backward=False)
    in_head = torch.isin(torch.cat([r.labels[5:] for r in records]), rank[:40])
    assert n == int(in_head.sum()) and loss > 0


def test_resume_continues_where_it_stopped(tiny, records, tmp_path):
    cfg = TrainConfig(max_steps=6, lr=2e-3, warmup=1, batch_tokens=100, ckpt_every=3)
    full = Trainer(tiny, records, cfg, tmp_path / "a")
    full.train(progress=False)
    half = Trainer(tiny, records, cfg, tmp_path / "b")
    half.train(progress=False, until=3)
    again = Trainer(tiny, records, cfg, tmp_path / "b")
    again.resume()
    assert again.state.step == 3 and len(again.opt.state) > 0
    again.train(progress=False)
    assert again.state.step == 6
    for (n, p), (_, q) in zip(full.draft.named_parameters(), again.draft.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=n)


def test_checkpoint_round_trip_and_head_size(tiny, records, tmp_path):
    draft = build_draft(tiny, GlideConfig.from_target(tiny.config))
    rank = vocab_ranking(96, records)
    save_draft(tmp_path, draft, tiny, vocab_rank=rank, training={"steps": 0})
    meta = json.loads((tmp_path / "glide.json").read_text())
    assert meta["target"]["fingerprint"] == target_fingerprint(tiny)
    back = load_draft(tmp_path, tiny)
    ids, pos = torch.tensor([[1, 2, 3]]), torch.arange(3)[None]
    torch.testing.assert_close(back(ids, pos, None), draft(ids, pos, None))
    small = load_draft(tmp_path, tiny, head_vocab=10)
    assert torch.equal(small.vocab_ids, torch.sort(rank[:10]).values)


def test_checkpoint_write_failing_midway_keeps_the_old_checkpoint(tiny, tmp_path, monkeypatch):
    """A checkpoint file is replaced whole or not at all (temporary file + rename): a full disk while writing the
    weights or glide.json leaves the previous checkpoint loadable and no temporary file behind."""
    import safetensors.torch
    from atomickit import disk_full, fail_midway, leftovers

    draft = build_draft(tiny, GlideConfig.from_target(tiny.config))
    save_draft(tmp_path, draft, tiny, training={"steps": 1})
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def half_save(tensors, filename, *args, **kwargs):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)
        raise disk_full()

    with monkeypatch.context() as m:
        m.setattr(safetensors.torch, "save_file", half_save)
        with pytest.raises(OSError):
            save_draft(tmp_path, draft, tiny, training={"steps": 2})
    with monkeypatch.context() as m:
        fail_midway(m)
        with pytest.raises(OSError):
            save_draft(tmp_path, draft, tiny, training={"steps": 3})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before and leftovers(tmp_path) == []
    load_draft(tmp_path, tiny)


def test_wrong_target_checkpoint_is_refused(tiny, tmp_path):
    draft = build_draft(tiny, GlideConfig.from_target(tiny.config))
    save_draft(tmp_path, draft, tiny)
    other_weights = build_tiny("llama", "sdpa", seed=5)  # same architecture, other weights
    other_arch = build_tiny("llama", "sdpa", seed=4, num_hidden_layers=3)
    for other in (other_weights, other_arch):
        with pytest.raises(TargetMismatchError) as e:
            load_draft(tmp_path, other)
        msg = str(e.value)
        assert target_fingerprint(tiny) in msg and target_fingerprint(other) in msg
        assert f"{other.config.num_hidden_layers} layers" in msg and "2 layers" in msg
    with pytest.raises(CheckpointError, match="not a GliDe"):
        load_draft(tmp_path / "missing", tiny)


def test_fingerprint_ignores_attention_backend():
    assert target_fingerprint(build_tiny("llama", "eager", seed=4)) == target_fingerprint(build_tiny("llama", "sdpa",
                                                                                                     seed=4))


@pytest.mark.parametrize("recency", [False, True])
def test_estimate_matches_a_real_chain(tiny, heldout, recency):
    """The teacher-forced estimate equals what GliDe chains from these roots really get accepted."""
    import numpy as np

    from redraft.drafters.glide import GlideDrafter
    from redraft.glide.network import init_from_target
    from redraft.runtimes.transformers.target import HFTarget

    draft = build_draft(tiny, GlideConfig.from_target(tiny.config, cross_recency=recency))
    init_from_target(draft, tiny)
    if recency:  # a zero o_proj would hide the cross-attention from the comparison
        torch.nn.init.normal_(draft.layers[0].cross_attn.o_proj.weight, std=0.5)
    est = estimate_acceptance(draft, heldout, gamma=4)
    acc = blocks = 0
    for r in heldout:
        n = len(r)
        start = max(r.gen_start - 1, 5)
        for s in range(start, n - 4):  # every root: the estimate uses all five block phases
            if not torch.equal(r.labels[s:s + 3], r.ids[s + 1:s + 4]):
                continue
            t = HFTarget(tiny)
            t.reset()
            t.forward(r.ids[:s].tolist())
            prop = GlideDrafter(draft, t, gamma=4).propose(np.array(r.ids[:s + 1].tolist()), 4)
            a = 0
            while a < 4 and prop.tokens[a] == int(r.labels[s + a]):
                a += 1
            acc, blocks = acc + a, blocks + 1
    assert blocks == est["blocks"] and acc / (4 * blocks) == pytest.approx(est["acceptance"])


def test_cli_parser_registers_train_and_eval():
    import argparse

    from redraft.cli import glide
    from redraft.cli.common import add_glide_draft_args

    parser = argparse.ArgumentParser(prog="redraft")
    glide.register(parser.add_subparsers(dest="command"))
    a = parser.parse_args(["glide", "train", "--out", "D", "--max-steps", "7", "--resume", "--vanilla"])
    assert (a.out, a.max_steps, a.resume, a.vanilla) == ("D", 7, True, True)
    a = parser.parse_args(["glide", "eval", "--draft-model", "D", "--head-vocab", "8192", "--cape-bins", "0.5:3,1"])
    assert a.head_vocab == [8192] and a.cape_bins.extras == (3, 1)
    run = argparse.ArgumentParser()
    add_glide_draft_args(run)
    a = run.parse_args(["--draft", "glide", "--draft-model", "D", "--cape"])
    # --gamma unset is None (GLIDE_GAMMA when the drafter is built), so that it can be refused without --draft glide
    assert (a.draft, a.draft_model, a.cape, a.gamma) == ("glide", "D", True, None)


def test_run_flags_build_a_working_drafter(tiny, tmp_path):
    """--draft glide --draft-model DIR --cape: the drafter the CLI builds is lossless through the Engine."""
    import argparse
    from types import SimpleNamespace

    from conftest import plain_greedy

    from redraft.cli.common import add_glide_draft_args, glide_drafter_from_args
    from redraft.decoding.engine import Engine

    save_draft(tmp_path, build_draft(tiny, GlideConfig.from_target(tiny.config)), tiny,
               vocab_rank=torch.arange(96))
    p = argparse.ArgumentParser()
    add_glide_draft_args(p)
    args = p.parse_args(["--draft", "glide", "--draft-model", str(tmp_path), "--cape", "--draft-vocab", "50"])
    d = glide_drafter_from_args(args, SimpleNamespace(model=tiny), minacc=0.5)
    assert d.cape is not None and d.guard is not None and len(d.draft.vocab_ids) == 50
    engine = Engine(tiny, [d])
    assert engine.generate([3, 1, 4, 1, 5], 30).output_ids == plain_greedy(tiny, [3, 1, 4, 1, 5], 30)
    assert glide_drafter_from_args(p.parse_args([]), SimpleNamespace(model=tiny)) is None
    with pytest.raises(SystemExit, match="draft-model"):
        glide_drafter_from_args(p.parse_args(["--draft", "glide"]), SimpleNamespace(model=tiny))
    with pytest.raises(SystemExit, match="trained for target"):
        glide_drafter_from_args(args, SimpleNamespace(model=build_tiny("llama", "sdpa", seed=9)))


def test_eval_measures_every_configuration_against_plain_greedy(tiny, tmp_path, monkeypatch):
    """`redraft glide eval`'s measure(): chain, CaPE, reduced head and guarded chain all equal plain greedy."""
    import io
    from types import SimpleNamespace

    import redraft.io.prompts
    from redraft.drafters.cape import CapeBins
    from redraft.training.evaluate import Config, measure, table

    # the tiny model has 96 ids: map question text onto them instead of the real tokenizer
    monkeypatch.setattr(redraft.io.prompts, "encode_prompt", lambda tok, text: [3 + ord(c) % 90 for c in text[:24]])
    save_draft(tmp_path, build_draft(tiny, GlideConfig.from_target(tiny.config)), tiny, vocab_rank=torch.arange(96))
    d = str(tmp_path)
    configs = [Config("plain"), Config("chain", d), Config("cape", d, 0, CapeBins()), Config("head", d, 48),
               Config("guarded", d, 0, None, 4, 0.5)]
    res = measure(SimpleNamespace(model=tiny, tokenizer=None, eos_token_ids=[]), configs, [0, 50, 100], 24,
                  log=io.StringIO())
    assert [r.identical for r in res] == [3] * 5 and all(r.tokens == 72 for r in res)
    assert res[1].proposed > 0 and res[2].proposed > res[1].proposed  # CaPE adds siblings
    assert res[4].proposed <= res[1].proposed  # the guard can only take drafts away
    assert "| guarded |" in table(res)
    with pytest.raises(ValueError, match="plain greedy"):
        measure(SimpleNamespace(model=tiny, tokenizer=None, eos_token_ids=[]), configs[1:], [0], 4)


def test_run_training_builds_greedy_and_sampled_data_without_held_out_questions(tiny, tmp_path, monkeypatch):
    """`redraft glide train` end to end on the tiny model: greedy + sampled answer sets, no held-out question."""
    import io
    from types import SimpleNamespace

    import redraft.io.prompts
    from redraft.training.train import run_training

    class Tok:  # the tiny model has 96 ids; map text onto them
        pad_token_id = 0

        def __call__(self, text):
            return {"input_ids": [3 + ord(c) % 90 for c in text[:64]]}

    monkeypatch.setattr(redraft.io.prompts, "encode_prompt", lambda tok, text: tok(text)["input_ids"][:12])
    loaded = SimpleNamespace(model=tiny, tokenizer=Tok(), eos_token_ids=[])
    cfg = TrainConfig(max_steps=3, batch_tokens=200, ckpt_every=1000, train_vocab=0)
    state = run_training(loaded, tmp_path / "out", cfg, data_minutes=2, max_new_tokens=4, samples=1,
                         data_dir=tmp_path / "data", progress=False, log=io.StringIO())
    assert state.step == 3
    greedy = FeatureStore(tmp_path / "data" / "train", json.loads((tmp_path / "data" / "train" / "index.json")
                                                                  .read_text())["meta"]).load()
    s1_dir = tmp_path / "data" / "train-s1"
    sampled = FeatureStore(s1_dir, json.loads((s1_dir / "index.json").read_text())["meta"]).load()
    assert len(greedy) == 432 and len(sampled) == 432  # every training question; the fake prompts are short
    assert not any(is_held_out(r.qid) for r in greedy + sampled)
    # sampled paths differ
    assert sum(not torch.equal(a.ids, b.ids) for a, b in zip(greedy, sampled, strict=True)) > 100
    meta = json.loads((tmp_path / "out" / "glide.json").read_text())
    assert meta["training"]["data"]["sampled_answers"] == 432


def _glide_cli(argv):
    import argparse

    from redraft.cli import glide

    parser = argparse.ArgumentParser(prog="redraft")
    glide.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def _refused(capsys, argv, flag: str, why: str) -> None:
    """argparse's refusal: exit status 2 and one error line naming the flag, the value and what was expected."""
    with pytest.raises(SystemExit) as e:
        _glide_cli(argv)
    assert e.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and f"error: argument {flag}: {why}" in errors[0], errors


@pytest.mark.parametrize("argv,why", [
    (["--max-steps", "0"], "0 must be at least 1"), (["--lr", "-1"], "-1 must be > 0"),
    (["--lr", "nan"], "nan is not a finite number"), (["--samples", "-1"], "-1 must be at least 0"),
    (["--sample-temperature", "0"], "0 must be > 0"), (["--batch-tokens", "0"], "0 must be at least 16"),
    (["--train-vocab", "-5"], "-5 must be at least 0"), (["--ckpt-every", "0"], "0 must be at least 1"),
    (["--data-minutes", "-5"], "-5 must be >= 0"), (["--prompt-weight", "nan"], "nan is not a finite number"),
    (["--layers", "0"], "0 must be at least 1"), (["--max-minutes", "-1"], "-1 must be > 0")])
def test_train_refuses_bad_numbers(argv, why, capsys):
    _refused(capsys, ["glide", "train", "--out", "unused"] + argv, argv[0], why)


def test_train_checks_out_and_data_dir_before_any_work(tmp_path, tiny):
    afile = tmp_path / "file"
    afile.write_text("x")
    with pytest.raises(SystemExit, match="is not a directory"):
        _glide_cli(["glide", "train", "--out", str(afile)])
    with pytest.raises(SystemExit, match="--data-dir"):
        _glide_cli(["glide", "train", "--out", str(tmp_path / "o"), "--data-dir", str(afile)])
    save_draft(tmp_path / "done", build_draft(tiny, GlideConfig.from_target(tiny.config)), tiny)
    with pytest.raises(SystemExit, match="already holds a checkpoint; pass --resume"):
        _glide_cli(["glide", "train", "--out", str(tmp_path / "done")])
    meta = json.loads((tmp_path / "done" / "glide.json").read_text())
    del meta["config"]["hidden_size"]
    (tmp_path / "done" / "glide.json").write_text(json.dumps(meta))
    with pytest.raises(SystemExit, match="bad 'config'"):  # refused before any data work
        _glide_cli(["glide", "train", "--out", str(tmp_path / "done"), "--resume"])
    with pytest.raises(SystemExit, match="--data-dir"):
        _glide_cli(["glide", "train", "--out", str(tmp_path / "new"), "--data-dir", str(afile)])
    assert not (tmp_path / "new").exists()  # nothing created when an argument is refused


def test_eval_checks_checkpoint_kinds_and_counts_before_loading(tmp_path, tiny, capsys):
    save_draft(tmp_path / "g", build_draft(tiny, GlideConfig.from_target(tiny.config)), tiny)
    save_draft(tmp_path / "v", build_draft(tiny, GlideConfig.from_target(tiny.config, cross_attention=False)), tiny)
    with pytest.raises(SystemExit, match="is a vanilla draft"):
        _glide_cli(["glide", "eval", "--draft-model", str(tmp_path / "v")])
    with pytest.raises(SystemExit, match="is a GliDe draft"):
        _glide_cli(["glide", "eval", "--draft-model", str(tmp_path / "g"), "--vanilla-model", str(tmp_path / "g")])
    with pytest.raises(SystemExit, match="10 held-out"):
        _glide_cli(["glide", "eval", "--draft-model", str(tmp_path / "g"), "--questions", "11"])
    with pytest.raises(SystemExit, match="not a GliDe draft checkpoint"):
        _glide_cli(["glide", "eval", "--draft-model", str(tmp_path / "missing")])
    for bad, why in ((["--questions", "0"], "0 must be at least 1"), (["--ngen", "0"], "0 must be at least 1"),
                     (["--head-vocab", "0"], "0 must be at least 1"), (["--tree-budget", "0"], "0 must be at least 1"),
                     (["--json", str(tmp_path / "no" / "x.json")], f"{tmp_path / 'no' / 'x.json'}: directory {tmp_path / 'no'} does not exist")):
        _refused(capsys, ["glide", "eval", "--draft-model", str(tmp_path / "g")] + bad, bad[0], why)


def test_run_flags_need_draft_glide_and_bad_checkpoints_are_refused(tmp_path, tiny, capsys):
    import argparse
    from types import SimpleNamespace

    from redraft.cli.common import add_glide_draft_args, glide_drafter_from_args

    p = argparse.ArgumentParser()
    add_glide_draft_args(p)
    with pytest.raises(SystemExit, match="--cape: only used with --draft glide"):
        glide_drafter_from_args(p.parse_args(["--cape"]), SimpleNamespace(model=tiny))
    save_draft(tmp_path / "g", build_draft(tiny, GlideConfig.from_target(tiny.config)), tiny,
               vocab_rank=torch.arange(96))
    save_draft(tmp_path / "c", build_draft(tiny, GlideConfig.from_target(tiny.config)), tiny)
    meta = json.loads((tmp_path / "c" / "glide.json").read_text())
    del meta["config"]["hidden_size"]
    for text in ("[]", json.dumps(meta)):
        (tmp_path / "c" / "glide.json").write_text(text)
        with pytest.raises(SystemExit, match="glide.json"):
            glide_drafter_from_args(p.parse_args(["--draft", "glide", "--draft-model", str(tmp_path / "c")]),
                                    SimpleNamespace(model=tiny))
    with pytest.raises(SystemExit, match="1..96 tokens"):
        glide_drafter_from_args(p.parse_args(["--draft", "glide", "--draft-model", str(tmp_path / "g"),
                                              "--draft-vocab", "1000"]), SimpleNamespace(model=tiny))
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--gamma", "0"])
    assert e.value.code == 2 and "error: argument --gamma: 0 must be at least 1" in capsys.readouterr().err
