"""``redraft serve`` drafts through the composition point with the cost-aware policy, one policy per tenant.

What a tenant's policy learns (acceptance per draft source) must never change another tenant's draft depths: the
timing of one tenant's responses would otherwise tell it about another's traffic. Checked on the server's
:class:`~redraft.server.generation.Generator` with a tiny model: bob's request chooses the same depths, forward for
forward, whether or not alice's traffic came first; and the same traffic sent as bob does change them (so the
check can fail).
"""

from __future__ import annotations

import pytest
from conftest import plain_greedy
from serverkit import EOS, save_tiny_model, serve_args

from redraft.compose import SpeculationConfig
from redraft.pricing import CostCurve
from redraft.server.corpora import TenantCorpora
from redraft.server.generation import Generator

# shaped like the 2-core development CPU's curve (tests/decoding/test_engine_policy.py): depth choices depend on acceptance
CURVE = CostCurve((0, 1, 2, 3, 4, 8, 16, 32, 48), (1.0, 1.6, 2.0, 1.7, 1.75, 2.1, 2.9, 4.2, 5.5))
BOB = [20, 21, 22, 23, 20, 21, 22, 23, 20, 21]
ALICE = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43, 44, 40, 41, 42], [30, 31, 30, 31, 30, 31, 30]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:  # cost curves in a temporary cache, never the user's
        mp.setenv("REDRAFT_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield save_tiny_model(tmp_path_factory.mktemp("serve-policy-model"))


@pytest.fixture(scope="module")
def loaded(model_dir):
    from redraft.io.loading import load_model

    return load_model(model_dir)


def generator(loaded, config=None) -> Generator:
    corpora = TenantCorpora(["alice", "bob"], None, vocab_size=loaded.vocab_size, fingerprint=None,
                            cap_tokens=None, learn=False)
    return Generator(loaded, corpora, config or SpeculationConfig(), curve=CURVE)


def depths(gen: Generator, tenant: str, prompt: list[int], n: int = 60) -> tuple[list[int], list[int]]:
    res = gen.engine(tenant, gen.new_target()).generate(prompt, n)
    return res.output_ids, res.drafted_per_forward


def test_one_tenants_traffic_leaves_another_tenants_depths_unchanged(loaded):
    fresh = generator(loaded)
    bob_alone = depths(fresh, "bob", BOB)

    busy = generator(loaded)
    for p in ALICE * 2:
        depths(busy, "alice", p)
    assert busy.policies["alice"] is not busy.policies.get("bob")
    assert depths(busy, "bob", BOB) == bob_alone  # ids and draft width of every forward

    # the same traffic sent by bob himself does change his depth choices: the comparison above can fail
    own = generator(loaded)
    for p in ALICE * 2:
        depths(own, "bob", p)
    ids, widths = depths(own, "bob", BOB)
    assert ids == bob_alone[0] == plain_greedy(loaded.model, BOB, 60, eos=[EOS])
    assert widths != bob_alone[1]


def test_the_server_uses_the_policy_by_default_and_fixed_depths_when_asked(loaded, model_dir):
    from redraft.cli.serve import speculation_config

    assert speculation_config(serve_args(model_dir)).policy_on
    gen = generator(loaded, speculation_config(serve_args(model_dir)))
    assert gen.engine("bob", gen.new_target()).policy is gen.policy("bob") is not None
    for flags, k in ((["--no-policy"], 8), (["--k", "4"], 4), (["--minacc", "30"], 8)):
        cfg = speculation_config(serve_args(model_dir, *flags))
        fixed = Generator(loaded, gen.corpora, cfg)  # no curve measured without the policy
        assert not cfg.policy_on and fixed.curve is None and fixed.policy("bob") is None
        engine = fixed.engine("bob", fixed.new_target())
        assert engine.policy is None and engine.max_depth == k
        assert [d.name for d in engine.drafters] == ["ngram"] and engine.drafters[0].k == k


def test_k_max_not_above_k_is_refused(model_dir):
    from redraft.cli.serve import speculation_config

    with pytest.raises(SystemExit, match="--k-max 4: no effect unless above the draft depth --k 8"):
        speculation_config(serve_args(model_dir, "--k", "8", "--k-max", "4"))
