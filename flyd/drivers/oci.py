"""The OCI driver: every machine is a container run by crun, a sandbox of its own.

What a machine is (see `flyd.drivers.bundle` for its runtime spec):

- its rootfs is an overlay: the cached image is the lower layer, shared by every machine of
  the image and never written (ID-mapped, so the machine's root owns it while on disk it stays
  host root's), and the machine's writable layer takes every write: a filesystem of its own,
  in a disk file of `guest.disk_mib` in its run dir (`flyd.drivers.writable`), so what it can
  write is bounded; the layer stays across restarts and goes on destroy;
- its namespaces are pid, mount, ipc, uts, cgroup, user (container root is a range of 65536
  host uids of its own: `uid_base + slot * 65536`, never host root) and network (netd's:
  `flyd.drivers.netd`, with the machine's own address `prefix + 2 + slot`);
- its published services are host ports on `machine_host` (127.0.0.1 by default, exactly
  that address, never every address) that netd holds and forwards into the
  machine's namespace, where the service listens on its internal port (`PORT`);
- it reaches nothing beyond its namespace, unless its config asks for egress
  (`network.egress`) and the worker has an uplink (`egress_via`, a network namespace the
  operator made): then netd lets it out through the uplink, masqueraded (see netd);
- its limits are the machine's cgroups (`flyd.drivers.cgroups`), which the hold hook puts
  the container in (crun and the wrapper stay outside them).

A run, as the shared machinery (`flyd.drivers.wrapped`) drives it:

1. `start` asks netd for the namespaces while a thread prepares the run dir and cgroups (a
   spare set on a first start, made ahead with the files and mount points a first start
   writes), then writes the bundle and makes a detached ID-mapped copy of the image's rootfs;
   then it spawns the wrapper under `unshare --mount` (a private mount namespace), handing it
   the machine's writable layer, mounted detached in that thread: the wrapper hides
   /sys/fs/cgroup/unified on a hybrid-cgroup host (crun refuses those) and mounts the overlay,
   in one `mount --all` (see `_mounts`), and runs `crun run` in the foreground.
   crun makes the container and stops in the createRuntime hook, which puts it in the
   machine's cgroups and says "ready"; only then does
   `start` return the handle: a container that cannot be made is a failed start, not a crash.
2. `release` tells the hook to go on: crun starts tini, which runs the machine's command.
   `discard` (or flyd dying) closes the hold instead: crun tears the container down and the
   wrapper records `held`: it never ran.
3. Signals go to the container's init (tini), found from crun's own record of its pid and
   start time, and tini passes them to the command; a stop that times out SIGKILLs the init,
   which ends every process of the pid namespace.
4. When the container ends, crun returns its status (a code, or 128+signo), the wrapper
   records it and exits; the private mount namespace, and the overlay mount in it, die with
   the wrapper, and its writable layer's filesystem (and loop device) with the last of them:
   nothing is ever mounted in the host's mount namespace. flyd tells netd the machine is down.
5. `cleanup` (destroy) has netd forget the machine's ports, and removes the run dir with its
   writable layer's disk file, the cgroups and what crun may have left.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import ipaddress
import json
import os
import signal
import stat
import subprocess
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog

from flyd.drivers import bundle as oci_bundle
from flyd.drivers.base import Driver, ExitStatus, Handle, PortMapping, ProcessSpec, port_env
from flyd.drivers.cgroups import namespace_at, v1_missing
from flyd.drivers.cgroups import probe as cgroups_probe
from flyd.drivers.crun import (
    CRUN_ROOT,
    Tools,
    container_pidfd,
    delete_container,
    find_tools,
    hybrid_cgroups,
    init_pidfd,
)
from flyd.drivers.crun import probe as crun_probe
from flyd.drivers.forward import CONNECTIONS_PER_MACHINE
from flyd.drivers.logs import LOG_NAME, Copier
from flyd.drivers.namespaces import idmapped_tree
from flyd.drivers.netclient import Netd, NetdMachines
from flyd.drivers.ports import bind_port, local_address
from flyd.drivers.procfs import read_proc_stat, signal_and_close
from flyd.drivers.wrapped import Watched, WrappedDriver
from flyd.drivers.wrapper import oci_wrapper_script
from flyd.drivers.writable import WritableLayers, overlay_options
from flyd.storage import diskfile
from model.errors import InvalidArgument, ResourceExhausted, Unavailable

__all__ = ["UIDS_PER_MACHINE", "OciDriver", "probe"]

log = structlog.get_logger(__name__)

UIDS_PER_MACHINE = 65536
_READY_TIMEOUT_S = 30.0
_CRUN_SAID_BYTES = 16 << 10  # of the log, read for the reason a container could not be made
_EXEC_WAIT_S = 1.0  # how long a signal waits for a just-started container's init
_SLOT_FILE = "slot"
_EGRESS_FILE = "egress"  # present while the machine's last start asked for egress
_FSTAB_FILE = "fstab"  # what the wrapper mounts (see OciDriver._mounts)
_ROOTFS = "rootfs"  # in the run dir: the overlay's mount point
_HIDE_OPTIONS = "ro,nosuid,nodev,noexec,mode=0,size=4k"
# Where each wrapper binds its machine's run dir, in its own mount namespace (see Bundle.view).
_VIEW = Path("/run/nonomad/machine")
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# crun runs from the read-only bind the wrapper makes of it (see OciDriver._mounts): it need
# not copy itself first. crun trusts this only when its binary's mount is read-only too.
_CRUN_ENV = {"_LIBCONTAINER_CLONED_BINARY": "1"}


class OciDriver(WrappedDriver):
    """Runs machines as crun containers; see the module docstring for the design."""

    name = "oci"
    cgroup_namespaces = True
    disk_limited = True

    def __init__(
        self,
        run_root: Path,
        *,
        on_exit: Callable[[str, Handle, ExitStatus], None],
        cgroup_root: Path = Path("/sys/fs/cgroup"),
        cgroup_prefix: str = "nonomad",
        max_log_bytes: int = 1 << 20,
        log_backups: int = 2,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        machine_host: str = "127.0.0.1",
        network: str = "10.87.0.0/20",
        uid_base: int = 1 << 30,
        egress_via: Path | None = None,
        route_machines: bool = False,
        connections_per_machine: int = CONNECTIONS_PER_MACHINE,
    ) -> None:
        """`egress_via`: the worker's uplink, a network namespace of the operator's that
        reaches what machines may reach; without it no machine has egress. `route_machines`:
        netd routes each machine's own address to the host (and, through it, to the hosts
        that route the worker's prefix here), for its published services only.
        `connections_per_machine`: how many connections netd forwards into one machine at
        once (more are reset: one machine's flood leaves netd's descriptors to the others)."""
        problem = probe(cgroup_root) or cgroups_probe(cgroup_root, cgroup_prefix)
        if problem is not None:
            raise Unavailable(f"this host cannot run OCI machines: {problem}")
        tools = find_tools()
        assert isinstance(tools, Tools)
        try:
            prefix = ipaddress.IPv4Network(network)
        except ValueError as e:
            raise InvalidArgument("network", str(e)) from None
        if not prefix.is_private or prefix.num_addresses < 4:
            raise InvalidArgument("network", f"{network} is not a private prefix of 4 or more")
        if connections_per_machine < 1:
            raise InvalidArgument("connections_per_machine", "must be at least 1")
        if uid_base < UIDS_PER_MACHINE or uid_base % UIDS_PER_MACHINE:
            raise InvalidArgument("uid_base", f"must be a positive multiple of {UIDS_PER_MACHINE}")
        if any(c in str(run_root.absolute()) for c in ",:\n\t "):
            # The overlay's mount options cannot quote them.
            raise InvalidArgument("run_root", "must not contain ',', ':' or whitespace")
        super().__init__(
            run_root,
            on_exit=on_exit,
            cgroup_root=cgroup_root,
            cgroup_prefix=cgroup_prefix,
            user=None,
            max_log_bytes=max_log_bytes,
            log_backups=log_backups,
            sleep=sleep,
            machine_host=machine_host,
        )
        self._tools = tools
        self._prefix = prefix
        self._uid_base = uid_base
        self.max_machines = min(prefix.num_addresses - 3, (2**32 - uid_base) // UIDS_PER_MACHINE)
        """How many machines it can give an address and a uid range of their own."""
        self._hybrid = hybrid_cgroups()
        self._layers = WritableLayers(self._run_dirs.root, oci_bundle.skeleton())
        self._crun_root = self._run_dirs.root / CRUN_ROOT
        self._crun_root.mkdir(mode=0o700, exist_ok=True)
        # crun reaches a machine's rootfs and /etc files partly as the machine's root: through
        # the run root when anyone may search its way there, else through a bind of the run
        # dir that each wrapper makes at _VIEW (one more mount on every start).
        self._bind_view = not _searchable(self._run_dirs.root)
        if self._bind_view:
            try:
                _VIEW.mkdir(mode=0o755, parents=True, exist_ok=True)
            except OSError as e:
                raise Unavailable(f"cannot make {_VIEW}: {e}") from e
        self._slots = self._read_slots()
        self._runs: dict[str, int] = {}  # starts per machine, so a late down never undoes one
        self._downs: dict[str, asyncio.Future[None]] = {}  # netd downs under way
        self._preparing: dict[str, asyncio.Future[_Disk]] = {}  # starts' disk threads
        self.egress_refusal = (
            None if egress_via is not None else "this worker has no uplink (flyd --egress-via)"
        )
        uplink: dict[str, Any] = {"netns": None}
        if egress_via is not None:
            uplink = {
                "netns": str(egress_via),
                "address": str(prefix.network_address + 1),  # never a machine's: they are +2..
                "prefix": str(prefix),
            }
        self._route_machines = route_machines
        routes: dict[str, Any] = {"prefix": None}
        if route_machines:  # the hub's address: the machines' gateway, the host's next hop
            routes = {"prefix": str(prefix), "address": str(prefix.network_address + 1)}
        # What netd holds, as it said: machine -> its host ports and whether it is up.
        limits = {"connections_per_machine": connections_per_machine}
        net = Netd(self._run_dirs.root, uplink, routes, limits)
        self._nets = NetdMachines(net, self._republish)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, spec: ProcessSpec) -> Handle:
        """Make the machine's container, held before it runs anything; `release` lets it run.

        Returns once crun has made the container (namespaces, mounts) and holds it. Returns the
        handle of the run already watched for the machine, if any. Raises `InvalidArgument`
        for a bad spec and `Unavailable` when the container cannot be made.

        A start that fails or is cancelled at any await (its caller's deadline passed) leaves
        netd, the slots and its descriptors as they were: until the wrapper is spawned, what
        it took is given back without an await (`_abandon`); after, the held container is
        discarded and its end brings netd down.
        """
        running = self._begin_start(spec)
        if running is not None:
            return running
        mid = spec.machine_id
        if spec.egress and self.egress_refusal is not None:
            # Created when the worker had an uplink; it has none now.
            raise Unavailable(f"machine {mid}: config.network.egress: {self.egress_refusal}")
        uid, gid = oci_bundle.resolve_user(spec.rootfs, spec.user)
        previous = self._preparing.get(mid)
        if previous is not None:  # an abandoned start's thread, still writing the run dir
            await asyncio.wait([previous])
            return await self.start(spec)
        slot, new_slot = self._claim_slot(mid)
        address = str(self._prefix.network_address + 2 + slot)
        root_uid = self._uid_base + slot * UIDS_PER_MACHINE
        # The hold hook's pipes (see bundle.hold_hook): flyd keeps the write end of `hold`
        # (its only writer: its death, or discard, is EOF for the hook) and reads `ready`.
        hold_r, hold_w = os.pipe2(os.O_CLOEXEC)
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(ready_r, False)
        pipes = [hold_r, hold_w, ready_r, ready_w]
        # What the run needs on disk is made in a thread while netd makes the namespaces: both
        # mostly wait on the kernel (a first start's cgroup renames wait for any cgroup move
        # under way on the host, up to an RCU grace period).
        spare = self._spares.claim()
        ahead = self._spares.namespace(spare) if spare is not None else None
        disk: asyncio.Future[_Disk] = asyncio.get_running_loop().run_in_executor(
            None,
            self._prepare_disk,
            spec,
            spare,
            ahead,
            slot if new_slot else None,
            root_uid,
            address,
        )
        if ahead is not None:
            disk.add_done_callback(functools.partial(_close_unused, ahead[0]))
        self._preparing[mid] = disk
        disk.add_done_callback(functools.partial(self._prepared, mid))
        self._runs[mid] = self._runs.get(mid, 0) + 1  # a down for an earlier run is moot now
        try:
            namespaces = await self._publish_ports(
                mid,
                spec.ports,
                address=address,
                uid=root_uid,
                uids=UIDS_PER_MACHINE,
                egress=spec.egress,
                next=self._next_user_range(),
            )
            prepared = await asyncio.shield(disk)
            popen, lower = self._spawn(spec, uid, gid, namespaces, prepared, hold_r, ready_w)
        except BaseException as e:
            self._abandon(mid, pipes, disk, new_slot)
            if isinstance(e, OSError):
                raise Unavailable(f"cannot prepare machine {mid}: {e}") from e
            raise
        _close(*prepared.fds, lower, hold_r, ready_w)  # the wrapper has its copies
        proc = read_proc_stat(popen.pid)
        assert proc is not None, "an unreaped child always has a /proc entry"
        handle = Handle(pid=popen.pid, start_time=proc.start_time, boot_id=self._boot_id)
        self._run_dirs.write_handle(mid, handle)
        loop = asyncio.get_running_loop()
        w = self._watch(loop, mid, handle, os.pidfd_open(popen.pid), popen, prepared.copier)
        w.go_fd = hold_w
        w.starting = True
        try:
            await self._until_ready(w, ready_r)
        except BaseException:
            # Failed, or its caller gone (cancelled): the held container ends without running,
            # and its exit is not reported (`starting` stays set): flyd never saw this handle.
            self.discard(mid)
            raise
        else:
            w.starting = False
            # crun has read it (its own copy is in its state, root's alone, while the container
            # lives): the machine's environment, secrets and all, does not stay on disk.
            with contextlib.suppress(FileNotFoundError):
                (self._run_dirs.path(mid) / "config.json").unlink()
        finally:
            os.close(ready_r)
        log.debug("machine_container_made", machine_id=mid, pid=popen.pid)
        return handle

    def _spawn(
        self,
        spec: ProcessSpec,
        uid: int,
        gid: int,
        namespaces: dict[str, Any],
        prepared: _Disk,
        hold_r: int,
        ready_w: int,
    ) -> tuple[subprocess.Popen[bytes], int]:
        """Write the bundle, map the image into the machine's user namespace and spawn the
        wrapper; the wrapper and the ID-mapped image's descriptor (the caller's to close once
        the wrapper has its copy). Raises OSError, and nothing is left running."""
        mid = spec.machine_id
        run_dir = self._run_dirs.path(mid)
        b = oci_bundle.Bundle(
            run_dir=run_dir,
            view=_VIEW if self._bind_view else run_dir,
            netns=str(namespaces["netns"]),
            userns=str(namespaces["userns"]),
            init=Path(self._tools.init),
            hold_fd=hold_r,
            ready_fd=ready_w,
            held_marker=run_dir / "status" / "held",
            cgroup_procs=tuple(prepared.cgroup_procs),
            cgroupns=None if prepared.cgroupns is None else f"/proc/self/fd/{prepared.cgroupns}",
        )
        spec_json = oci_bundle.config(
            b,
            machine_id=mid,
            argv=spec.argv,
            env={**spec.env, **port_env(spec.ports, inside=True)},
            workdir=spec.workdir,
            uid=uid,
            gid=gid,
            etc_files=prepared.etc_files,
            host_runtime=spec.host_runtime,
        )
        # Root's alone: the machine's environment (its secrets) is in it.
        fd = os.open(run_dir / "config.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(spec_json))
        userns = os.open(b.userns, os.O_RDONLY | os.O_CLOEXEC)
        try:
            lower = idmapped_tree(str(spec.rootfs), userns)
        except OSError as e:
            raise OSError(e.errno, f"the image cannot be mapped into it: {e.strerror}") from e
        finally:
            os.close(userns)
        try:
            mounts = self._mounts(run_dir, prepared.disk_fd, lower)
            script = oci_wrapper_script(
                self._run_dirs.status_dir(mid),
                self._tools.mv,
                mounts=mounts,
                crun=self._crun("run", "--bundle", str(run_dir), mid),
                held_marker=b.held_marker,
            )
            # Blocking, but only for the fork/exec: we never wait on the child here. crun
            # joins the cgroup namespace through its copy of the descriptor (`/proc/self`).
            popen = subprocess.Popen(
                [
                    self._tools.unshare,
                    "--mount",
                    "--propagation",
                    "private",
                    self._tools.sh,
                    "-c",
                    script,
                    "nonomad-wrapper",
                ],
                stdin=subprocess.DEVNULL,
                pass_fds=(lower, hold_r, ready_w, *prepared.fds[1:]),  # the disk, the namespace
                stdout=prepared.log_fd,
                stderr=prepared.log_fd,
                env={"PATH": _PATH, **_CRUN_ENV},
                start_new_session=True,
            )
        except BaseException:
            os.close(lower)
            raise
        return popen, lower

    def _abandon(
        self, machine_id: str, pipes: list[int], disk: asyncio.Future[_Disk], new_slot: bool
    ) -> None:
        """Give back what a start took before its wrapper was spawned, without an await (the
        start may be cancelled): the pipes, the disk thread's descriptors once it is done, a
        new slot (no process ever ran with its uids), and netd's namespaces for the run, by a
        `down` queued behind the `up` (netd answers in order, whoever waits)."""
        _close(*pipes)
        disk.add_done_callback(_close_disk)
        if new_slot:
            self._slots.pop(machine_id, None)
            disk.add_done_callback(
                lambda _: (self._run_dirs.path(machine_id) / _SLOT_FILE).unlink(missing_ok=True)
            )
        self._nets.down_now(machine_id)

    def _prepared(self, machine_id: str, disk: asyncio.Future[_Disk]) -> None:
        if self._preparing.get(machine_id) is disk:
            del self._preparing[machine_id]

    async def _until_ready(self, w: Watched, ready_fd: int) -> None:
        """Wait for the hold hook's "ready"; raise Unavailable if the wrapper ends first."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            with contextlib.suppress(BlockingIOError):
                if os.read(ready_fd, 64) and not ready.done():
                    ready.set_result(None)

        loop.add_reader(ready_fd, readable)
        try:
            waits: set[asyncio.Future[Any]] = {ready, w.exited}
            done, _ = await asyncio.wait(
                waits, timeout=_READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            loop.remove_reader(ready_fd)
        if ready in done and not w.exited.done():
            return
        if not done:
            w.killed_by_us = True
            self._kill_all(w)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(w.exited), 5.0)
        await self._down(w.machine_id)
        # What crun said: its exit was reported once its copier wrote it all.
        said = await asyncio.to_thread(self.read_logs, w.machine_id, 5, _CRUN_SAID_BYTES)
        tail = "; ".join(said.lines)
        if w.exited.done() and not w.exited.cancelled() and w.exited.exception() is None:
            raise Unavailable(
                f"machine {w.machine_id}: the container could not be made "
                f"({w.exited.result().describe()}): {tail}"
            )
        raise Unavailable(f"machine {w.machine_id}: no container after {_READY_TIMEOUT_S}s: {tail}")

    async def _deliver(self, w: Watched, sig: int, *, stopping: bool) -> None:
        """To the container's init (tini), which passes it on to the machine's command.

        Right after a start, waits (briefly) until tini is there and ready: the kernel drops
        a signal sent to a pid namespace's init that neither handles nor blocks it, so one
        sent before tini blocked the signals it passes on would be lost.
        """
        ended = lambda: w.done  # noqa: E731
        pidfd = await init_pidfd(
            self._crun_root, w.machine_id, sig, wait=_EXEC_WAIT_S, ended=ended, sleep=self._sleep
        )
        if pidfd is None:
            # No container (yet, or any more): a stop ends what the wrapper runs instead.
            if stopping:
                self._killpg(w, signal.SIGKILL)
            return
        signal_and_close(pidfd, sig)

    def _kill_all(self, w: Watched) -> None:
        """SIGKILL the container's init: every process of its pid namespace dies with it."""
        pidfd = container_pidfd(self._crun_root, w.machine_id)
        if pidfd is None:
            self._kill_cgroup(w.machine_id)
            self._killpg(w, signal.SIGKILL)
            return
        signal_and_close(pidfd, signal.SIGKILL)

    def _ended(self, machine_id: str) -> None:
        super()._ended(machine_id)
        if self._nets.is_up(machine_id):
            task = asyncio.ensure_future(self._down(machine_id, run=self._runs.get(machine_id)))
            task.add_done_callback(_log_failure)
            self._downs[machine_id] = task

    async def stop(self, machine_id: str, sig: int, timeout: float) -> ExitStatus:
        """`WrappedDriver.stop`; it returns once netd has let go of the machine's namespace
        too, so its published ports refuse connections from then on.
        """
        status = await super().stop(machine_id, sig, timeout)
        down = self._downs.pop(machine_id, None)
        if down is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(down)
        return status

    async def _forget(self, machine_id: str) -> None:
        preparing = self._preparing.get(machine_id)
        if preparing is not None:  # an abandoned start's thread: the run dir is still its own
            await asyncio.wait([preparing])
        await self._nets.forget(machine_id)
        delete_container(self._crun_root, machine_id)
        self._slots.pop(machine_id, None)
        self._downs.pop(machine_id, None)
        self._runs.pop(machine_id, None)

    async def close(self) -> None:
        """Stop watching; the machines and netd keep running (see `WrappedDriver.close`)."""
        await super().close()
        self._layers.close()  # the spares are gone: their mounts go too
        self._nets.close()

    # -- ports and network -------------------------------------------------------------------

    def _bind_host(self, machine_host: str) -> str:
        """`machine_host` itself: netd listens on the published ports, so what flyd binds is
        what is exposed, and the operator said where (a port bound on 0.0.0.0 would also be
        reached on every other interface of the host, a public one included)."""
        address = local_address(machine_host)
        if address is None:
            raise InvalidArgument(
                "machine_host", f"{machine_host} is not an address of this host (nothing binds it)"
            )
        return address

    async def publish(self, machine_id: str, ports: Sequence[PortMapping]) -> None:
        """The machine's published services are exactly `ports`: netd holds their host ports
        (flyd hands over those it bound, binds any neither holds) and forwards them into the
        machine's namespace. Also brings netd in line with the machine after a restart of
        flyd or netd: a running machine's namespace is adopted.
        """
        self._check_open()
        await self._publish_ports(machine_id, ports)
        if machine_id in self._watched and not self._nets.is_up(machine_id):
            await self._adopt(machine_id)

    async def reconcile(self, machines: Mapping[str, Sequence[PortMapping]]) -> None:
        """After flyd's recovery (see `WrappedDriver.reconcile`); netd also forgets the
        machines flyd has no row for (a create that died before its first commit).
        """
        for machine_id in [m for m in self._nets.machines if m not in machines]:
            with contextlib.suppress(Unavailable):
                await self._nets.forget(machine_id)
            self._nets.machines.pop(machine_id, None)
        await super().reconcile(machines)

    async def _publish_ports(
        self, machine_id: str, ports: Sequence[PortMapping], **up: Any
    ) -> dict[str, Any]:
        """Publish the machine's ports to netd; with `up` (its fields), in the same request
        as bringing its namespaces up (one round trip on a start). netd's answer.

        What flyd knows of netd's side follows netd's answer, whether or not the caller still
        waits for it; from the request on, netd may know the machine, so a cleanup has it
        forget the machine.
        """
        self._published[machine_id] = tuple(ports)
        held = self._nets.ports(machine_id)
        socks = []
        try:
            for p in ports:
                if p.host_port in held:
                    continue
                sock = self._ports.hand_over(machine_id, p.host_port) or bind_port(
                    self._port_host, p.host_port
                )
                if sock is None:
                    log.error("machine_port_taken", machine_id=machine_id, port=p.host_port)
                    continue
                socks.append((p, sock))
            kept = [p for p in ports if p.host_port in held]
            self._ports.release(machine_id)  # any other port it had is no longer published
            return await self._nets.publish(
                machine_id,
                [[p.host_port, p.internal_port] for p in kept]
                + [[p.host_port, p.internal_port] for p, _ in socks],
                [s.fileno() for _, s in socks],
                **up,
            )
        finally:
            for _, sock in socks:
                sock.close()  # netd has its own copy (the request made one at once)

    async def _adopt(self, machine_id: str) -> None:
        """Give a running machine (netd restarted under it) its address back."""
        pidfd = container_pidfd(self._crun_root, machine_id)
        if pidfd is None:
            return
        try:  # the pidfd pins the pid while netd opens its namespace
            status = json.loads((self._crun_root / machine_id / "status").read_bytes())
            await self._nets.call(
                "up",
                then=lambda _: self._nets.mark_up(machine_id),
                machine=machine_id,
                address=str(self._prefix.network_address + 2 + self._slot(machine_id)),
                uid=0,
                uids=0,
                netns=f"/proc/{int(status['pid'])}/ns/net",
                egress=(self._run_dirs.path(machine_id) / _EGRESS_FILE).exists()
                and self.egress_refusal is None,
            )
        finally:
            os.close(pidfd)

    async def _down(self, machine_id: str, run: int | None = None) -> None:
        """Have netd drop the machine's namespaces (it stopped). With `run`: only if no start
        came since that run ended, which would have made new ones. The check and the request
        joining netd's queue happen with no await between them, so they cannot be reordered.
        """
        if run is not None and self._runs.get(machine_id) != run:
            return
        await self._nets.down(machine_id)

    async def _republish(self) -> None:
        """Give a new netd (the last one died) what the machines had."""
        for mid, ports in list(self._published.items()):
            with contextlib.suppress(Unavailable):
                await self.publish(mid, ports)  # and adopts the running machines

    # -- internals ---------------------------------------------------------------------------

    def _crun(self, *args: str) -> list[str]:
        return [
            self._tools.crun,
            "--root",
            str(self._crun_root),
            "--cgroup-manager=disabled",
            *args,
        ]

    def _mounts(self, run_dir: Path, disk: int, lower: int) -> list[list[str]]:
        """What the wrapper mounts in its private mount namespace before crun runs: one
        `mount -a` over a table in the run dir (root's alone), a program rather than one
        per mount (each costs ~1.5 ms of exec and libmount set-up on a start).

        On a hybrid-cgroup host an empty read-only tmpfs hides /sys/fs/cgroup/unified (crun
        sees a tmpfs there, not cgroup2, and takes the host for a v1 one): like detaching
        it, but it fits in the table. Only the wrapper's namespace sees it; the container
        mounts no cgroup filesystem of its own.
        """
        table = []
        if self._hybrid:
            table.append(("none", "/sys/fs/cgroup/unified", "tmpfs", _HIDE_OPTIONS))
        # crun copies itself before it runs a container (a container that could rewrite the
        # binary through /proc would own the host: CVE-2019-5736), by a read-only bind under
        # /tmp and a second exec, unless the binary it runs is already read-only and its
        # environment says so (`_CRUN_ENV`): a bind made here, where only this run sees it.
        table.append((self._tools.crun, self._tools.crun, "none", "bind,ro"))
        view = run_dir
        if self._bind_view:
            table.append((str(run_dir), str(_VIEW), "none", "bind"))
            view = _VIEW
        options = f"lowerdir=/proc/self/fd/{lower},{overlay_options(disk)}"
        table.append(("overlay", str(view / _ROOTFS), "overlay", options))
        fstab = run_dir / _FSTAB_FILE
        fd = os.open(fstab, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("".join(" ".join(map(_fstab_field, row)) + " 0 0\n" for row in table))
        return [[self._tools.mount, "--all", "--fstab", str(fstab)]]

    def _spare_layout(self, run_dir: Path) -> None:
        """The directories and (empty) files a first start writes, made in a spare run dir
        (writing a file that exists costs a fraction of making one on a busy disk), and a
        writable layer's disk file (`WritableLayers.make_spare`).
        """
        os.mkdir(run_dir / _ROOTFS, 0o755)
        os.mkdir(run_dir / "etc", 0o755)
        files = [(f"etc/{name}", 0o644) for name in oci_bundle.ETC_FILES]
        files += [(_SLOT_FILE, 0o644), (_FSTAB_FILE, 0o600), ("config.json", 0o600)]
        files += [(LOG_NAME, 0o640)]
        for name, mode in files:
            os.close(os.open(run_dir / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))
        self._layers.make_spare(run_dir)  # last: it holds a mount until the spare is taken

    def _read_slots(self) -> dict[str, int]:
        slots: dict[str, int] = {}
        for path in self._run_dirs.root.glob(f"*/{_SLOT_FILE}"):
            with contextlib.suppress(OSError, ValueError):
                slots[path.parent.name] = int(path.read_text())
        return slots

    def machine_address(self, machine_id: str) -> str:
        """The machine's own address when the worker routes machines (`route_machines`) and
        it has one (a slot, taken on its first start); "" otherwise."""
        slot = self._slots.get(machine_id)
        if not self._route_machines or slot is None:
            return ""
        return str(self._prefix.network_address + 2 + slot)

    def _slot(self, machine_id: str) -> int:
        """The machine's slot (its uid range and address), taken on its first start."""
        slot, new = self._claim_slot(machine_id)
        if new:
            try:
                _write_slot(self._run_dirs.path(machine_id), slot)
            except BaseException:
                del self._slots[machine_id]
                raise
        return slot

    def _free_slot(self) -> int | None:
        """The lowest slot no machine has; None if every one is taken."""
        used = set(self._slots.values())
        return next((i for i in range(self.max_machines) if i not in used), None)

    def _next_user_range(self) -> dict[str, int] | None:
        """The uid range of the slot the next new machine will take (netd makes its user
        namespace ahead); None if every slot is taken."""
        slot = self._free_slot()
        if slot is None:
            return None
        return {"uid": self._uid_base + slot * UIDS_PER_MACHINE, "uids": UIDS_PER_MACHINE}

    def _claim_slot(self, machine_id: str) -> tuple[int, bool]:
        """The machine's slot, and whether it is new: then the caller writes it to its run dir
        (`_write_slot`), or gives it back if it cannot.
        """
        slot = self._slots.get(machine_id)
        if slot is not None:
            return slot, False
        slot = self._free_slot()
        if slot is None:
            raise ResourceExhausted("addresses", f"all {self.max_machines} machine slots are taken")
        self._slots[machine_id] = slot
        return slot, True

    def _prepare_disk(
        self,
        spec: ProcessSpec,
        spare: str | None,
        ahead: tuple[int, list[int]] | None,
        new_slot: int | None,
        root_uid: int,
        address: str,
    ) -> _Disk:
        """In a thread: the run dir and cgroups (`spare`, if claimed, on a first start), the
        machine's new slot if it has one, its writable layer (mounted), its /etc files, its
        log's copier and its cgroup namespace (`ahead`: the one made with the spare, which it
        closes if unused). Raises OSError (the caller closes `ahead` then).
        """
        mid = spec.machine_id
        run_dir = self._run_dirs.path(mid)
        cgroup_procs = self._prepare_run(spec, spare)
        _mark(run_dir / _EGRESS_FILE, spec.egress)  # for an adoption by a new netd
        with contextlib.suppress(FileExistsError):
            os.mkdir(run_dir / _ROOTFS, 0o755)
        delete_container(self._crun_root, mid)  # what a killed crun left
        etc = oci_bundle.write_etc(run_dir / "etc", mid, address, host_runtime=spec.host_runtime)
        # Until its slot is written the machine is on its first start, whoever died meanwhile:
        # a disk file a spare brought of another size is still made anew.
        disk_fd = self._layers.mount(
            run_dir, spec, root_uid, first_start=new_slot is not None, spare=spare
        )
        try:
            if new_slot is not None:
                _write_slot(run_dir, new_slot)
            log_fd, copier = self._start_copier(mid)
        except BaseException:
            os.close(disk_fd)
            raise
        try:
            cgroupns = self._cgroup_namespace([p.parent for p in cgroup_procs], ahead)
        except BaseException:
            _close(log_fd, disk_fd)
            copier.close()
            raise
        return _Disk(cgroup_procs, etc, log_fd, copier, disk_fd, cgroupns)

    def _spare_cgroup_namespace(self, cgroups: list[Path]) -> int:
        return namespace_at(cgroups)

    @staticmethod
    def _cgroup_namespace(cgroups: list[Path], ahead: tuple[int, list[int]] | None) -> int | None:
        """A namespace where the machine's cgroups are `/` (see bundle's docstring): the one
        made `ahead` with its spare cgroups if those are its cgroups now (a rename keeps a
        cgroup's inode, and the namespace's root), else a new one (a first move of a quiet
        host's cgroups waits for an RCU grace period: made ahead, it is off a create's way).
        None without cgroups. On OSError `ahead` is still open."""
        if ahead is not None and cgroups and [os.stat(cg).st_ino for cg in cgroups] == ahead[1]:
            return ahead[0]
        made = namespace_at(cgroups) if cgroups else None
        if ahead is not None:
            os.close(ahead[0])
        return made


@dataclasses.dataclass(frozen=True)
class _Disk:
    """What `OciDriver._prepare_disk` made for a run."""

    cgroup_procs: list[Path]
    etc_files: list[str]
    log_fd: int  # the machine's end of its output pipe; the caller closes it, as the rest
    copier: Copier  # what writes the pipe's other end to the log
    disk_fd: int  # the writable layer's mount (WritableLayers.mount)
    cgroupns: int | None  # rooted at the machine's cgroups (None without cgroups)

    @property
    def fds(self) -> tuple[int, ...]:
        """Its descriptors: what the wrapper inherits (the log as its output, the rest passed
        on), and the caller closes."""
        ns = () if self.cgroupns is None else (self.cgroupns,)
        return (self.log_fd, self.disk_fd, *ns)


def _close_unused(namespace: int, done: asyncio.Future[_Disk]) -> None:
    """Close the cgroup namespace made ahead for a `_prepare_disk` that failed before it
    took it."""
    if not done.cancelled() and done.exception() is not None:
        os.close(namespace)


def _close_disk(done: asyncio.Future[_Disk]) -> None:
    """Close what a `_prepare_disk` opened for a start that failed meanwhile (its log, its
    writable layer's mount, its cgroup namespace), and let go of its copier."""
    if not done.cancelled() and done.exception() is None:
        _close(*done.result().fds)
        done.result().copier.close()


def _write_slot(run_dir: Path, slot: int) -> None:
    (run_dir / _SLOT_FILE).write_text(f"{slot}\n")


def probe(cgroup_root: Path = Path("/sys/fs/cgroup")) -> str | None:
    """None when this host can run OCI machines within their limits, else why not: crun's
    needs (`flyd.drivers.crun.probe`), cgroup v1 controllers, which is how the driver limits
    machines (a cgroup v2-only host would run them unlimited: it is refused), and disk files
    (loop devices, ext4: `flyd.storage.diskfile.problem`), which bound what they write.
    """
    disk = diskfile.problem()
    return crun_probe() or v1_missing(cgroup_root) or (disk and f"cannot limit disks: {disk}")


def _searchable(path: Path) -> bool:
    """Whether anyone may search their way to `path` (every directory on the way o+x)."""
    try:
        return all(os.stat(p).st_mode & stat.S_IXOTH for p in [path, *path.parents])
    except OSError:
        return False


def _fstab_field(value: str) -> str:
    """`value` as one fstab field: whitespace and backslashes as the octal escapes fstab reads."""
    return "".join(f"\\{ord(c):03o}" if c in " \t\n\\" else c for c in value)


def _mark(path: Path, present: bool) -> None:
    if present:
        path.touch()
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _close(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("netd_down_failed", error=str(task.exception()))


# OciDriver keeps the contract flyd is written against (checked by mypy).
_: type[Driver] = OciDriver
