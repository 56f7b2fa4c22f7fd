"""`nonomad up`'s workers share one host: each one's OCI machines get address and uid ranges of
their own, so no machine of one worker maps to the host uids (or address) of another's."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from flyd.drivers.oci import UIDS_PER_MACHINE
from flyd.settings import FlydSettings
from nonomad.cli_common import CliError
from nonomad.cli_local import MAX_LOCAL_WORKERS, cgroup_prefix, worker_sandbox_args
from runtime import load_settings


def _ranges(n: int) -> tuple[ipaddress.IPv4Network, range]:
    """The worker's prefix and every host uid its machines can get, as flyd reads its flags."""
    settings = load_settings(FlydSettings, worker_sandbox_args(n), prog="flyd")
    network = ipaddress.IPv4Network(settings.network)
    # As OciDriver.max_machines: one address (prefix + 2 + slot) and one uid range per slot.
    slots = min(network.num_addresses - 3, (2**32 - settings.uid_base) // UIDS_PER_MACHINE)
    return network, range(settings.uid_base, settings.uid_base + slots * UIDS_PER_MACHINE)


def test_each_worker_of_a_local_cluster_gets_disjoint_uid_and_address_ranges() -> None:
    ranges = [_ranges(n) for n in range(1, MAX_LOCAL_WORKERS + 1)]
    for i, (net_a, uids_a) in enumerate(ranges):
        assert uids_a.start >= 1 << 30  # far above any host account
        assert uids_a.stop <= 2**32 - 1  # (uid_t)-1 is never a uid
        assert len(uids_a) == (net_a.num_addresses - 3) * UIDS_PER_MACHINE  # room for a full /20
        for net_b, uids_b in ranges[i + 1 :]:
            assert not net_a.overlaps(net_b)
            assert uids_a.stop <= uids_b.start or uids_b.stop <= uids_a.start


@pytest.mark.parametrize("n", [0, MAX_LOCAL_WORKERS + 1])
def test_a_worker_beyond_the_ranges_is_refused(n: int) -> None:
    with pytest.raises(CliError, match=f"at most {MAX_LOCAL_WORKERS} workers"):
        worker_sandbox_args(n)


def test_two_clusters_on_one_host_never_share_a_workers_cgroups(tmp_path: Path) -> None:
    # Both state dirs end in "cluster", as `make up`'s does in every checkout.
    mine, theirs = tmp_path / "a" / "cluster", tmp_path / "b" / "cluster"
    assert cgroup_prefix(mine, "ams-1") != cgroup_prefix(theirs, "ams-1")
    assert cgroup_prefix(mine, "ams-1") == cgroup_prefix(mine, "ams-1")
    assert cgroup_prefix(mine, "ams-1") != cgroup_prefix(mine, "ams-2")
