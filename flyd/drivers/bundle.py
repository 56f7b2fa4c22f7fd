"""The OCI runtime spec (a bundle's `config.json`) of one machine run.

What the machine gets:

- its rootfs: `<run dir>/rootfs` (seen through `Bundle.view`), where the wrapper mounts the
  overlay of the image (lower,
  shared, ID-mapped so the machine's root owns it) and the machine's `upper/` (see
  `flyd.drivers.oci`);
- namespaces: pid, ipc, uts (hostname = machine id), mount, and, joined by path: the user
  namespace netd made (container root is a host uid range of its own) and the network
  namespace it owns (so its sysfs shows the machine's own devices, and no host uevent reaches
  it: see `flyd.drivers.namespaces.new_user_and_network_namespaces`), and a cgroup namespace
  rooted at the machine's own cgroups (`flyd.drivers.cgroups.namespace_at`): crun unshares
  one before the hook has moved the container, which would root it at crun's cgroups and
  show the host's paths;
- a minimal /dev (crun's standard nodes, pts, shm, mqueue), /proc with the usual masked and
  read-only paths, a sysfs of its own read-only, /tmp on tmpfs; /etc/hosts, /etc/hostname and
  /etc/resolv.conf of its own; for an image that names no base, the host's runtime
  directories read-only (as Nomad's exec driver's chroot_env lends them) and a minimal
  /etc/passwd and /etc/group;
- tini (Debian's static build, bound at /dev/init) as pid 1, so the machine's command is not
  pid 1: it gets the default signal dispositions (a SIGTERM it does not handle ends it, as on
  a host) and its orphans are reaped;
- no new privileges, a small capability set, and `flyd.drivers.seccomp`'s filter;
- a createRuntime hook that holds the container, set up but not started, until flyd releases
  it (see `hold_hook`).

Limits are not in `linux.resources`: crun runs with its cgroup manager off, and the hold
hook puts the container in the machine's cgroup v1 directories, which flyd owns
(`flyd.drivers.cgroups`). crun would delete a cgroup it made the moment the container ends,
and cgroup v1 counts OOM kills only in the cgroup that hit its limit, so flyd could no longer
tell an OOM kill from any other SIGKILL.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flyd.drivers.seccomp import profile
from model.errors import InvalidArgument

__all__ = [
    "ETC_FILES",
    "HOST_RUNTIME",
    "Bundle",
    "config",
    "hold_hook",
    "resolve_user",
    "skeleton",
    "write_etc",
]

# What an image that names no base borrows from the host, read-only (those that exist).
HOST_RUNTIME = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/etc/alternatives",
    "/etc/ssl",
    "/etc/ca-certificates",
    "/etc/ld.so.cache",
    "/etc/localtime",
    "/etc/mime.types",
)

CAPABILITIES = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_NET_BIND_SERVICE",
    "CAP_SETGID",
    "CAP_SETPCAP",
    "CAP_SETUID",
]

_MASKED = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/sys/devices/virtual/powercap",
    "/sys/firmware",
]
_READONLY = ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
_HOSTNAME_MAX = 63


@dataclass(frozen=True)
class Bundle:
    """Where one machine's bundle lives and what it joins.

    `view` is where the wrapper binds the run dir in its private mount namespace: crun reaches
    the rootfs and the /etc files partly as the machine's root, which cannot search flyd's
    data dir (it may sit under a 0700 directory), but can reach that mount point.
    """

    run_dir: Path
    view: Path
    netns: str  # paths crun opens to join netd's namespaces
    userns: str
    init: Path  # a static init binary (tini-static)
    hold_fd: int  # the wrapper's descriptors the hold hook uses (see hold_hook)
    ready_fd: int
    held_marker: Path
    cgroup_procs: tuple[Path, ...] = ()  # the machine's cgroups, which the hook puts it in
    cgroupns: str | None = None  # a cgroup namespace rooted at them, for crun to join

    @property
    def rootfs(self) -> Path:
        """The overlay's mount point, as crun sees it."""
        return self.view / "rootfs"

    @property
    def etc(self) -> Path:
        """Files the machine gets at /etc (hosts, hostname, ...), written per run."""
        return self.run_dir / "etc"


def hold_hook(bundle: Bundle) -> dict[str, Any]:
    """The createRuntime hook that puts the container in the machine's cgroups and holds it
    there until flyd releases it.

    crun runs it once the namespaces and mounts are made, before the machine's command can
    run, with the container's state (its init's pid) on stdin. It reaches two pipes through
    its grandparent, the wrapper (crun is its parent): it says `ready` on one, moves the
    container's init into the machine's cgroups (crun itself and the wrapper stay out: their
    set-up is not the machine's to pay for, nor throttled by its CPU quota), and waits for a
    line on the other. flyd writes `go` (release), or its end closes (discard, or flyd died):
    the hook leaves a marker and fails, so crun tears the container down and the wrapper
    records `held`: it ran nothing. Anonymous pipes, not FIFOs: opening one through /proc
    never blocks, whoever has died, and a `go` written before the hook reads it waits in the
    pipe, which the wrapper keeps open.

    `ready` comes before the cgroup moves, which still come before `go` is read: the first
    move after a quiet spell waits for an RCU grace period (cgroup v1 takes a global lock
    for writing, 5-9 ms here), which then overlaps flyd's fsynced commit instead of adding
    to it. A move that fails leaves the marker too: the machine never ran anything.
    """
    q = shlex.quote
    join = "".join(f"echo $pid > {q(str(p))} && " for p in bundle.cgroup_procs)
    script = (
        "trap '' PIPE; { IFS= read -r state || [ -n \"$state\" ]; } && "
        r'pid=${state#*\"pid\":} && pid=${pid%%[!0-9]*} && [ -n "$pid" ] && '
        "{ read -r _ _ _ wrapper _ < /proc/$PPID/stat && "
        f"echo ready > /proc/$wrapper/fd/{bundle.ready_fd}; said=$?; }} && "
        f"{join}"
        '[ "$said" = 0 ] && '
        f'IFS= read -r go < /proc/$wrapper/fd/{bundle.hold_fd} && [ "$go" = go ] || '
        f"{{ : > {q(str(bundle.held_marker))}; exit 1; }}"
    )
    return {"path": "/bin/sh", "args": ["sh", "-c", script]}


def resolve_user(rootfs: Path, user: str) -> tuple[int, int]:
    """uid and gid in the machine for the image config's `user` ("", name, uid, "u:g").

    Names are looked up in the image's own /etc/passwd and /etc/group. Raises
    InvalidArgument("user") for a name the image does not know.
    """
    if not user:
        return 0, 0
    name, _, group = user.partition(":")
    passwd = _entries(rootfs / "etc" / "passwd")
    if name.isdigit():
        uid = int(name)
        gid = next((int(e[3]) for e in passwd if e[2] == name and e[3].isdigit()), uid)
    else:
        entry = next((e for e in passwd if e[0] == name), None)
        if entry is None or not entry[2].isdigit() or not entry[3].isdigit():
            raise InvalidArgument("user", f"the image has no user {name!r}")
        uid, gid = int(entry[2]), int(entry[3])
    if group:
        if group.isdigit():
            gid = int(group)
        else:
            found = next((e for e in _entries(rootfs / "etc" / "group") if e[0] == group), None)
            if found is None or not found[2].isdigit():
                raise InvalidArgument("user", f"the image has no group {group!r}")
            gid = int(found[2])
    return uid, gid


def _entries(path: Path) -> list[list[str]]:
    try:
        # Not followed out of the rootfs: these paths are only read as plain files here.
        text = path.read_text(errors="replace") if not path.is_symlink() else ""
    except OSError:
        return []
    return [line.split(":") for line in text.splitlines() if line.count(":") >= 3]


ETC_FILES = ("hostname", "hosts", "resolv.conf", "passwd", "group")  # what write_etc may write


def skeleton() -> list[tuple[str, bool]]:
    """What crun makes in the rootfs of a machine whose image names no base (host_runtime),
    on its first start, for its mount points: (path relative to the rootfs, is a directory),
    parents first. Those land in the machine's upper layer; a driver can have them made ahead.
    /dev's own mount points are not here (they are made in /dev's tmpfs).
    """
    points: list[tuple[str, bool]] = [("proc", True), ("dev", True), ("sys", True), ("tmp", True)]
    points.append(("etc", True))
    for path in HOST_RUNTIME:
        if Path(path).exists():
            points.append((path.lstrip("/"), Path(path).is_dir()))
    points += [(f"etc/{name}", False) for name in ETC_FILES]
    return points


def write_etc(etc: Path, machine_id: str, address: str, *, host_runtime: bool) -> list[str]:
    """Write the machine's own /etc files into `etc` (a bundle's `etc`); returns their names."""
    etc.mkdir(0o755, exist_ok=True)
    hostname = machine_id[:_HOSTNAME_MAX]
    files = {
        "hostname": f"{hostname}\n",
        "hosts": f"127.0.0.1\tlocalhost\n{address}\t{hostname}\n",
        # No name servers: a machine reaches nothing beyond its namespace.
        "resolv.conf": "",
    }
    if host_runtime:
        files["passwd"] = (
            "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/false\n"
        )
        files["group"] = "root:x:0:\nnogroup:x:65534:\n"
    for name, text in files.items():
        (etc / name).write_text(text)
    return sorted(files)


def config(
    bundle: Bundle,
    *,
    machine_id: str,
    argv: list[str],
    env: dict[str, str],
    workdir: str,
    uid: int,
    gid: int,
    etc_files: list[str],
    host_runtime: bool,
) -> dict[str, Any]:
    """The runtime spec of one run of the machine (see the module docstring)."""
    ro = ["rbind", "ro", "nosuid", "nodev"]
    mounts: list[dict[str, Any]] = [
        {
            "destination": "/proc",
            "type": "proc",
            "source": "proc",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/dev",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
        },
        {
            "destination": "/dev/pts",
            "type": "devpts",
            "source": "devpts",
            "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
        },
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"],
        },
        {
            "destination": "/dev/mqueue",
            "type": "mqueue",
            "source": "mqueue",
            "options": ["nosuid", "noexec", "nodev"],
        },
        {
            "destination": "/sys",
            "type": "sysfs",
            "source": "sysfs",
            "options": ["nosuid", "noexec", "nodev", "ro"],
        },
        {
            "destination": "/tmp",
            "type": "tmpfs",
            "source": "tmpfs",
            "options": ["nosuid", "nodev", "mode=1777"],
        },
        {
            "destination": "/dev/init",
            "type": "bind",
            "source": str(bundle.init),
            "options": ["bind", "ro", "nosuid", "nodev"],
        },
    ]
    if host_runtime:
        for path in HOST_RUNTIME:
            if Path(path).exists():
                mounts.append({"destination": path, "type": "bind", "source": path, "options": ro})
    for name in etc_files:
        mounts.append(
            {
                "destination": f"/etc/{name}",
                "type": "bind",
                "source": str(bundle.view / "etc" / name),
                "options": ["bind", "ro", "nosuid", "nodev"],
            }
        )
    return {
        "ociVersion": "1.0.2",
        "process": {
            "terminal": False,
            "user": {"uid": uid, "gid": gid},
            # tini as pid 1: the command gets default signal dispositions, orphans are reaped.
            "args": ["/dev/init", "--", *argv],
            "env": [f"{k}={v}" for k, v in env.items()],
            "cwd": workdir,
            "capabilities": {
                "bounding": CAPABILITIES,
                "effective": CAPABILITIES,
                "permitted": CAPABILITIES,
            },
            "noNewPrivileges": True,
        },
        "root": {"path": str(bundle.rootfs), "readonly": False},
        "hostname": machine_id[:_HOSTNAME_MAX],
        "mounts": mounts,
        "hooks": {"createRuntime": [hold_hook(bundle)]},
        "linux": {
            "namespaces": [
                {"type": "pid"},
                {"type": "ipc"},
                {"type": "uts"},
                {"type": "mount"},
                {
                    "type": "cgroup",
                    **({} if bundle.cgroupns is None else {"path": bundle.cgroupns}),
                },
                {"type": "network", "path": bundle.netns},
                {"type": "user", "path": bundle.userns},
            ],
            "maskedPaths": _MASKED,
            "readonlyPaths": _READONLY,
            "seccomp": profile(),
        },
    }
