"""No import loops in the installed packages: the static import graph of whale_ray/, actors/ and domains/,
read with ast. Every import counts, also those inside functions and under `if TYPE_CHECKING:` (a loop
hidden in a function is still a loop in the design). The same for the test suite's bounds: test modules sit in
folders by capability and import neither conftest.py nor one another (what they share is tests/helpers.py's)."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
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


def from_base(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` reads from, a relative one resolved against `package`."""
    if not node.level:
        return node.module or ""
    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join(up + ([node.module] if node.module else []))


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
                base = from_base(node, package)
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


def imports_ray(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ray" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "ray":
            return True
    return False


def reachable(g: dict[str, set[str]], roots: list[str]) -> set[str]:
    seen: set[str] = set()
    stack = list(roots)
    while stack:
        m = stack.pop()
        if m not in seen:
            seen.add(m)
            stack.extend(g.get(m, ()))
    return seen


def loaded_by(imports: list[str], package: str) -> list[str]:
    """The modules of `package` that importing `imports` loads, in a fresh interpreter."""
    import subprocess
    import sys

    probe = "import importlib, sys\n" + "".join(f"importlib.import_module({m!r})\n" for m in imports) + \
        f"print(sorted(n for n in sys.modules if n == {package!r} or n.startswith({package + '.'!r})))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return ast.literal_eval(out.stdout.strip())


def test_the_loop_and_the_sandbox_import_no_ray() -> None:
    """The algorithm and the sandbox run without Ray (tests/loop/test_loop.py drives the loop in process; the sandbox
    is a subprocess matter): none of their modules imports it, and importing them all leaves it unloaded."""
    mods = modules()
    ours = [m for m in mods if m.startswith(("whale_ray.loop", "whale_ray.sandbox"))]
    assert len(ours) > 10 and not [m for m in ours if imports_ray(mods[m])]
    assert loaded_by(ours, "ray") == []


def test_the_policy_server_and_the_sandbox_layers_keep_their_bounds() -> None:
    """The PolicyServer only receives weights: nothing it or the policy library imports reaches the Trainer, its
    workers or the weight syncs that send (actors/weight_sync.py); the loop reaches no actor at all, only the
    roles it is handed. The sandbox's frame codec, limits and uid pool sit under the episode and the runner,
    never above them."""
    mods = modules()
    g = import_graph(mods)
    senders = {"actors.trainer", "actors.trainer_worker", "actors.weight_sync", "actors.broadcast_sync",
               "actors.coordinator"}
    assert senders <= set(mods)
    receivers = ["actors.policy_server", *(m for m in mods if m.startswith("whale_ray.policy"))]
    assert not reachable(g, receivers) & senders
    assert not {m for m in reachable(g, [m for m in mods if m.startswith("whale_ray.loop")]) if m.startswith("actors")}
    low = ["whale_ray.sandbox.frames", "whale_ray.sandbox.limits", "whale_ray.sandbox.uid_pool"]
    assert all(m in mods for m in low)
    assert not reachable(g, low) & {"whale_ray.sandbox.episode", "whale_ray.sandbox.runner"}


def test_reading_a_config_imports_no_torch() -> None:
    """The config names the engines from their registry, and a checkpoint is checked before any engine starts:
    neither costs a process torch (whale_ray/policy/__init__.py imports nothing)."""
    assert loaded_by(["whale_ray.config", "whale_ray.policy.engine_registry", "whale_ray.policy.checkpoint"],
                     "torch") == []


# --- the test suite ---------------------------------------------------------------------------------------------------
TESTS = REPO / "tests"


def imported_names(path: Path, source: str | None = None) -> set[str]:
    """Every module a file of tests/ imports, by its dotted name (relative imports resolved); `from p import m`
    counts as p and as p.m, since m may be a module."""
    package = ".".join(path.relative_to(REPO).parent.parts)
    names: set[str] = set()
    for node in ast.walk(ast.parse(source if source is not None else path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, package)
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def suite_modules() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def forbidden_imports(path: Path, source: str | None = None) -> set[str]:
    """What `path` imports of conftest.py or of a test module (by package path or bare name): fixtures reach a
    test through pytest, and code two tests share belongs in tests/helpers.py, not in one of them."""
    tests = {".".join(p.relative_to(REPO).with_suffix("").parts) for p in suite_modules()}
    banned = tests | {t.rpartition(".")[2] for t in tests} | {"conftest", "tests.conftest"}
    return imported_names(path, source) & banned


def test_the_test_modules_sit_in_capability_folders_that_are_packages() -> None:
    found = suite_modules()
    assert len(found) > 40 and not [p for p in found if p.parent == TESTS], "a test module at the top of tests/"
    assert all((p.parent / "__init__.py").is_file() for p in found) and (TESTS / "__init__.py").is_file()


def test_the_scan_sees_imports_of_conftest_and_of_test_modules() -> None:
    assert "tests.helpers" in imported_names(TESTS / "cluster" / "test_cluster_pool.py")  # in a function only
    serve = TESTS / "serve" / "test_serve_layouts.py"
    bad = "from tests.conftest import SMALL\nfrom tests.serve import test_serve\nfrom .test_serve_lag import LoopLag\n"
    assert forbidden_imports(serve, bad) == {"tests.conftest", "tests.serve.test_serve", "tests.serve.test_serve_lag"}
    assert forbidden_imports(serve, "import conftest, test_redteam\n") == {"conftest", "test_redteam"}
    assert forbidden_imports(serve, "from tests.helpers import Run\n") == set()


def test_no_test_file_imports_conftest_or_a_test_module() -> None:
    """Over every Python file of tests/ (helpers too: a helper that imported a test module would be the same
    dependency one step removed)."""
    found = {str(p.relative_to(REPO)): sorted(bad)
             for p in sorted(TESTS.rglob("*.py")) if (bad := forbidden_imports(p))}
    assert not found, found
