"""The package's layers: a lower layer never imports a higher one, so data flows one way (drafters -> token tree ->
verify -> accepted tokens) and each layer can be read, tested and reused without the ones above it.

From the bottom up (``LAYERS``):

0. ``redraft.defaults``, ``redraft.tree``, ``redraft.io`` (prompt, model and file helpers);
1. ``redraft.corpus`` (numpy only), ``redraft.glide`` (the draft network) and ``redraft.grammar`` (output
   constraints and their per-row masks), side by side: none imports another;
2. ``redraft.io.freeze``: prompt files and ``[TOKENS]`` logs -> corpus spans; it reads the corpus formats, so it sits
   above the corpus although it lives with the other file helpers; beside it ``redraft.pricing``, the price of a
   forward (measuring it on a duck-typed target, fitting, caching, pricing drafts and chunks), below the policy that
   prices with its curve and the decode step that measures through it;
3. ``redraft.drafters``; 4. ``redraft.policy`` (numpy only: it takes a cost curve, never a model);
5. ``redraft.runtimes`` (where the target runs: transformers, llama.cpp, the step-function protocol between the
   loop and a runtime's batcher); 6. ``redraft.decoding`` (the decode step, driving a target);
7. ``redraft.compose`` (the one composition point: configuration -> drafters, policy, engine);
8. front ends: ``redraft.cli``, ``redraft.server``, ``redraft.bench``, ``redraft.training``,
   ``redraft.integrations``, the ``__main__`` entry points, any public API module at the package root and the package
   root itself (its version, and the public API names it re-exports on first use: ``from redraft import Redraft``). Front ends
   may use one another (``redraft bench serve`` starts the server); cycles are refused by test_architecture.py.

A module may import its own group (the same row of ``LAYERS``), any module of a lower layer, and, in layer 0 and
among the front ends, the other groups of its layer. Imports under ``if TYPE_CHECKING:`` are annotations only and
do not count. Function-level imports count. A new subpackage must be given its layer here.
"""

from __future__ import annotations

from test_architecture import import_graph

FRONT_END = 8
# dotted prefix -> layer; the longest matching prefix places a module
LAYERS: dict[str, int] = {
    "redraft": FRONT_END, "redraft.defaults": 0, "redraft.tree": 0, "redraft.io": 0,
    "redraft.corpus": 1, "redraft.glide": 1, "redraft.grammar": 1,
    "redraft.io.freeze": 2, "redraft.pricing": 2,
    "redraft.drafters": 3,
    "redraft.policy": 4,
    "redraft.runtimes": 5,
    "redraft.decoding": 6,
    "redraft.compose": 7,
    "redraft.cli": FRONT_END, "redraft.server": FRONT_END, "redraft.bench": FRONT_END,
    "redraft.training": FRONT_END, "redraft.integrations": FRONT_END,
    "redraft.__main__": FRONT_END, "redraft.glide.__main__": FRONT_END,
}
SHARED_LAYERS = {0, FRONT_END}  # layers whose groups may import one another


def place(module: str, layers: dict[str, int] = LAYERS) -> tuple[str, int]:
    """(group, layer) of a dotted module name: its longest prefix in ``layers``. A module at the package root that
    is not listed is a public API module (a front end). Raises LookupError for a module of an unlisted subpackage."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        key = ".".join(parts[:n])
        if key in layers:
            if key == parts[0] and len(parts) > 1:  # only the package root itself matched
                if len(parts) == 2:
                    return module, FRONT_END
                raise LookupError(f"{module}: its subpackage has no layer in LAYERS")
            return key, layers[key]
    raise LookupError(f"{module}: not in the package")


def violations(edges: dict[str, set[str]], layers: dict[str, int] = LAYERS) -> list[str]:
    """'a (layer i) imports b (layer j)' for each edge a -> b that goes up, or sideways between two groups of a
    layer outside ``SHARED_LAYERS``."""
    out = []
    for a, deps in sorted(edges.items()):
        ga, la = place(a, layers)
        for b in sorted(deps):
            gb, lb = place(b, layers)
            if gb == ga or lb < la or (lb == la and la in SHARED_LAYERS):
                continue
            out.append(f"{a} (layer {la}: {ga}) imports {b} (layer {lb}: {gb})")
    return out


def test_checker_sees_an_upward_and_a_sideways_import():
    layers = {"p": 0, "p.low": 0, "p.mid": 1, "p.side": 1, "p.top": 2}
    edges = {"p.low": {"p.mid"}, "p.mid": {"p.low", "p.mid.x"}, "p.mid.x": set(), "p.side": {"p.mid"},
             "p.top": {"p.mid", "p.low"}, "p.api": {"p.top"}}
    assert violations(edges, layers) == ["p.low (layer 0: p.low) imports p.mid (layer 1: p.mid)",
                                         "p.side (layer 1: p.side) imports p.mid (layer 1: p.mid)"]
    assert place("p.api", layers) == ("p.api", FRONT_END)  # an unlisted module at the root: a public API module


def test_every_module_has_a_layer():
    edges, _, _ = import_graph()
    unplaced = []
    for m in edges:
        try:
            place(m)
        except LookupError as e:
            unplaced.append(str(e))
    assert not unplaced, "\n".join(unplaced)


def test_lower_layers_never_import_higher_ones():
    edges, _, _ = import_graph(runtime_only=True)
    bad = violations(edges)
    assert not bad, "imports against the layering (see this module's docstring):\n" + "\n".join(bad)


def test_type_checking_imports_are_left_out():
    """The drafter protocol names HFTarget in annotations only: that import is not a runtime edge upward."""
    edges_all, _, _ = import_graph()
    edges_runtime, _, _ = import_graph(runtime_only=True)
    assert "redraft.runtimes.transformers.target" in edges_all["redraft.drafters.base"]
    assert "redraft.runtimes.transformers.target" not in edges_runtime["redraft.drafters.base"]
