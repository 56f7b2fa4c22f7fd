"""The house has floors and imports only go down; no two modules import each other.

Read from the source with `ast`, so every import counts: at the top of a module, inside a
function, or under `if TYPE_CHECKING:` (a type-only import is still an arrow of knowledge).
"""

from __future__ import annotations

import ast
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FLOORS = ["runtime", "model", "flyd", "registry", "flaps", "proxy", "nonomad", "bench"]
"""The allowed order, bottom to top: a package may import its own floor and those below it."""

GENERATED = ("v1",)
"""Generated gRPC code (flyd/v1, ...) is the wire contract, not a floor: any floor may import
any service's messages and stubs (flyd announces itself with the registry's API), so the
generated modules import nothing of the project but other generated modules, and the package
that holds them imports nothing on load."""


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_tree(root: Path, floors: Iterable[str] = FLOORS) -> dict[str, str]:
    """Every module of the floors under `root`, by dotted name, with its source."""
    sources = {}
    for floor in floors:
        for path in sorted((root / floor).rglob("*.py")):
            sources[module_name(root, path)] = path.read_text()
    return sources


def imports_of(name: str, source: str, modules: set[str]) -> set[str]:
    """The project modules `name` imports (`from a import b` counts as a.b when that is a
    module, else as a)."""
    is_package = f"{name}.__init__" in modules or any(m.startswith(name + ".") for m in modules)
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            # `import a.b.c` names a.b.c; keep the longest prefix that is a project module.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph(sources: Mapping[str, str]) -> dict[str, set[str]]:
    modules = set(sources)
    return {name: imports_of(name, source, modules) for name, source in sources.items()}


def floor_of(module: str) -> int:
    return FLOORS.index(module.split(".")[0])


def is_generated(module: str) -> bool:
    return any(part in GENERATED for part in module.split(".")[1:])


def upward_imports(edges: Mapping[str, set[str]]) -> list[str]:
    return sorted(
        f"{src} -> {dst} ({FLOORS[floor_of(src)]} is below {FLOORS[floor_of(dst)]})"
        for src, targets in edges.items()
        for dst in targets
        if floor_of(dst) > floor_of(src) and not is_generated(dst)
    )


def cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_floor_is_a_package() -> None:
    for floor in FLOORS:
        assert (ROOT / floor / "__init__.py").is_file(), floor


def test_imports_only_go_down() -> None:
    assert upward_imports(graph(read_tree(ROOT))) == []


def test_no_module_imports_itself_in_a_circle() -> None:
    assert cycles(graph(read_tree(ROOT))) == []


def test_generated_code_imports_only_generated_code() -> None:
    edges = graph(read_tree(ROOT))
    generated = [module for module in edges if is_generated(module)]
    assert "registry.v1.registry_pb2_grpc" in generated
    for module in generated:
        assert all(is_generated(target) for target in edges[module]), module


def test_importing_a_stub_loads_no_service_code() -> None:
    """`import registry.v1.registry_pb2` runs registry/__init__.py first: it must import
    nothing, or a client of the registry's API would load the registry above it."""
    edges = graph(read_tree(ROOT))
    for module in edges:
        if is_generated(module):
            owner = module.split(".")[0]
            assert edges[owner] == set(), owner


@pytest.mark.parametrize(
    ("planted_in", "line", "expected"),
    [
        # a service reaching into the CLI (the roof) from the ground floor
        ("runtime/settings.py", "from nonomad import cli\n", "runtime.settings -> nonomad.cli"),
        # the worker daemon knowing about the broker above it, type-only
        (
            "flyd/worker.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flaps import service\n",
            "flyd.worker -> flaps.service",
        ),
        # a lazy import inside a function counts too
        (
            "registry/view.py",
            "def _f() -> None:\n    import proxy.router\n",
            "registry.view -> proxy.router",
        ),
    ],
)
def test_a_planted_upward_import_is_caught(
    tmp_path: Path, planted_in: str, line: str, expected: str
) -> None:
    for floor in FLOORS:
        shutil.copytree(
            ROOT / floor, tmp_path / floor, ignore=shutil.ignore_patterns("__pycache__")
        )
    target = tmp_path / planted_in
    target.write_text(target.read_text() + "\n" + line)
    found = upward_imports(graph(read_tree(tmp_path)))
    assert len(found) == 1
    assert found[0].startswith(expected)


def test_a_planted_circle_is_caught(tmp_path: Path) -> None:
    for floor in ("runtime", "flyd"):
        shutil.copytree(
            ROOT / floor, tmp_path / floor, ignore=shutil.ignore_patterns("__pycache__")
        )
    # flyd.fsm is imported by flyd.worker; fsm importing worker back closes a circle.
    fsm = tmp_path / "flyd/fsm.py"
    fsm.write_text(fsm.read_text() + "\nfrom flyd import worker\n")
    found = cycles(graph(read_tree(tmp_path, ["runtime", "flyd"])))
    assert any({"flyd.fsm", "flyd.worker"} <= set(component) for component in found)
