"""`nonomad machines run --disk`: what a machine's disk is, and where it is not limited.

A real fleet: a worker of the default driver (OCI where crun runs: a filesystem of the
machine's own) in ams, a `--driver process` worker in lab, whose machines write to the host's
filesystem unbounded; `machines run` says so there, and `machines show` gives the size.
"""

from __future__ import annotations

from tests.cli.conftest import CliFleet
from tests.flaps.conftest import Fleet, eventually
from tests.flyd.driver_support import OCI_UNAVAILABLE


async def test_machines_run_says_where_a_disk_is_not_limited(fleet: Fleet) -> None:
    assert fleet.security is not None
    fleet.add_worker("ams-1", "ams")
    fleet.add_worker("lab-1", "lab", "--driver", "process")
    fleet.add_flaps()
    cli = CliFleet(fleet, fleet.security)
    async with cli.client() as flaps:

        async def both_alive() -> bool:
            regions = {r.name: r.alive_workers for r in await flaps.list_regions()}
            return regions == {"ams": 1, "lab": 1}

        await eventually(both_alive, 30, "both workers alive in flaps")

    run = ("machines", "run", "web", "--image", "demo:v1", "--memory", "64", "--disk", "32")
    lab, ams = await cli(*run, "--region", "lab"), await cli(*run, "--region", "ams")
    assert lab.code == 0, lab.err
    lab_id = lab.out.split()[0]
    assert lab.out.splitlines()[1] == (
        "disk: 32 MiB reserved, not limited: worker lab-1 runs machines as host processes"
    )
    assert ams.code == 0, ams.err
    if OCI_UNAVAILABLE is None:  # ams-1 runs OCI machines: limited, nothing to say
        assert "disk:" not in ams.out
    shown = await cli("machines", "show", lab_id)
    assert ["disk", "32", "MiB"] in [line.split() for line in shown.out.splitlines()], shown.out
    # Out of range: refused by flaps, naming the field, and nothing is made.
    tiny = await cli(*run[:-1], "8", "--region", "ams")
    assert tiny.code == 1
    assert "config.guest.disk_mib" in tiny.err
    listed = await cli("machines", "list", "web", "--json")
    assert len(listed.json()) == 2
