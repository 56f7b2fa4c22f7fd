"""Removing a machine's memory cgroup leaves nothing charged to it (real cgroup v1)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from flyd.drivers.cgroups import force_empty, joining, limit_memory, remove_tree

MEMORY = Path("/sys/fs/cgroup/memory")

pytestmark = pytest.mark.skipif(
    not (MEMORY / "cgroup.procs").is_file() or os.geteuid() != 0,
    reason="needs root and a cgroup v1 memory controller at /sys/fs/cgroup/memory",
)


def _usage(cg: Path) -> int:
    return int((cg / "memory.usage_in_bytes").read_text())


def test_force_empty_reclaims_the_page_cache_a_machine_left(prefix: str, tmp_path: Path) -> None:
    """The page cache of a file written from inside the cgroup stays charged to it after its
    processes end (and would keep the cgroup alive once removed); force_empty reclaims it."""
    cg = MEMORY / prefix / "m1"
    cg.mkdir(parents=True)
    data = tmp_path / "data"
    # A process that joins the cgroup and writes 8 MiB: page cache charged to the cgroup.
    subprocess.run(
        [
            "sh",
            "-c",
            f'echo $$ > {cg}/cgroup.procs && head -c 8388608 /dev/zero > "$1"',
            "sh",
            data,
        ],
        check=True,
    )
    assert _usage(cg) >= 4 << 20
    force_empty(cg)
    assert _usage(cg) < 1 << 20
    assert data.stat().st_size == 8 << 20  # reclaimed from memory, not lost
    assert remove_tree(cg)
    assert not cg.exists()


def test_force_empty_of_a_cgroup_that_is_gone_or_has_no_memory_controller(
    prefix: str, tmp_path: Path
) -> None:
    with pytest.raises(FileNotFoundError):
        force_empty(MEMORY / prefix / "never-made")
    force_empty(tmp_path)  # a directory without memory.force_empty: nothing to do


def test_a_memory_limit_of_its_own_holds_a_process_to_it(prefix: str, tmp_path: Path) -> None:
    """limit_memory, as `nonomad up` gives each worker's flyd: a process in it that asks for
    more than the limit is killed there, and the host's memory is untouched."""
    cg = MEMORY / prefix
    cg.mkdir()
    own = cg / "flyd"
    limit_memory(own, 32 << 20)
    assert int((own / "memory.limit_in_bytes").read_text()) == 32 << 20
    limit_memory(own, 48 << 20)  # again, on the one that is there: only the limit changes
    assert int((own / "memory.limit_in_bytes").read_text()) == 48 << 20
    # A program started joining it runs there, as the process started (the shell exec'd it)...
    show = "import os; print(os.getpid()); print(open('/proc/self/cgroup').read())"
    with subprocess.Popen(
        joining(own, ["python3", "-c", show]), stdout=subprocess.PIPE, text=True
    ) as proc:
        pid, cgroups = proc.communicate()[0].split("\n", 1)
    assert (proc.returncode, int(pid)) == (0, proc.pid)
    assert f"memory:/{prefix}/flyd\n" in cgroups
    # ...and a greedy one is killed by the kernel within the cgroup, at its limit.
    greedy = subprocess.run(
        joining(own, ["python3", "-c", "b = bytearray(256 << 20)"]), check=False
    )
    assert greedy.returncode == -9
    assert int((own / "memory.max_usage_in_bytes").read_text()) <= 48 << 20
    assert remove_tree(cg)
    # Where it cannot join (the cgroup is gone), the program never starts.
    never = subprocess.run(
        joining(own, ["touch", str(tmp_path / "ran")]), capture_output=True, check=False
    )
    assert never.returncode != 0
    assert not (tmp_path / "ran").exists()
