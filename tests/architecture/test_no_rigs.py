"""The package holds only what users import or run: no rig (a script whose only job is to drive a load, fault or
probe experiment) lives under ``redraft/``. Rigs live under ``benchmarks/`` and import the package from there.

Two rules, read from the source:

- every module is reachable through imports (function-level ones included) from an entry point (``ENTRY_POINTS``:
  the package, the ``redraft`` command, the ``python -m`` entry points, the Python API, the vLLM proposer that vLLM
  loads by its class path), or is listed in ``RUN_BY_USERS`` with what a user runs it for. A script that nothing
  imports is a rig (or dead code);
- no module is named as a rig is (``*_check.py``, ``*_load.py``, ``*_probe.py``, ``probe.py``, ``*_fuzz.py``,
  ``*_stress.py``) unless ``RIG_NAMED_PRODUCT`` says which product part it is.
"""

from __future__ import annotations

import re

from test_architecture import PACKAGE, ROOT, import_graph

# module -> why it is where the product starts
ENTRY_POINTS: dict[str, str] = {
    "redraft": "the package a user imports (its public names load the Python API on first use)",
    "redraft.cli": "the `redraft` command (pyproject.toml [project.scripts])",
    "redraft.__main__": "python -m redraft",
    "redraft.cli.__main__": "python -m redraft.cli",
    "redraft.glide.__main__": "python -m redraft.glide",
    "redraft.api": "the Python API (Redraft)",
    "redraft.hf": "transformers' custom_generate hook",
    "redraft.integrations.vllm_proposer": "vLLM loads RedraftProposer by its class path (custom_class)",
}
# module nothing in the package imports -> what a user runs it for
RUN_BY_USERS: dict[str, str] = {
    "redraft.bench.modeltime": "`python -m redraft.bench.modeltime RESULTS.json`: the model time of a `redraft bench "
                               "run` results file (docs/benchmarks.md)",
}
# file (relative to the repository root) named as a rig is -> the product part it is
RIG_NAMED_PRODUCT: dict[str, str] = {
    "redraft/runtimes/llamacpp/probe.py": "the llama.cpp load probe: every load of a GGUF runs it (in a child "
                                          "process, cached) to choose kernels that decode batches safely",
}
RIG_NAME = re.compile(r"(^|_)(probe|check|fuzz|stress)$|_load$")


def unreachable(edges: dict[str, set[str]], roots) -> set[str]:
    """Modules of ``edges`` that no import path from ``roots`` reaches; importing a module imports its packages."""
    seen: set[str] = set()
    todo = [r for r in roots if r in edges]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parts = m.split(".")
        todo += [d for d in edges[m] if d not in seen]
        todo += [p for p in (".".join(parts[:n]) for n in range(1, len(parts))) if p in edges and p not in seen]
    return set(edges) - seen


def test_reachability_checker_on_a_synthetic_graph():
    edges = {"p": set(), "p.cli": {"p.run"}, "p.run": set(), "p.sub": set(), "p.sub.x": {"p.run"},
             "p.sub.rig": {"p.sub.x"}}
    assert unreachable(edges, ["p.cli"]) == {"p.sub", "p.sub.x", "p.sub.rig"}
    edges["p.run"] = {"p.sub.x"}  # importing p.sub.x imports p.sub too
    assert unreachable(edges, ["p.cli"]) == {"p.sub.rig"}


def test_rig_names_on_examples():
    rigs = ["vllm_check", "vllm_fleet_load", "batching_probe", "probe", "server_fuzz", "kv_stress"]
    product = ["load", "loading", "checkpoint", "fleet_bench", "probes_index", "check_depth"]
    assert [n for n in rigs if not RIG_NAME.search(n)] == []
    assert [n for n in product if RIG_NAME.search(n)] == []


def test_every_module_is_imported_from_an_entry_point_or_run_by_users():
    edges, _, _ = import_graph()
    for listed in (ENTRY_POINTS, RUN_BY_USERS):
        assert not set(listed) - set(edges), f"listed but not in the package: {sorted(set(listed) - set(edges))}"
    scripts = re.search(r"\[project\.scripts\]\n((?:\w[\w-]* = \"[\w.]+:\w+\"\n)+)",
                        (ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert scripts, "pyproject.toml: no [project.scripts]"
    for module in re.findall(r"= \"([\w.]+):", scripts.group(1)):
        assert module in ENTRY_POINTS, f"{module}: a console script not in ENTRY_POINTS"
    rigs = unreachable(edges, ENTRY_POINTS) - set(RUN_BY_USERS)
    assert not rigs, (f"modules no entry point imports: {sorted(rigs)}. A load, fault or probe rig belongs under "
                      "benchmarks/ (benchmarks/README.md); a product module must be imported by the product, or "
                      "listed in RUN_BY_USERS with what users run it for")
    still = set(RUN_BY_USERS) & (set(edges) - unreachable(edges, ENTRY_POINTS))
    assert not still, f"imported by the product now, drop them from RUN_BY_USERS: {sorted(still)}"


def test_no_module_is_named_as_a_rig():
    named = {f.relative_to(ROOT).as_posix() for f in PACKAGE.rglob("*.py") if RIG_NAME.search(f.stem)}
    assert set(RIG_NAMED_PRODUCT) <= named, f"listed but absent: {sorted(set(RIG_NAMED_PRODUCT) - named)}"
    rigs = named - set(RIG_NAMED_PRODUCT)
    assert not rigs, (f"named as rigs are: {sorted(rigs)}. Move load, fault and probe rigs to benchmarks/; a product "
                      "module so named goes in RIG_NAMED_PRODUCT with what it does for the product")
