"""Grammar-constrained decoding (llguidance): constrained speculative decoding equals constrained plain decoding.

Every verify row is masked with its own tree node's grammar state; the tests compare the engine with drafters
(grammar drafts, an oracle, garbage, token trees) against the engine without drafters, and the engine without
drafters against an independent reference decoder (full forward + fresh matcher + argmax each step).
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from conftest import ConstantDrafter, SequenceDrafter
from grammarkit import PERSON, bpe_tokenizer, reference_constrained, tiny_for

from redraft.decoding.engine import Engine
from redraft.decoding.sampling import SamplingParams
from redraft.drafters.grammar import GrammarDrafter
from redraft.grammar import Constraint, GrammarError, grammar_tokenizer, json_rule
from redraft.tree import TokenTree

N = 80


@pytest.fixture(scope="module")
def kit():
    tok = bpe_tokenizer()
    model = tiny_for(tok)
    eos = tok.eos_token_id
    person = Constraint.json_schema(PERSON, grammar_tokenizer(tok, len(tok), [eos]), len(tok), "person")
    return tok, model, eos, person


PROMPTS = ["the weather in paris", "sunny today", '{"name": "ann"']


def plain(kit, prompt, constraint, **kw):
    tok, model, eos, _ = kit
    return Engine(model, [], eos_token_ids=[eos]).generate(
        prompt, N, sampling=SamplingParams(constraint=constraint, **kw))


@pytest.mark.parametrize("text", PROMPTS)
def test_plain_constrained_decoding_equals_the_reference_and_follows_the_schema(kit, text):
    tok, model, eos, person = kit
    prompt = tok.encode(text)
    res = plain(kit, prompt, person)
    assert res.output_ids == reference_constrained(model, person, prompt, N, eos)
    assert res.output_ids[-1] == eos, "the grammar completes and then allows only EOS"
    jsonschema.validate(json.loads(tok.decode(res.output_ids[:-1])), PERSON)


def test_unconstrained_tiny_model_does_not_produce_json(kit):
    """The constraint is what makes the output JSON (the test above could not pass by luck)."""
    tok, model, eos, _ = kit
    out = Engine(model, [], eos_token_ids=[eos]).generate(tok.encode(PROMPTS[0]), N).output_ids
    with pytest.raises(ValueError):
        json.loads(tok.decode(out, skip_special_tokens=True))


@pytest.mark.parametrize("text", PROMPTS)
def test_grammar_drafts_are_lossless_and_save_forwards(kit, text):
    tok, model, eos, person = kit
    prompt = tok.encode(text)
    base = plain(kit, prompt, person)
    res = Engine(model, [GrammarDrafter(person)], eos_token_ids=[eos]).generate(
        prompt, N, sampling=SamplingParams(constraint=person))
    assert res.output_ids == base.output_ids
    st = res.sources["grammar"]
    assert st.proposed > 0 and st.accepted > 0
    assert res.forwards < base.forwards


@pytest.mark.parametrize("merge", [False, True])
def test_every_tree_node_is_masked_with_its_own_grammar_state(kit, merge):
    """Oracle drafts (right), shifted oracle drafts (wrong at every node) and constant garbage, merged into token
    trees with the grammar drafts: the rows below wrong nodes see grammar states the output never reaches."""
    tok, model, eos, person = kit
    prompt = tok.encode(PROMPTS[0])
    want = plain(kit, prompt, person).output_ids
    full = prompt + want
    drafters = [GrammarDrafter(person), SequenceDrafter(full, "wrong", shift=3, vocab=len(tok)),
                SequenceDrafter(full, vocab=len(tok), limit=5), ConstantDrafter(tok.encode('"}, "a": 1'))]
    res = Engine(model, drafters, eos_token_ids=[eos], merge=merge).generate(
        prompt, N, sampling=SamplingParams(constraint=person))
    assert res.output_ids == want
    assert res.sources["oracle"].accepted > 0 or res.sources["grammar"].accepted > 0


class TreeDrafter:
    """Proposes a two-branch token tree: the oracle's next tokens and, beside them, a valid-looking alternative."""

    name, guard = "tree", None

    def __init__(self, full, alt):
        self.full, self.alt = full, alt

    def bind(self, target):
        pass

    def begin(self, prompt):
        pass

    def propose(self, context, max_depth):
        L = len(context)
        if context.tolist() != self.full[:L] or max_depth < 2:
            return None
        good = self.full[L:L + min(3, max_depth)]
        if not good:
            return None
        tokens = good + self.alt[:2]
        parents = list(range(-1, len(good) - 1)) + [-1, len(good)]
        return TokenTree.from_parents(tokens, parents, self.name)

    def observe(self, *a):
        pass


def test_token_tree_siblings_are_masked_separately(kit):
    tok, model, eos, person = kit
    prompt = tok.encode(PROMPTS[1])
    want = plain(kit, prompt, person).output_ids
    res = Engine(model, [TreeDrafter(prompt + want, tok.encode('{"name": "bob"'))], eos_token_ids=[eos]).generate(
        prompt, N, sampling=SamplingParams(constraint=person))
    assert res.output_ids == want
    assert res.sources["tree"].accepted > 0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeded_sampling_under_a_grammar_reproduces_the_plain_sample(kit, seed):
    tok, model, eos, person = kit
    prompt = tok.encode(PROMPTS[0])
    kw = dict(temperature=1.0, seed=seed, top_k=20)
    base = plain(kit, prompt, person, **kw)
    res = Engine(model, [GrammarDrafter(person), ConstantDrafter(tok.encode('", "age": 1'))],
                 eos_token_ids=[eos], merge=True).generate(prompt, N, sampling=SamplingParams(constraint=person, **kw))
    assert res.output_ids == base.output_ids
    jsonschema.validate(json.loads(tok.decode(res.output_ids[:-1])), PERSON)


def test_samples_differ_across_seeds_and_all_follow_the_schema(kit):
    tok, model, eos, person = kit
    prompt = tok.encode(PROMPTS[0])
    outs = {tuple(plain(kit, prompt, person, temperature=1.0, seed=s).output_ids) for s in range(4)}
    assert len(outs) > 1
    for o in outs:
        jsonschema.validate(json.loads(tok.decode(list(o)[:-1])), PERSON)


def test_grammar_with_repetition_penalty_matches_plain(kit):
    tok, model, eos, person = kit
    prompt = tok.encode(PROMPTS[2])
    base = plain(kit, prompt, person, repetition_penalty=1.3)
    res = Engine(model, [GrammarDrafter(person)], eos_token_ids=[eos]).generate(
        prompt, N, sampling=SamplingParams(constraint=person, repetition_penalty=1.3))
    assert res.output_ids == base.output_ids


def test_json_object_gives_an_object(kit):
    tok, model, eos, _ = kit
    c = Constraint.json_object(grammar_tokenizer(tok, len(tok), [eos]), len(tok))
    out = plain(kit, tok.encode(PROMPTS[0]), c).output_ids
    if out[-1] == eos:
        assert isinstance(json.loads(tok.decode(out[:-1])), dict)
    else:  # an unbounded object may run out of tokens; what there is must still be a JSON object's prefix
        assert tok.decode(out).startswith("{")


def test_lark_grammar_with_embedded_schema(kit):
    tok, model, eos, _ = kit
    src = 'start: "<call>" obj "</call>"\nobj: ' + json_rule(PERSON)
    c = Constraint.lark(src, grammar_tokenizer(tok, len(tok), [eos]), len(tok))
    out = plain(kit, tok.encode(PROMPTS[1]), c).output_ids
    text = tok.decode(out[:-1])
    assert text.startswith("<call>") and text.endswith("</call>")
    jsonschema.validate(json.loads(text[len("<call>"):-len("</call>")]), PERSON)


def test_bad_grammars_raise_grammar_error_naming_the_constraint(kit):
    tok, _, eos, _ = kit
    lt = grammar_tokenizer(tok, len(tok), [eos])
    with pytest.raises(GrammarError, match="mine"):
        Constraint.lark("start: undefined_rule", lt, len(tok), "mine")
    with pytest.raises(GrammarError, match="must be an object"):
        Constraint.json_schema(["not", "a", "schema"], lt, len(tok))
    with pytest.raises(GrammarError, match="schema"):
        Constraint.json_schema({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}, "required": ["a"]},
                               lt, len(tok), "schema")
    for recursive in ({"$ref": "#"}, {"anyOf": [{"$ref": "#"}]},
                      {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}):  # valid, but nothing satisfies
        with pytest.raises(GrammarError, match="no output satisfies it"):
            Constraint.json_schema(recursive, lt, len(tok), "schema")
    with pytest.raises(ValueError, match="constraint"):
        SamplingParams(constraint="not a constraint")


def test_grammar_drafter_follows_a_diverging_context(kit):
    """The drafter's matcher follows whatever context it is given: forward, back (rollback) and along another
    branch, and proposes the forced continuation of each."""
    tok, _, eos, person = kit
    d = GrammarDrafter(person)
    prompt = np.array(tok.encode("hi"), dtype=np.int64)
    d.begin(prompt)
    def forced(ctx):
        return tok.decode(d.propose(ctx, 16).tokens)

    def forced_prefix(text: str, full: str, head: str):
        # llguidance stops a forced run before a token a longer merge could replace (here ' "')
        return full.startswith(text) and text.startswith(head)

    assert forced_prefix(forced(prompt), '{"name": "', '{"name"')
    a = np.concatenate([prompt, tok.encode('{"name": "ann", "age": 3')])
    assert d.propose(a, 16) is None  # a digit or a comma: a free choice
    b = np.concatenate([prompt, tok.encode('{"name": "ann", "age": 3, ')])
    assert forced_prefix(forced(b), '"member": ', '"member"')
    assert forced_prefix(forced(prompt), '{"name": "', '{"name"')  # back to the start
    c = np.concatenate([prompt, tok.encode('{"name": "x", "age": 7, "member": true, "color": "blue"}')])
    prop = d.propose(c, 16)
    assert prop is None or prop.tokens == [eos]
    assert len(d.propose(prompt, 2).tokens) <= 2


@pytest.mark.parametrize("curve", ["cpu", "flat"])
def test_grammar_drafts_under_the_cost_aware_policy(kit, curve):
    """The engine with a speculation policy (the CLI's default) cuts grammar drafts like any source's: still
    lossless, and on a flat cost curve the forced tokens are verified."""
    from redraft.defaults import MAX_DRAFT_DEPTH
    from redraft.drafters import NgramDrafter
    from redraft.policy import SpeculationPolicy
    from redraft.pricing import CostCurve

    tok, model, eos, person = kit
    c = CostCurve.flat(64) if curve == "flat" else \
        CostCurve((0, 1, 2, 3, 4, 8, 16, 32, 48), (1.0, 1.6, 2.0, 1.7, 1.75, 2.1, 2.9, 4.2, 5.5))
    pol = SpeculationPolicy(c, max_nodes=MAX_DRAFT_DEPTH)
    for text in PROMPTS:
        prompt = tok.encode(text)
        base = plain(kit, prompt, person)
        res = Engine(model, [GrammarDrafter(person), NgramDrafter(k=MAX_DRAFT_DEPTH)], eos_token_ids=[eos],
                     policy=pol).generate(prompt, N, sampling=SamplingParams(constraint=person))
        assert res.output_ids == base.output_ids
        if curve == "flat":
            assert res.sources["grammar"].accepted > 0


class RandomTreeDrafter:
    """Random token trees mixing the right continuation (from a known output) with random ids: each node follows
    the right path with probability ``p_right``, else takes a random id; random parents make real trees."""

    name, guard = "random", None

    def __init__(self, full, vocab, seed, p_right):
        self.full, self.vocab, self.p_right = full, vocab, p_right
        self.rng = np.random.default_rng(seed)

    def bind(self, target):
        pass

    def begin(self, prompt):
        pass

    def propose(self, context, max_depth):
        n = int(self.rng.integers(1, 9))
        tokens, parents, depth = [], [], []
        for i in range(n):
            parent = int(self.rng.integers(-1, i)) if i else -1
            d = depth[parent] + 1 if parent >= 0 else 1
            if d > max_depth:
                break
            at = len(context) + d - 1
            right = at < len(self.full) and self.rng.random() < self.p_right
            tokens.append(self.full[at] if right else int(self.rng.integers(0, self.vocab)))
            parents.append(parent)
            depth.append(d)
        return TokenTree.from_parents(tokens, parents, self.name) if tokens else None

    def observe(self, *a):
        pass


@pytest.mark.parametrize("seed", range(6))
def test_random_token_trees_under_a_grammar_equal_plain(kit, seed):
    tok, model, eos, person = kit
    prompt = tok.encode(PROMPTS[seed % len(PROMPTS)])
    want = plain(kit, prompt, person).output_ids
    d = RandomTreeDrafter(prompt + want, len(tok), seed, p_right=[0.5, 0.8, 0.95][seed % 3])
    res = Engine(model, [d, GrammarDrafter(person)], eos_token_ids=[eos], merge=bool(seed % 2)).generate(
        prompt, N, sampling=SamplingParams(constraint=person))
    assert res.output_ids == want
    assert res.sources["random"].accepted > 0  # trees were verified, and parts of them accepted
