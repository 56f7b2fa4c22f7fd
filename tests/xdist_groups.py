"""Which tests run together on one pytest-xdist worker (`make test`: `-n 2 --dist loadgroup`).

A test goes to whichever worker is free, except:

- the tests of a module that share a fixture of module (or class, or package) scope go to one
  worker together, a group named for the module: split over two workers, each would make that
  fixture (a cluster of processes) for itself;
- tests that name an `xdist_group` go with the others of that group, across modules: the ones
  that must not run at the same time as each other (each says why).

xdist's own `loadgroup` learns a test's group from a suffix it adds to the test's node id on
the worker, which pytest 9.2 no longer lets it change (pytest-xdist issue 1386: the tests are
then handed out one by one, every group ignored). So the workers write each grouped test's
group to a file of a directory the controller made and named in NONOMAD_XDIST_GROUPS, and the
controller's scheduler (`GroupScheduling`, in xdist's place) reads them once every worker has
collected, before it hands out anything. (Should xdist's suffix come back, it is honoured too.)
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadGroupScheduling

GROUPS_DIR = "NONOMAD_XDIST_GROUPS"
# The scopes of a fixture that a module's tests share.
SHARED_SCOPES = {"module", "class", "package"}


def group_of(item: pytest.Item) -> str | None:
    """The group `item` runs in: the names of its `xdist_group` marks, joined as xdist joins
    them; else its module's, when it uses a fixture shared by the module; else None."""
    names = {
        str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
        for mark in item.iter_markers("xdist_group")
    }
    if names:
        return "_".join(sorted(names))
    fixtures = getattr(item, "_fixtureinfo", None)
    if fixtures is not None:
        scopes = {defs[-1].scope for defs in fixtures.name2fixturedefs.values() if defs}
        if scopes & SHARED_SCOPES:
            return item.nodeid.split("::")[0]
    return None


def _is_controller(config: pytest.Config) -> bool:
    return (
        "PYTEST_XDIST_WORKER" not in os.environ
        and bool(config.getoption("numprocesses", None))
        and config.getoption("dist", "no") == "loadgroup"
    )


def pytest_configure(config: pytest.Config) -> None:
    if _is_controller(config):  # before the workers start: they inherit the environment
        os.environ[GROUPS_DIR] = tempfile.mkdtemp(prefix="nonomad-xdist-groups-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _is_controller(config) and GROUPS_DIR in os.environ:
        shutil.rmtree(os.environ.pop(GROUPS_DIR), ignore_errors=True)


@pytest.hookimpl(trylast=True)  # the items as collected and selected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    worker, where = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get(GROUPS_DIR)
    if worker is None or where is None:
        return
    groups = {item.nodeid: group for item in items if (group := group_of(item)) is not None}
    part = Path(where) / f"{worker}.json.part"
    part.write_text(json.dumps(groups))
    part.rename(part.with_suffix(""))  # whole, before the worker reports its collection


class GroupScheduling(LoadGroupScheduling):
    """xdist's loadgroup, with each test's group read from what the workers wrote."""

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        super().__init__(config, log)
        self._groups: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._groups is None:  # every worker has collected: schedule() asks only then
            self._groups = {}
            for written in sorted(Path(os.environ[GROUPS_DIR]).glob("*.json")):
                self._groups.update(json.loads(written.read_text()))
        group = self._groups.get(nodeid)
        return super()._split_scope(nodeid) if group is None else group


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> GroupScheduling | None:
    """Ours for `--dist loadgroup`; xdist's own (a trylast hook) for every other mode."""
    return GroupScheduling(config, log) if _is_controller(config) else None
