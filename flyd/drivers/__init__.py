"""Drivers: how flyd runs a machine's process on its host.

`base` is the contract the worker is written against (`Driver`, the spec and its limits, the
handle, the exit status); `flyd.fakes.FakeDriver` is its scripted fake. The process driver runs
each machine as a host process group:

- `process`: `ProcessDriver`: held starts, signals and stops, exits, re-attaching after a restart
- `wrapper`: the `/bin/sh` wrapper every machine runs under, and its exit records
- `rundir`: what the driver keeps on disk per machine, and `kill_all`
- `procfs`: telling processes apart (/proc, boot id, pidfds)
- `cgroups`: cgroup v1 limits and the OOM verdict
- `logs`: machine output: rotation, tails, followers
- `spares`: run dirs and cgroups made ahead of need
"""
