"""The composition point is the only place that builds speculation.

Scans redraft's source with ``ast`` and fails when an Engine, a drafter class or a SpeculationPolicy is constructed
outside :mod:`redraft.compose` (tests are outside the package and not scanned). Also checks that the config's
defaults are the ones in :mod:`redraft.defaults`, and that the environment is read with the documented precedence.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import redraft
from redraft.compose import SpeculationConfig
from redraft.compose.env import EnvError, read_draft_env
from redraft.defaults import CORPUS_K_DEFAULT, CORPUS_MINACC, MAX_DRAFT_DEPTH, POLICY_MAX_DEPTH, TREE_BUDGET

PACKAGE = Path(redraft.__file__).resolve().parent
COMPOSE = PACKAGE / "compose"


def drafter_classes() -> set[str]:
    """Every class defined in redraft/drafters/ whose name ends in "Drafter" (the protocol ``Drafter`` aside)."""
    names = set()
    for path in (PACKAGE / "drafters").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Drafter") and node.name != "Drafter":
                names.add(node.name)
    return names


FORBIDDEN = {"Engine", "SpeculationPolicy", "LoadAwarePolicy", "PolicyGate"}


def constructions(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of every call ``Name(...)`` or ``module.Name(...)`` with Name in ``names``."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in names:
                hits.append((node.lineno, name))
    return hits


def test_the_drafter_classes_are_found():
    assert {"CorpusDrafter", "NgramDrafter", "GlideDrafter"} <= drafter_classes()


def test_the_scanner_catches_direct_and_qualified_constructions():
    src = "from x import Engine\nimport m\ne = Engine(model, [])\np = m.SpeculationPolicy(c)\nEngine.generate\n"
    assert constructions(src, FORBIDDEN) == [(3, "Engine"), (4, "SpeculationPolicy")]


def test_engines_drafters_and_policies_are_built_only_in_compose():
    names = FORBIDDEN | drafter_classes()
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if COMPOSE in path.parents:
            continue
        for line, name in constructions(path.read_text(), names):
            offenders.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name}(...)")
    assert not offenders, ("built outside redraft/compose/ (build it with redraft.compose.build_engine, "
                           "build_drafters, glide_drafter or build_policy):\n" + "\n".join(offenders))
    # and compose itself does build each of them (the scan looks at the right names)
    built = {name for path in COMPOSE.glob("*.py") for _, name in constructions(path.read_text(), names)}
    assert {"Engine", "SpeculationPolicy", "CorpusDrafter", "NgramDrafter", "GlideDrafter"} <= built


# ---- the config: one default per knob, one policy rule ----------------------------------------------------------

def test_config_defaults_come_from_redraft_defaults():
    c = SpeculationConfig()
    assert c.policy_on and c.depth == MAX_DRAFT_DEPTH and c.guard_minacc == CORPUS_MINACC
    fixed = SpeculationConfig(policy=False)
    assert not fixed.policy_on and fixed.depth == CORPUS_K_DEFAULT and fixed.max_depth == CORPUS_K_DEFAULT
    assert SpeculationConfig(tree=4).budget == TREE_BUDGET
    assert SpeculationConfig().budget == POLICY_MAX_DEPTH  # a chain under the policy: its depth alone limits it
    assert SpeculationConfig(k=8).budget == max(TREE_BUDGET, MAX_DRAFT_DEPTH)


@pytest.mark.parametrize("kw", [dict(k=8), dict(minacc=0.5), dict(k_max=16), dict(policy=False)])
def test_a_fixed_setting_turns_the_policy_off(kw):
    assert not SpeculationConfig(**kw).policy_on


@pytest.mark.parametrize("kw,field", [(dict(k=0), "k"), (dict(k=49), "k"), (dict(minacc=50), "minacc"),
                                      (dict(tree=-1), "tree"), (dict(tree_budget=0), "tree_budget")])
def test_bad_values_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"SpeculationConfig.{field}="):
        SpeculationConfig(**kw)


def test_env_precedence_and_clamping(capsys):
    env = {"COLI_CORPUS_K": "5", "COLI_DRAFT_CORPUS": "coli.txt", "COLI_CORPUS_MINACC": "20"}
    assert read_draft_env(env).k == 5 and read_draft_env(env).corpus == "coli.txt"
    env["REDRAFT_CORPUS_K"] = "99"  # REDRAFT_ beats COLI_; out of range: clamped with a warning
    e = read_draft_env(env)
    assert e.k == MAX_DRAFT_DEPTH and e.minacc == pytest.approx(0.2)
    assert "REDRAFT_CORPUS_K=99 is outside 1..48" in capsys.readouterr().err
    assert SpeculationConfig.from_env(env, k=3).k == 3  # Python arguments beat the environment
    assert not SpeculationConfig.from_env(env).policy_on  # a K from the environment is a fixed setting
    with pytest.raises(EnvError, match="REDRAFT_CORPUS_MINACC"):
        read_draft_env({"REDRAFT_CORPUS_MINACC": "half"})
