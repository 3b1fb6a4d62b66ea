"""The package's shape: no import cycle, no private name imported across modules, a numpy-only corpus package, and a
command line that registers its parsers without importing torch.

The import graph is read from the source (``ast`` over ``redraft/**/*.py``), so function-level imports count as
much as module-level ones: a cycle hidden inside a function is still a cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "redraft"

def module_names() -> dict[str, Path]:
    """Dotted module name -> file; a package is named by its ``__init__.py``."""
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = f.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path], *,
               runtime_only: bool = False) -> list[tuple[str, str | None]]:
    """Every import in the file, anywhere in it: (imported module, imported name or None).

    ``from X import y`` names module ``X.y`` when that is one of ours, else module X and name y. Relative imports
    are resolved against the module's package. ``runtime_only`` leaves out the imports under
    ``if TYPE_CHECKING:`` (annotations only: never executed).
    """
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, str | None]] = []
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    if runtime_only:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                node.body = [ast.Pass()]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:
                sub = f"{source}.{a.name}"
                out.append((sub, None) if sub in modules else (source, a.name))
    return out


def import_graph(*, runtime_only: bool = False):
    """(edges: module -> set of our modules it imports, private: 'A imports B._x' lines, imports per module).
    ``runtime_only``: without the imports under ``if TYPE_CHECKING:``."""
    modules = module_names()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    private, raw = [], {}
    for m, path in modules.items():
        raw[m] = imports_of(m, path, modules, runtime_only=runtime_only)
        for target, what in raw[m]:
            dst = target
            while dst and dst not in modules:  # `import redraft.a.b` of a name inside a module: that module
                dst = dst.rpartition(".")[0]
            if not dst or dst == m:
                continue
            edges[m].add(dst)
            if what and what.startswith("_") and not what.startswith("__"):
                private.append(f"{m} imports {dst}.{what}")
    return edges, private, raw


def find_cycles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Every module set that imports itself round (strongly connected components of more than one module), as
    sorted tuples (Tarjan's algorithm)."""
    index, low, on, stack, out = {}, {}, set(), [], set()

    def visit(u):
        index[u] = low[u] = len(index)
        stack.append(u)
        on.add(u)
        for v in edges[u]:
            if v not in index:
                visit(v)
                low[u] = min(low[u], low[v])
            elif v in on:
                low[u] = min(low[u], index[v])
        if low[u] == index[u]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == u:
                    break
            if len(comp) > 1:
                out.add(tuple(sorted(comp)))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for m in sorted(edges):
        if m not in index:
            visit(m)
    return out


def test_cycle_finder_sees_a_cycle_through_a_function_level_import(tmp_path):
    # the detector itself: a -> b at module level, b -> a inside a function
    edges = {"a": {"b"}, "b": {"a"}, "c": {"a"}}
    assert find_cycles(edges) == {("a", "b")}
    assert find_cycles({"a": {"b"}, "b": set()}) == set()
    src = tmp_path / "b.py"
    src.write_text("def f():\n    from pkg.a import _helper\n")
    assert imports_of("pkg.b", src, {"pkg.a": src, "pkg.b": src}) == [("pkg.a", "_helper")]


def test_no_import_cycles():
    edges, _, _ = import_graph()
    cycles = find_cycles(edges)
    assert cycles == set(), f"import cycles: {sorted(cycles)}"


def test_no_private_names_imported_across_modules():
    _, private, _ = import_graph()
    assert not private, f"private names imported: {sorted(set(private))}"


def test_cli_commands_import_only_the_shared_leaf():
    """Each command module may import redraft.cli.common, never another command or the package (a cycle through
    ``redraft.cli``'s registration)."""
    edges, _, _ = import_graph()
    leaves = {"redraft.cli.argtypes", "redraft.cli.glide_args"}  # CLI-only helpers below common
    for m, deps in edges.items():
        if m.startswith("redraft.cli.") and m != "redraft.cli.__main__" and m not in leaves | {"redraft.cli.common"}:
            bad = {d for d in deps if d.startswith("redraft.cli") and d != "redraft.cli.common"}
            assert not bad, f"{m} imports {sorted(bad)}"
    assert not {d for d in edges["redraft.cli.common"] if d.startswith("redraft.cli")} - leaves
    for leaf in leaves:
        assert not {d for d in edges[leaf] if d.startswith("redraft.cli")} - leaves, leaf


def test_corpus_package_needs_only_numpy():
    """redraft.corpus is reusable by other engines: no torch, no transformers, nothing else of redraft but the
    atomic writer every redraft file goes through, itself standard library only."""
    _, _, raw = import_graph()
    shared = "redraft.io.atomic"
    for m, imports in raw.items():
        if m == "redraft.corpus" or m.startswith("redraft.corpus."):
            for target, _ in imports:
                top = target.split(".")[0]
                assert top not in ("torch", "transformers"), f"{m} imports {target}"
                ours = target in ("redraft.corpus", shared) or target.startswith("redraft.corpus.")
                assert top != "redraft" or ours, f"{m} imports {target}"
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    assert {target.split(".")[0] for target, _ in raw[shared]} <= stdlib, f"{shared}: {raw[shared]}"


@pytest.mark.parametrize("code", [
    "from redraft.cli import build_parser; build_parser()",
    "from redraft.cli import main; main(['corpus', 'stats', '--help'])",
])
def test_parser_registration_imports_no_torch(code):
    """Every `redraft` start builds the whole parser: it must not pay torch's import (~1 s)."""
    probe = (f"import sys\ntry:\n    {code}\nexcept SystemExit:\n    pass\n"
             "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, "
             "sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))[:5]")
    r = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
