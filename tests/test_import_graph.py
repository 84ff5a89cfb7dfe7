"""No import loops in the installed packages: the static import graph of whale_ray/, actors/ and domains/,
read with ast. Every import counts, also those inside functions and under `if TYPE_CHECKING:` (a loop
hidden in a function is still a loop in the design)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("whale_ray", "actors", "domains")


def modules() -> dict[str, Path]:
    out = {}
    for top in PACKAGES:
        for path in sorted((REPO / top).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (a name imported from a package resolves to its submodule
    when there is one, else to the package)."""

    def ours(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    g: dict[str, set[str]] = {}
    for name, path in mods.items():
        g[name] = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                dep = ours(t)
                if dep is not None and dep != name:
                    g[name].add(dep)
    return g


def test_the_graph_sees_real_imports() -> None:
    g = import_graph(modules())
    assert "whale_ray.selection" in g["whale_ray.archive"]  # `from whale_ray import selection`: the module
    assert "whale_ray.proposers.llm" in g["whale_ray.proposers.registry"]  # an import inside a function
    assert "whale_ray.proposers.registry" in g["actors.harness_proposer"]
    assert "whale_ray.sandbox.isolation" in g["whale_ray.proposers.agent_cli"]
    assert len(g) > 40


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Import loops, one per loop found: each found loop is cut at one edge and the search goes on."""
    g = {k: set(v) for k, v in g.items()}
    found = []
    while True:
        try:
            graphlib.TopologicalSorter(g).prepare()
            return found
        except graphlib.CycleError as e:
            loop = e.args[1]  # [a, b, ..., a], each one a dependency (graphlib: predecessor) of the next
            found.append(loop[::-1])  # as imports read: a imports b imports ...
            g[loop[1]].discard(loop[0])


def test_the_loop_finder_finds_each_loop() -> None:
    g = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(sorted(set(c)) for c in cycles(g)) == [["a", "b"], ["c", "d", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    found = cycles(import_graph(modules()))
    assert not found, "import loops: " + "; ".join(" -> ".join(c) for c in found)


def test_the_config_offers_exactly_the_registered_proposer_kinds() -> None:
    """The config's choice list (and the CLI's, built from it) names the registry's kinds, no more, no fewer."""
    from typing import get_args

    from whale_ray.config import HarnessPhaseConfig
    from whale_ray.proposers.registry import PROPOSER_KINDS

    assert get_args(HarnessPhaseConfig.model_fields["proposer"].annotation) == PROPOSER_KINDS


def test_reading_a_config_imports_no_torch() -> None:
    """The config names the engines from their registry, and a checkpoint is checked before any engine starts:
    neither costs a process torch (whale_ray/policy/__init__.py imports nothing)."""
    import subprocess
    import sys

    code = ("import sys, whale_ray.config, whale_ray.policy.engine_registry, whale_ray.policy.checkpoint; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
