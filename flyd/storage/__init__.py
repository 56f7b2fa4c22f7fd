"""Storage on a worker's own disk: a filesystem per limit.

Every byte a machine writes goes to a filesystem of its own whose size is its limit: the
writable layer of an OCI machine (`guest.disk_mib`, see `flyd.drivers.oci`) and, later,
volumes. A machine that fills it gets ENOSPC; its worker, flyd's log and other machines are
untouched, because nothing it writes lands on the worker's filesystem.

- `diskfile`: the default backend, which needs nothing from the operator: a sparse file with
  an ext4 filesystem in it (create, mount detached, grow offline, remove)
- `kernel`: the loop device and mount syscalls it is made of
"""
