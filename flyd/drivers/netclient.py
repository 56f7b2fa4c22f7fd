"""flyd's side of netd (`flyd.drivers.netd`): finding it, starting it, asking it things
(`Netd`), and the OCI driver's account of what it holds for each machine (`NetdMachines`).

netd outlives flyd, so a flyd first looks for the netd of its run root (`.netd.sock`); only
when none answers does it start one, detached (`setsid -f`, so init reaps it), and wait for it
to say it is listening. Its handle (pid, start time, boot id) goes to `.netd.json`, which is
how `flyd.drivers.rundir.kill_all` ends it when a whole worker is torn down.

On every connection flyd first tells netd the worker's uplink (`Netd.uplink`: the egress
namespace, or none), so a netd that outlived flyd follows a changed `--egress-via` and a new
netd starts with the uplink already made; and likewise whether it routes machines' addresses
to the host (`Netd.routes`, flyd --route-machines), and each machine's budget of forwarded
connections (`Netd.limits`).

Requests are one JSON datagram each, answered in order, one in flight at a time; each goes
and has its answer read whoever still waits for it (`Netd.submit`), so a caller cancelled
mid-request never leaves netd's answer to be read as the next request's. If netd has died the
next request raises `NetdGone`, and `connect` starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import structlog

from flyd.drivers.base import Handle
from flyd.drivers.netd import MAX_MESSAGE, PROTOCOL, unix_address
from flyd.drivers.procfs import open_pidfd, read_boot_id
from model.errors import CorruptLog, Unavailable

__all__ = ["NETD_HANDLE", "NETD_SOCKET", "Netd", "NetdGone", "NetdMachines", "kill_netd"]

log = structlog.get_logger(__name__)

NETD_SOCKET = ".netd.sock"
NETD_HANDLE = ".netd.json"
NETD_LOG = ".netd.log"
_START_TIMEOUT_S = 15.0
_REQUEST_TIMEOUT_S = 10.0


class NetdGone(Unavailable):
    """The connection to netd broke (it died, or was never there): a new one can be started."""


class Netd:
    """A connection to the netd of `run_root`; `uplink`: the fields of its `uplink` request
    (`{"netns": None}`, the default: no uplink, no machine has egress)."""

    def __init__(
        self,
        run_root: Path,
        uplink: dict[str, Any] | None = None,
        routes: dict[str, Any] | None = None,
        limits: dict[str, Any] | None = None,
    ) -> None:
        self.run_root = run_root
        self.limits = limits or {}
        """The fields of its `limits` request (each machine's budget of connections), sent
        to a netd that has limits (hello says); {}: netd's own defaults."""
        self.uplink = uplink or {"netns": None}
        self.routes = routes or {"prefix": None}
        """The fields of its `routes` request: the worker's prefix and the hub's address when
        it routes machines to its host (flyd --route-machines), `{"prefix": None}` when not."""
        self.socket_path = run_root / NETD_SOCKET
        self._sock: socket.socket | None = None
        self._last: asyncio.Future[Any] | None = None  # the request queued last
        self._requests = 0
        self.pid = 0
        self.spawned = False

    def connect(self) -> dict[str, Any]:
        """Connect to the run root's netd, starting one if none answers; returns its `hello`.

        Blocking (once per flyd start, or after netd died): a running netd answers at once,
        a new one takes ~0.1 s to start.
        """
        self.close()
        sock = self._try_connect()
        self.spawned = sock is None
        if sock is None:
            self._spawn()
            sock = self._try_connect()
            if sock is None:
                raise Unavailable(f"netd does not answer on {self.socket_path}")
        self._sock = sock
        hello = self._call_blocking({"op": "hello"})
        if hello.get("protocol") != PROTOCOL:
            raise Unavailable(f"netd speaks protocol {hello.get('protocol')}, flyd {PROTOCOL}")
        self.pid = int(hello["pid"])
        self._call_blocking({"op": "uplink", **self.uplink})
        self._call_blocking({"op": "routes", **self.routes})
        if self.limits and "limits" in hello:
            self._call_blocking({"op": "limits", **self.limits})
        sock.setblocking(False)
        return hello

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def submit(self, op: str, fds: list[int] | None = None, **fields: Any) -> asyncio.Future[Any]:
        """Queue one request; the future of its answer (a dict), or of Unavailable when netd
        is gone or refuses.

        The request goes, and its answer is read, whether or not anyone still waits for it:
        a caller cancelled mid-request (its deadline passed) would otherwise leave the answer
        in the socket for the next request to take as its own. Requests go in the order of
        the calls, and each carries an id its answer echoes, so an answer never pairs with
        another request. `fds` are duplicated here: the caller may close its own at once.
        """
        self._requests += 1
        copies = [os.dup(fd) for fd in fds or ()]
        exchange = asyncio.ensure_future(
            self._exchange(self._last, self._requests, op, copies, fields)
        )
        exchange.add_done_callback(_retrieve)
        self._last = exchange
        return exchange

    async def request(self, op: str, fds: list[int] | None = None, **fields: Any) -> dict[str, Any]:
        """One request (see `submit`); its answer. Raises Unavailable when netd is gone or
        refuses. A caller cancelled meanwhile leaves the request to finish on its own."""
        answer: dict[str, Any] = await asyncio.shield(self.submit(op, fds, **fields))
        return answer

    async def _exchange(
        self,
        previous: asyncio.Future[Any] | None,
        ident: int,
        op: str,
        fds: list[int],
        fields: dict[str, Any],
    ) -> dict[str, Any]:
        try:
            if previous is not None and not previous.done():
                await asyncio.wait([previous])  # its outcome is its own caller's
            sock = self._sock
            if sock is None:
                raise NetdGone("netd is not connected")
            loop = asyncio.get_running_loop()
            data = json.dumps({"op": op, "id": ident, **fields}).encode()
            try:
                ancillary = []
                if fds:
                    ancillary = [
                        (
                            socket.SOL_SOCKET,
                            socket.SCM_RIGHTS,
                            b"".join(fd.to_bytes(4, "little") for fd in fds),
                        )
                    ]
                # A datagram this small fits the socket buffer: it never blocks for long.
                while True:
                    try:
                        sock.sendmsg([data], ancillary)
                        break
                    except BlockingIOError:
                        await asyncio.sleep(0.001)
                async with asyncio.timeout(_REQUEST_TIMEOUT_S):
                    while True:
                        answer = await loop.sock_recv(sock, MAX_MESSAGE)
                        if not answer:
                            break
                        reply = _decode(op, answer)
                        if reply.get("id", ident) == ident:  # (a netd before ids echoes none)
                            return _unwrap(op, reply)
                        log.warning("netd_stale_answer", op=op, id=reply.get("id"), wanted=ident)
            except TimeoutError as e:
                self._drop(sock)
                raise Unavailable(f"netd ({op}): no answer in {_REQUEST_TIMEOUT_S}s") from e
            except OSError as e:
                self._drop(sock)
                raise NetdGone(f"netd ({op}): {e}") from e
            self._drop(sock)
            raise NetdGone(f"netd ({op}): it went away")
        finally:
            for fd in fds:
                os.close(fd)

    def _drop(self, sock: socket.socket) -> None:
        """Close the connection `sock`, unless a new one replaced it meanwhile."""
        if self._sock is sock:
            self.close()

    def _call_blocking(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self._sock is not None
        self._sock.settimeout(_REQUEST_TIMEOUT_S)
        self._sock.send(json.dumps(request).encode())
        op = str(request["op"])
        return _unwrap(op, _decode(op, self._sock.recv(MAX_MESSAGE)))

    def _try_connect(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            with unix_address(str(self.socket_path)) as address:
                sock.connect(address)
        except OSError:
            sock.close()
            return None
        return sock

    def _spawn(self) -> None:
        """Start a netd for the run root, detached from flyd, and wait until it listens."""
        kill_netd(self.run_root)  # one that no longer answers
        ready_r, ready_w = os.pipe()
        os.set_inheritable(ready_w, True)
        log_fd = os.open(
            self.run_root / NETD_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        setsid = shutil.which("setsid") or "/usr/bin/setsid"
        argv = [setsid, "-f", sys.executable, "-m", "flyd.drivers.netd"]
        argv += ["--socket", str(self.socket_path), "--ready-fd", str(ready_w)]
        argv += ["--handle", str(self.run_root / NETD_HANDLE)]
        try:
            # setsid -f forks and its parent exits at once: netd is init's child, not ours.
            subprocess.run(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                pass_fds=(ready_w,),
                check=True,
                timeout=_START_TIMEOUT_S,
            )
        except (OSError, subprocess.SubprocessError) as e:
            raise Unavailable(f"cannot start netd: {e}") from e
        finally:
            os.close(ready_w)
            os.close(log_fd)
        try:
            ready, _, _ = select.select([ready_r], [], [], _START_TIMEOUT_S)
            if not ready or os.read(ready_r, 1) != b"1":
                raise Unavailable(f"netd did not start; see {self.run_root / NETD_LOG}")
        finally:
            os.close(ready_r)


def _decode(op: str, answer: bytes) -> dict[str, Any]:
    try:
        reply = json.loads(answer)
    except ValueError as e:
        raise Unavailable(f"netd ({op}): unreadable answer") from e
    if not isinstance(reply, dict):
        raise Unavailable(f"netd ({op}): unreadable answer")
    return reply


def _unwrap(op: str, reply: dict[str, Any]) -> dict[str, Any]:
    if "error" in reply:
        raise Unavailable(f"netd ({op}): {reply['error']}")
    ok = reply.get("ok")
    return ok if isinstance(ok, dict) else {}


def _retrieve(exchange: asyncio.Future[Any]) -> None:
    """An answer nobody waited for (its caller was cancelled): its failure is only logged."""
    if not exchange.cancelled() and exchange.exception() is not None:
        log.debug("netd_request_failed", error=str(exchange.exception()))


def kill_netd(run_root: Path, *, wait: float = 2.0) -> bool:
    """End the run root's netd, if its recorded handle still names a live process.

    Its hub namespace, every machine's network and every port it held go with it.
    """
    try:
        handle = Handle.from_dict(json.loads((run_root / NETD_HANDLE).read_bytes()))
    except (OSError, ValueError, CorruptLog):
        return False
    pidfd = open_pidfd(handle, read_boot_id())
    if pidfd is None:
        return False
    try:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if select.select([pidfd], [], [], 0.05)[0]:
                break
    finally:
        os.close(pidfd)
    with contextlib.suppress(FileNotFoundError):
        (run_root / NETD_HANDLE).unlink()
    return True


class NetdMachines:
    """flyd's account of what netd holds for each machine (its host ports, whether its
    namespaces are up), over a `Netd` connection, and the requests that change it.

    The account follows netd's answers, not its callers: an answer updates it whether or not
    its caller still waits (a cancelled create must not leave it saying a namespace is down
    that netd holds up, or the reverse). If netd is gone, a request starts a new one and
    `republish()` gives it back what the machines had, first.
    """

    def __init__(self, net: Netd, republish: Callable[[], Awaitable[None]]) -> None:
        self.net = net
        self._republish = republish
        self.machines: dict[str, dict[str, Any]] = dict(net.connect().get("machines", {}))
        self.closed = False

    def knows(self, machine_id: str) -> bool:
        """Whether netd may hold something of the machine (a request named it)."""
        return machine_id in self.machines

    def is_up(self, machine_id: str) -> bool:
        return bool(self.machines.get(machine_id, {}).get("up"))

    def ports(self, machine_id: str) -> set[int]:
        """The host ports netd holds for the machine; from now on it may know the machine."""
        return set(self.machines.setdefault(machine_id, {"up": False}).get("ports", ()))

    async def publish(
        self, machine_id: str, ports: list[list[int]], fds: list[int], **up: Any
    ) -> dict[str, Any]:
        """netd holds exactly `ports` ([host, internal]) for the machine, `fds` the sockets
        of those it does not hold yet; with `up` (the fields of an `up`), its namespaces
        come up in the same request. netd's answer."""
        held = sorted(host for host, _ in ports)

        def answered(_: dict[str, Any]) -> None:
            state = self.machines.setdefault(machine_id, {"up": False})
            state["ports"] = held
            state["up"] = state["up"] or bool(up)

        op = "up" if up else "publish"
        return await self.call(op, fds, then=answered, machine=machine_id, ports=ports, **up)

    def mark_up(self, machine_id: str) -> None:
        self.machines.setdefault(machine_id, {}).update(up=True)

    async def down(self, machine_id: str) -> None:
        """netd drops the machine's namespaces. The request joins netd's queue before the
        first await (a caller's check before it cannot be reordered with another's)."""
        if self.knows(machine_id) and not self.closed:
            await self.call("down", then=lambda _: self._downed(machine_id), machine=machine_id)

    def down_now(self, machine_id: str) -> None:
        """`down`, queued without an await, for whoever cannot wait (a cancelled start)."""
        if self.knows(machine_id) and not self.closed:
            down = self.net.submit("down", machine=machine_id)
            down.add_done_callback(
                lambda done: (
                    None if done.cancelled() or done.exception() else self._downed(machine_id)
                )
            )

    def _downed(self, machine_id: str) -> None:
        if machine_id in self.machines:
            self.machines[machine_id]["up"] = False

    async def forget(self, machine_id: str) -> None:
        """netd drops the machine's namespaces and ports."""
        if self.knows(machine_id):
            await self.call(
                "forget", then=lambda _: self.machines.pop(machine_id, None), machine=machine_id
            )

    async def call(
        self,
        op: str,
        fds: list[int] | None = None,
        *,
        then: Callable[[dict[str, Any]], object] | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """A netd request; if netd is gone, start a new one and give it back what it held.
        `then(answer)` runs once netd has answered, even if the caller is cancelled meanwhile.
        The request joins netd's queue before the first await.
        """
        try:
            return await _answered(self.net.submit(op, fds, **fields), then)
        except NetdGone as e:
            if self.closed:
                raise  # the driver closed the connection itself
            log.warning("netd_restarting", previous_pid=self.net.pid, error=str(e))
        self.machines = dict(self.net.connect().get("machines", {}))
        await self._republish()  # and adopts the running machines
        return await _answered(self.net.submit(op, fds, **fields), then)

    def close(self) -> None:
        self.closed = True
        self.net.close()


async def _answered(
    request: asyncio.Future[Any], then: Callable[[dict[str, Any]], object] | None
) -> dict[str, Any]:
    if then is not None:
        request.add_done_callback(
            lambda done: None if done.cancelled() or done.exception() else then(done.result())
        )
    answer: dict[str, Any] = await asyncio.shield(request)
    return answer
