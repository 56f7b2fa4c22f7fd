"""The house has floors and imports only go down; the services on one floor do not import each
other; no two modules import each other; no test module imports another.

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

LEVELS = [
    ("runtime",),
    ("model",),
    ("flyd", "registry", "flaps", "proxy"),
    ("nonomad",),
    ("sim",),
    ("bench",),
]
"""The floors, bottom to top: a package may import its own floor's modules and those below it.
The ground (`runtime`), the machine model (`model`: the rules of the machine contract every
service applies), the services side by side, what users touch (`nonomad`), the simulated
cluster that runs the services' own code in virtual time (`sim`: nothing below imports it),
the benchmarks."""

FLOORS = [package for level in LEVELS for package in level]
"""Every package of the house, bottom to top."""

REPLICA: dict[str, frozenset[str] | None] = {
    "registry.replica": None,
    "registry.view": None,
    "registry.rows": None,
    "registry.supply": None,
    "registry.settings": None,
    "registry.service": frozenset({"serve_replica"}),
}
"""The registry's replica, a library that flaps and the proxy embed by design (each keeps a
copy of every worker's rows and serves it): the one thing a service takes of a sibling. Each
module with the names they may take of it (None: any); of `registry.service`, only the call
that serves an embedded replica, not the standalone registry's servicer."""

EMBEDS_REPLICA = ("flaps", "proxy")

GENERATED = ("v1",)
"""Generated gRPC code (flyd/v1, ...) is the wire contract, not a floor: any floor may import
any service's messages and stubs (flyd announces itself with the registry's API, the model
reads flyd's machine messages), so the generated modules import nothing of the project but
other generated modules, and the package that holds them imports nothing on load."""


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


def package_of(module: str) -> str:
    return module.split(".")[0]


def floor_of(module: str) -> int:
    package = package_of(module)
    return next(i for i, level in enumerate(LEVELS) if package in level)


def is_generated(module: str) -> bool:
    return any(part in GENERATED for part in module.split(".")[1:])


def upward_imports(edges: Mapping[str, set[str]]) -> list[str]:
    return sorted(
        f"{src} -> {dst} ({package_of(src)} is below {package_of(dst)})"
        for src, targets in edges.items()
        for dst in targets
        if floor_of(dst) > floor_of(src) and not is_generated(dst)
    )


def names_taken(source: str, module: str) -> set[str]:
    """What `source` takes of `module` by name; "*" when it takes the module itself (`import
    registry.service`, `from registry import service`), which gives it every name."""
    parent, _, leaf = module.rpartition(".")
    taken: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and not node.level:
            if node.module == module:
                taken |= {alias.name for alias in node.names}
            elif node.module == parent and any(alias.name == leaf for alias in node.names):
                taken.add("*")
        elif isinstance(node, ast.Import) and any(
            alias.name == module or alias.name.startswith(module + ".") for alias in node.names
        ):
            taken.add("*")
    return taken


def sideways_imports(edges: Mapping[str, set[str]], sources: Mapping[str, str]) -> list[str]:
    """Imports between two services of one floor: each stands on the model, the ground and the
    generated contracts, and talks to the others over gRPC; flaps and the proxy may take of
    the registry only its replica (REPLICA)."""
    found = []
    for src, targets in edges.items():
        for dst in targets:
            mine, theirs = package_of(src), package_of(dst)
            if mine == theirs or floor_of(src) != floor_of(dst) or is_generated(dst):
                continue
            if mine in EMBEDS_REPLICA and dst in REPLICA:
                allowed = REPLICA[dst]
                extra = set() if allowed is None else names_taken(sources[src], dst) - allowed
                if not extra:
                    continue
                found.append(
                    f"{src} -> {dst} ({', '.join(sorted(extra))}: of {dst} {mine} may take "
                    f"only {', '.join(sorted(allowed or ()))}, what serves its embedded replica)"
                )
                continue
            found.append(
                f"{src} -> {dst} ({mine} and {theirs} are sibling services: they share model, "
                "runtime and the generated contracts, and talk over gRPC)"
            )
    return sorted(found)


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


TESTS = "tests"
"""The tests' package: what its test modules share lives in support modules (conftest.py,
support.py, ...), never in another test module."""


def is_test_module(module: str) -> bool:
    return module.rpartition(".")[2].startswith("test_")


def cross_test_imports(edges: Mapping[str, set[str]]) -> list[str]:
    """Imports of a test module by another. What two test modules share goes to a support
    module both import (or a conftest.py): then a test module can change, move or go without
    breaking another, and no test is collected a second time under a name imported with it."""
    return sorted(
        f"{src} -> {dst} (a test module imports another: move what they share to a support module)"
        for src, targets in edges.items()
        if is_test_module(src)
        for dst in targets
        if is_test_module(dst)
    )


def test_every_floor_is_a_package() -> None:
    for floor in FLOORS:
        assert (ROOT / floor / "__init__.py").is_file(), floor


def test_imports_only_go_down() -> None:
    assert upward_imports(graph(read_tree(ROOT))) == []


def test_services_do_not_import_each_other() -> None:
    sources = read_tree(ROOT)
    assert sideways_imports(graph(sources), sources) == []


def test_the_replica_exception_names_only_what_flaps_and_the_proxy_embed() -> None:
    """Each module of REPLICA exists and flaps or the proxy imports it: the exception is no
    wider than what they embed."""
    edges = graph(read_tree(ROOT))
    embedders = [m for m in edges if package_of(m) in EMBEDS_REPLICA]
    for module in REPLICA:
        assert module in edges, module
        assert any(module in edges[src] for src in embedders), module


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


@pytest.fixture(scope="module")
def house() -> tuple[dict[str, str], dict[str, set[str]]]:
    """The real tree's sources and imports, read once; a test plants an import in a copy."""
    sources = read_tree(ROOT)
    return sources, graph(sources)


def plant(house: tuple[dict[str, str], dict[str, set[str]]], module: str, line: str) -> list[str]:
    """What the checkers report of the house with `line` added at the end of `module`."""
    sources, edges = dict(house[0]), dict(house[1])
    sources[module] += "\n" + line + "\n"
    edges[module] = imports_of(module, sources[module], set(sources))
    return upward_imports(edges) + sideways_imports(edges, sources)


@pytest.mark.parametrize(
    ("planted_in", "line", "expected", "why"),
    [
        # a service reaching into the CLI (the roof) from the ground floor
        ("runtime.settings", "from nonomad import cli", "runtime.settings -> nonomad.cli", "below"),
        # the model knowing a service that stands on it
        ("model.slots", "from flyd import fsm", "model.slots -> flyd.fsm", "model is below flyd"),
        # the worker daemon knowing about the broker beside it, type-only
        (
            "flyd.worker",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flaps import service",
            "flyd.worker -> flaps.service",
            "flyd and flaps are sibling services",
        ),
        # the edge standing on the worker again
        ("proxy.routes", "from flyd import fsm", "proxy.routes -> flyd.fsm", "sibling"),
        # ... by a rule's old name: it no longer exists, the arrow to flyd still counts
        ("proxy.routes", "from flyd.slots import key", "proxy.routes -> flyd ", "sibling"),
        # the proxy checks a token's caveats with model.tokens, not with flaps' authorizer
        ("proxy.pins", "from flaps import auth", "proxy.pins -> flaps.auth", "sibling"),
        # a lazy import inside a function counts too
        (
            "registry.view",
            "def _f() -> None:\n    import proxy.router",
            "registry.view -> proxy.router",
            "registry and proxy are sibling services",
        ),
        # the registry's fakes are not its replica
        (
            "flaps.service",
            "from registry import fakes",
            "flaps.service -> registry.fakes",
            "sibling",
        ),
        # only flaps and the proxy embed the replica; a worker reads no view of the fleet
        (
            "flyd.worker",
            "from registry.view import View",
            "flyd.worker -> registry.view",
            "sibling",
        ),
        # of registry.service, what serves a replica; not the standalone registry's servicer
        (
            "proxy.main",
            "from registry.service import RegistryServicer",
            "proxy.main -> registry.service",
            "RegistryServicer: of registry.service proxy may take only serve_replica",
        ),
        (
            "flaps.main",
            "from registry import service",
            "flaps.main -> registry.service",
            "*: of registry.service flaps may take only serve_replica",
        ),
    ],
)
def test_a_planted_import_is_caught(
    house: tuple[dict[str, str], dict[str, set[str]]],
    planted_in: str,
    line: str,
    expected: str,
    why: str,
) -> None:
    found = plant(house, planted_in, line)
    assert len(found) == 1, found
    assert found[0].startswith(expected)
    assert why in found[0]


@pytest.mark.parametrize(
    ("planted_in", "line"),
    [
        ("proxy.pins", "from registry.view import View"),
        ("flaps.explain", "from registry import rows"),
        ("proxy.control", "from registry.service import serve_replica"),
        # the generated contracts are anyone's
        ("proxy.pins", "from flyd.v1 import worker_pb2"),
    ],
)
def test_a_planted_import_of_the_replica_or_a_contract_is_allowed(
    house: tuple[dict[str, str], dict[str, set[str]]], planted_in: str, line: str
) -> None:
    assert plant(house, planted_in, line) == []


def test_a_tree_written_with_a_cross_import_is_caught(tmp_path: Path) -> None:
    """The whole path, from files: a proxy module that takes the slot rule from flyd (as
    proxy.routes did before the rule moved to model; a re-export left behind in flyd is the
    same arrow) is refused, naming both modules."""
    tree = {
        "runtime/__init__.py": "",
        "model/__init__.py": "",
        "model/slots.py": "from flyd.v1 import machine_pb2\n",
        "flyd/__init__.py": "",
        "flyd/slots.py": "from model import slots\n",
        "flyd/v1/__init__.py": "",
        "flyd/v1/machine_pb2.py": "",
        "proxy/__init__.py": "",
        "proxy/routes.py": "from model import slots\nfrom flyd import slots as flyd_slots\n",
    }
    for name, text in tree.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    sources = read_tree(tmp_path, ["runtime", "model", "flyd", "proxy"])
    edges = graph(sources)
    assert edges["proxy.routes"] == {"model.slots", "flyd.slots"}
    assert upward_imports(edges) == []
    [found] = sideways_imports(edges, sources)
    assert found.startswith("proxy.routes -> flyd.slots (proxy and flyd are sibling services")


def test_a_planted_circle_is_caught(tmp_path: Path) -> None:
    for floor in ("runtime", "model", "flyd"):
        shutil.copytree(
            ROOT / floor, tmp_path / floor, ignore=shutil.ignore_patterns("__pycache__")
        )
    # flyd.fsm is imported by flyd.worker; fsm importing worker back closes a circle.
    fsm = tmp_path / "flyd/fsm.py"
    fsm.write_text(fsm.read_text() + "\nfrom flyd import worker\n")
    found = cycles(graph(read_tree(tmp_path, ["runtime", "model", "flyd"])))
    assert any({"flyd.fsm", "flyd.worker"} <= set(component) for component in found)


def test_no_test_module_imports_another() -> None:
    assert cross_test_imports(graph(read_tree(ROOT, [TESTS]))) == []


@pytest.fixture(scope="module")
def tests_house() -> dict[str, str]:
    """The real tests' sources, read once; a test plants an import in a copy of one."""
    return read_tree(ROOT, [TESTS])


@pytest.mark.parametrize(
    ("planted_in", "line", "expected"),
    [
        ("tests.test_access", "from tests.test_contract import SERVICES", "tests.test_contract"),
        ("tests.test_access", "import tests.test_contract", "tests.test_contract"),
        (
            "tests.flaps.test_hostile",
            "from tests.flaps import test_servicer as machines_tests",
            "tests.flaps.test_servicer",
        ),
        (
            "tests.flaps.test_hostile",
            "from .test_servicer import BAD_BIDS",
            "tests.flaps.test_servicer",
        ),
        ("tests.flaps.test_hostile", "from . import test_servicer", "tests.flaps.test_servicer"),
        ("tests.e2e.test_tenants", "from ..test_cli import alive", "tests.test_cli"),
        # a lazy import inside a test counts too
        (
            "tests.cli.test_usage",
            "def _f() -> None:\n    from tests.cli.test_machines import listed",
            "tests.cli.test_machines",
        ),
    ],
)
def test_a_planted_import_of_a_test_module_is_caught(
    tests_house: dict[str, str], planted_in: str, line: str, expected: str
) -> None:
    source = tests_house[planted_in] + "\n" + line + "\n"
    found = cross_test_imports({planted_in: imports_of(planted_in, source, set(tests_house))})
    assert len(found) == 1, found
    assert found[0].startswith(f"{planted_in} -> {expected} (a test module imports another")


@pytest.mark.parametrize(
    ("planted_in", "line"),
    [
        # what test modules share: support modules and conftest.py
        ("tests.flaps.test_hostile", "from tests.flaps.servicer_support import bid"),
        ("tests.flaps.test_hostile", "from .conftest import Fleet"),
        ("tests.e2e.test_tenants", "from tests import host_ports"),
        ("tests.runtime.test_endpoints", "from tests.runtime import _echo"),
    ],
)
def test_a_planted_import_of_a_support_module_is_allowed(
    tests_house: dict[str, str], planted_in: str, line: str
) -> None:
    source = tests_house[planted_in] + "\n" + line + "\n"
    assert cross_test_imports({planted_in: imports_of(planted_in, source, set(tests_house))}) == []
