"""A GliDe draft under the cost-aware policy (redraft/policy/gate.py): a draft that does not pay is cut to zero
depth and its draft model stops running except for rare probes, so forwards and verify time stay within plain
decoding's plus the probe budget; a draft that pays keeps drafting; ids identical to plain greedy in every case."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cli.test_cli import clean_env  # noqa: F401 - fixture
from conftest import SequenceDrafter, build_tiny, plain_greedy

from redraft.decoding.engine import Engine
from redraft.defaults import MAX_DRAFT_DEPTH, PROBE_OVERHEAD
from redraft.drafters.glide import GlideDrafter
from redraft.glide.config import GlideConfig
from redraft.glide.network import build_draft
from redraft.policy import SpeculationPolicy
from redraft.policy.gate import PolicyGate
from redraft.pricing.curve import CostCurve
from redraft.runtimes.transformers.target import HFTarget

# shaped like the 2-core development CPU's curve (see test_engine_policy.py)
CPU_LIKE = CostCurve((0, 1, 2, 3, 4, 8, 16, 32, 48), (1.0, 1.6, 2.0, 1.7, 1.75, 2.1, 2.9, 4.2, 5.5))
PROMPTS = [[9, 8, 7], [5, 17, 33, 2, 40], [70, 3]]
N = 110


@pytest.fixture(scope="module")
def target():
    return build_tiny("llama", "sdpa", seed=0)


def garbage_glide(target, seed: int = 1):
    """A random-weight GliDe draft: its proposals are almost never the target's choice (low acceptance)."""
    torch.manual_seed(seed)
    return build_draft(target, GlideConfig.from_target(target.config))


def verify_time(res, curve: CostCurve) -> float:
    """The run's verify time in plain steps: sum of c(drafted tokens) over its forwards."""
    return sum(curve.cost(n) for n in res.drafted_per_forward)


@pytest.mark.parametrize("measured", [False, True], ids=["fixed-cost", "measured-cost"])
def test_a_draft_that_does_not_pay_costs_at_most_the_probe_budget(target, measured):
    draft = garbage_glide(target)
    asked = drafted = 0
    for prompt in PROMPTS:
        want = plain_greedy(target, prompt, N)
        policy = SpeculationPolicy(CPU_LIKE, max_nodes=MAX_DRAFT_DEPTH)
        t = HFTarget(target)
        gate = PolicyGate(GlideDrafter(draft, t), policy, draft_cost=None if measured else 0.5)
        res = Engine(t, [gate], policy=policy).generate(prompt, N)
        assert res.output_ids == want
        assert res.forwards <= len(want)
        # verify time within plain decoding's plus the probes' share of a plain step (and one probe of slack)
        assert verify_time(res, CPU_LIKE) <= len(want) * (1 + PROBE_OVERHEAD) + CPU_LIKE.cost(4)
        asked, drafted = asked + gate.asked, drafted + gate.drafted
    assert asked >= len(PROMPTS) * (N // 2)
    # the draft model ran only for probes: a small share of the steps (without the gate it runs on every step)
    assert 0 < drafted <= 0.1 * asked, (drafted, asked)


def test_without_the_gate_the_draft_model_runs_every_step(target):
    """The contrast the gate exists for: the policy alone cuts the verify, not the draft model's own forwards."""
    draft = garbage_glide(target)
    policy = SpeculationPolicy(CPU_LIKE, max_nodes=MAX_DRAFT_DEPTH)
    t = HFTarget(target)
    counted = PolicyGate(GlideDrafter(draft, t), policy, draft_cost=0.0)
    counted.pays = lambda depth: True  # a gate that never says no: the ungated drafter, counted
    want = plain_greedy(target, PROMPTS[0], N)
    res = Engine(t, [counted], policy=policy).generate(PROMPTS[0], N)
    assert res.output_ids == want
    assert counted.drafted == counted.asked >= N // 2


def test_a_draft_that_pays_keeps_drafting(target):
    """An always-right draft with a draft cost still pays (several tokens per forward): the gate lets it draft."""
    for prompt in PROMPTS:
        want = plain_greedy(target, prompt, N)
        policy = SpeculationPolicy(CPU_LIKE, max_nodes=MAX_DRAFT_DEPTH)
        gate = PolicyGate(SequenceDrafter(list(prompt) + want, "glide", depth=4), policy, draft_cost=0.5)
        res = Engine(target, [gate], policy=policy).generate(prompt, N)
        assert res.output_ids == want
        assert gate.drafted >= 0.8 * gate.asked
        assert res.forwards <= len(want) / 3


def test_pays_follows_the_learned_acceptance():
    policy = SpeculationPolicy(CPU_LIKE, max_nodes=MAX_DRAFT_DEPTH)
    gate = PolicyGate(SequenceDrafter([1, 2, 3], "glide"), policy, draft_cost=0.5)
    for _ in range(20):
        policy.observe("glide", 4, 4)
    assert gate.pays(4)
    for _ in range(20):
        policy.observe("glide", 4, 0)
    assert not gate.pays(4) and not gate.pays(1)
    assert not gate.pays(0)
    # idle steps bring a probe: (c(1) - 1 + draft cost) / probe overhead of them for a 1-token probe
    need = int(np.ceil((CPU_LIKE.cost(1) - 1 + 0.5) / PROBE_OVERHEAD))
    for _ in range(need - 1):
        policy.skip("glide")
    assert not gate.probe_due(1)
    policy.skip("glide")
    assert gate.probe_due(1)


def test_gate_refuses_bad_settings():
    policy = SpeculationPolicy(CPU_LIKE, max_nodes=MAX_DRAFT_DEPTH)
    with pytest.raises(ValueError, match="draft_cost >= 0"):
        PolicyGate(SequenceDrafter([1], "glide"), policy, draft_cost=-1.0)
    with pytest.raises(ValueError, match="smoothing"):
        PolicyGate(SequenceDrafter([1], "glide"), policy, smoothing=0.0)


# ---- `redraft run --draft glide` with the policy on (the CLI's default) --------------------------------------------

def test_cli_run_draft_glide_is_gated_and_exact(capsys, monkeypatch, tmp_path, tiny_model_dir, clean_env):  # noqa: F811
    from cli.test_cli import PROMPT, parse_report, run_cli, words

    from redraft.glide.checkpoint import save_draft
    from redraft.io.loading import load_model

    d, _ = tiny_model_dir
    loaded = load_model(str(d), quiet=True)
    ckpt = save_draft(tmp_path / "draft", garbage_glide(loaded.model), loaded.model)
    made = []
    real_init = PolicyGate.__init__

    def spy(self, *a, **kw):
        real_init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(PolicyGate, "__init__", spy)
    base = ["run", "--model", str(d), "--no-chat", "--ngen", "40", "--tokens", "--no-ngram"]
    rc, _, err = run_cli(capsys, *base, "--draft", "glide", "--draft-model", str(ckpt), words(PROMPT))
    assert rc == 0
    drafted = parse_report(err)["tokens"]
    assert len(made) == 1 and made[0].name == "glide" and made[0].asked > 0
    assert made[0].drafted < made[0].asked  # the garbage draft stopped running
    rc, _, err = run_cli(capsys, "run", "--model", str(d), "--no-chat", "--ngen", "40", "--tokens",
                         words(PROMPT))
    assert rc == 0 and parse_report(err)["tokens"] == drafted
