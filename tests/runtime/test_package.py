"""`runtime` serves its public names on first use: a CLI command that needs a validator or a
status reader does not load the server, the settings and pydantic (PEP 562 `__getattr__`)."""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys

import pytest

import runtime


def loaded_after(statement: str) -> set[str]:
    """The modules a fresh interpreter has loaded after running `statement`."""
    probe = f"import sys; {statement}; import json; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    return set(json.loads(out))


@pytest.mark.parametrize(
    "statement",
    [
        "import runtime",
        "import runtime.validate",
        "from runtime import parse_host_port",
        "from runtime.status import error_info",
        "import nonomad.cli",
        "import nonomad.client",
    ],
)
def test_a_light_import_leaves_the_server_and_the_settings_unloaded(statement: str) -> None:
    heavy = {"runtime.server", "runtime.settings", "pydantic", "pydantic_settings"}
    assert loaded_after(statement) & heavy == set()


def test_a_name_loads_its_module_when_first_asked_for() -> None:
    loaded = loaded_after("from runtime import Service")
    assert "runtime.server" in loaded


def type_checking_names() -> dict[str, str]:
    """The names the `if TYPE_CHECKING:` block of runtime/__init__.py imports, by module."""
    tree = ast.parse(inspect.getsource(runtime))
    block = next(
        node
        for node in tree.body
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"
    )
    return {
        alias.name: str(node.module)
        for node in block.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def test_what_type_checkers_see_is_what_the_package_serves() -> None:
    served = {name: runtime._HOME_OF[name] for name in runtime.__all__}
    assert type_checking_names() == served
    for name, module in served.items():
        assert getattr(runtime, name) is getattr(sys.modules[module], name)


def test_an_unknown_name_is_an_attribute_error_and_a_submodule_still_imports() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nonesuch'"):
        _ = runtime.nonesuch  # type: ignore[attr-defined]
    from runtime import clock  # a submodule, not a served name

    assert clock.__name__ == "runtime.clock"
