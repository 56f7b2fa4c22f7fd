"""Drivers: how flyd runs a machine on its host.

`base` is the contract the worker is written against (`Driver`, the spec and its limits, the
published ports, the handle, the exit status); `flyd.fakes.FakeDriver` is its scripted fake.
Two real drivers share `wrapped` (a `/bin/sh` wrapper per machine that records its exit, held
starts, re-attaching after a restart, exits through pidfds, cgroups, logs, held ports):

- `oci`: `OciDriver`: each machine a crun container, a sandbox of its own (the default where
  the host can run it; `crun` says whether it can)
- `process`: `ProcessDriver`: each machine a host process group (for hosts without crun)

and, under them:

- `bundle`: an OCI machine's runtime spec (rootfs, namespaces, mounts, the hold hook);
  `seccomp`: its system call filter
- `netd`: the process that holds OCI machines' networks and published ports (outliving flyd);
  `netclient`: flyd's side of it; `netlink`: the rtnetlink and sock_diag requests it makes;
  `namespaces`: unshare, setns, user namespaces and ID-mapped mount trees
- `ports`: host ports held from the moment they are handed out
- `wrapper`: the `/bin/sh` wrappers, and their exit records
- `rundir`: what a driver keeps on disk per machine, and `kill_all`
- `procfs`: telling processes apart (/proc, boot id, pidfds)
- `cgroups`: cgroup v1 limits and the OOM verdict
- `logs`: machine output: the copier that writes and rotates it, bounded tails, followers
- `fdlimit`: the descriptor limit of flyd's processes, and how many machines it holds
- `spares`: run dirs and cgroups made ahead of need
- `writable`: an OCI machine's writable layer, on a disk of its own (`flyd.storage`)
"""
