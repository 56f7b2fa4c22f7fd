"""Process plumbing for the benchmarks: a flyd child process, /proc readers, cleanup.

Everything here is synchronous; the async benchmark code calls it between RPCs.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from flyd.drivers.cgroups import force_empty
from runtime import READY_PREFIX, read_announcements

VENV_BIN = Path(sys.executable).parent
FLYD_BIN = VENV_BIN / "flyd"
REPO_ROOT = Path(__file__).resolve().parents[1]
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUP_CONTROLLERS = ("memory", "cpu", "pids")
_PR_SET_CHILD_SUBREAPER = 36


def progress(message: str) -> None:
    """One progress line on stderr, with the time since the bench started."""
    print(f"[bench {time.monotonic() - _T0:6.1f}s] {message}", file=sys.stderr, flush=True)


_T0 = time.monotonic()


# -- this process ----------------------------------------------------------------------------


def raise_fd_limit(want: int = 65536) -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit (children inherit it); returns the new (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < want:
        with contextlib.suppress(ValueError, OSError):  # raising the hard limit needs root
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return resource.getrlimit(resource.RLIMIT_NOFILE)
    new_soft = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if new_soft > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def become_subreaper() -> bool:
    """Adopt orphans of our descendants (wrappers of a SIGKILLed flyd) so we can reap them.

    The wrappers of a SIGKILLed flyd, and every machine process whose wrapper is killed first,
    are orphans; reaping them here instead of leaving them to PID 1 (which, in some sandboxes,
    reaps late or never) lets the run check that nothing is left behind.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid` (over all its threads)."""
    out: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for task in tasks:
        with contextlib.suppress(OSError):
            out.extend(int(p) for p in (task / "children").read_text().split())
    return out


def reap_adopted(keep: set[int]) -> int:
    """Reap exited children of this process that are not in `keep`; returns how many."""
    reaped = 0
    for pid in child_pids(os.getpid()):
        if pid in keep:
            continue
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)
            reaped += done == pid
    return reaped


# -- /proc readers ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcStat:
    state: str
    ppid: int
    start_time: int


def proc_stat(pid: int) -> ProcStat | None:
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return ProcStat(state=fields[0].decode(), ppid=int(fields[1]), start_time=int(fields[19]))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far."""
    data = Path(f"/proc/{pid}/stat").read_bytes()
    fields = data[data.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def alive(pid: int, start_time: int | None = None) -> bool:
    """Running (not a zombie) and, when given, the same process (start time)."""
    st = proc_stat(pid)
    if st is None or st.state in ("Z", "X"):
        return False
    return start_time is None or st.start_time == start_time


def status_kib(pid: int, key: str = "VmRSS") -> int | None:
    """A `kB` field of /proc/PID/status (VmRSS, RssAnon, ...)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0])
    except OSError:
        return None
    return None


def smaps_rollup_kib(pid: int) -> dict[str, int]:
    """Rss, Pss, ... of /proc/PID/smaps_rollup in KiB (empty when unreadable)."""
    out: dict[str, int] = {}
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return out
    for line in lines[1:]:
        name, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[name.strip()] = int(parts[0])
    return out


@dataclass(frozen=True)
class HostCpu:
    """Cumulative host CPU ticks from /proc/stat; subtract two to get a phase's share."""

    busy: int
    iowait: int
    steal: int
    total: int

    @classmethod
    def now(cls) -> HostCpu:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        return cls(
            busy=user + nice + system + irq + softirq,
            iowait=iowait,
            steal=steal,
            total=user + nice + system + idle + iowait + irq + softirq + steal,
        )

    def since(self, earlier: HostCpu) -> dict[str, float]:
        """Percent of all CPUs' time since `earlier`: busy, iowait, steal."""
        total = max(1, self.total - earlier.total)
        return {
            "busy_pct": 100 * (self.busy - earlier.busy) / total,
            "iowait_pct": 100 * (self.iowait - earlier.iowait) / total,
            "steal_pct": 100 * (self.steal - earlier.steal) / total,
        }


def mem_available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def processes_under(root: Path) -> list[int]:
    """Pids (not ours) whose working directory lies under `root`: machines of our flyds."""
    prefix = str(root.resolve())
    found = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if cwd == prefix or cwd.startswith(prefix + "/"):
            st = proc_stat(int(entry.name))
            if st is not None and st.state not in ("Z", "X"):
                found.append(int(entry.name))
    return found


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


# -- cgroups ---------------------------------------------------------------------------------


def cgroup_dirs(prefix: str) -> list[Path]:
    return [CGROUP_ROOT / c / prefix for c in CGROUP_CONTROLLERS]


def remaining_cgroups(prefix: str) -> list[Path]:
    """Machine cgroups left under our prefix (the prefix folders themselves not counted)."""
    left: list[Path] = []
    for parent in cgroup_dirs(prefix):
        with contextlib.suppress(FileNotFoundError):
            left.extend(p for p in parent.iterdir() if p.is_dir())
    return left


def remove_cgroups(prefix: str, deadline_s: float = 5.0) -> list[str]:
    """Kill whatever is left in our cgroups and remove them; returns what could not go."""
    problems: list[str] = []
    for parent in cgroup_dirs(prefix):
        if not parent.exists():
            continue
        children = [p for p in parent.iterdir() if p.is_dir()]
        for cg in [*children, parent]:
            end = time.monotonic() + deadline_s
            while True:
                with contextlib.suppress(OSError, ValueError):
                    kill_all([int(p) for p in (cg / "cgroup.procs").read_text().split()])
                try:
                    force_empty(cg)  # else a removed memory cgroup lingers and slows runs
                    cg.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as e:
                    if e.errno != errno.EBUSY or time.monotonic() > end:
                        problems.append(f"{cg}: {e.strerror}")
                        break
                    time.sleep(0.01)
    return problems


# -- a flyd child process --------------------------------------------------------------------


def clean_env(pycache_prefix: Path | None = None) -> dict[str, str]:
    """Our environment without tracing or service settings that would change flyd.

    With `pycache_prefix`, bytecode is cached there (and written even if this environment
    says PYTHONDONTWRITEBYTECODE), as an installed flyd would have it: without a cache every
    start compiles each imported module again.
    """
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("OTEL_", "NONOMAD_", "FLYD_", "FLAPS_", "PROXY_"))
    }
    if pycache_prefix is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache_prefix)
    return env


def _parse_ts(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


@dataclass
class FlydProcess:
    """One flyd run after another on the same data dir; `start` spawns, `kill` SIGKILLs."""

    data_dir: Path
    image_source: Path
    cgroup_prefix: str
    log_dir: Path
    capacity: dict[str, int]
    pycache_prefix: Path | None = None
    driver: str = "process"
    worker_id: str = "w1"
    region: str = "ams"
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""
    runs: int = 0
    log_path: Path = field(default_factory=Path)
    spawned_wall: float = 0.0
    spawned_mono: float = 0.0
    ready_mono: float = 0.0
    pids: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def args(self) -> list[str]:
        args = [
            str(FLYD_BIN),
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            str(self.data_dir),
            "--image-source",
            str(self.image_source),
            "--worker-id",
            self.worker_id,
            "--region",
            self.region,
            "--cgroup-prefix",
            self.cgroup_prefix,
            "--ports",
            "20000-22999",
            # ListMachines of 1,000 machines is a few MB; stay clear of the 4 MiB default.
            "--max-message-bytes",
            str(64 << 20),
            "--driver",
            self.driver,
        ]
        for key, value in self.capacity.items():
            args += [f"--capacity.{key.replace('_', '-')}", str(value)]
        return args + self.extra_args

    def start(self) -> None:
        """Spawn flyd (stderr to a log file per run); `wait_ready` then finds its address."""
        assert self.proc is None or self.proc.poll() is not None, "flyd already running"
        self.runs += 1
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.log_dir / f"flyd-{self.data_dir.name}-{self.runs}.log"
        with open(self.log_path, "wb") as err:
            self.spawned_wall = time.time()
            self.spawned_mono = time.perf_counter()
            self.proc = subprocess.Popen(
                self.args(),
                cwd=REPO_ROOT,
                env=clean_env(self.pycache_prefix),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
            )
        self.pids.add(self.proc.pid)

    def wait_ready(self, timeout: float = 60.0) -> str:
        """Block until the NONOMAD_READY line; returns host:port (and notes the time)."""
        assert self.proc is not None
        try:
            self.address = read_announcements(self.proc, timeout)[READY_PREFIX]
        except RuntimeError as err:
            raise RuntimeError(f"flyd {err}; log tail:\n{self.log_tail()}") from None
        self.ready_mono = time.perf_counter()
        return self.address

    def log_events(self) -> list[dict[str, object]]:
        events = []
        with contextlib.suppress(FileNotFoundError), open(self.log_path, "rb") as f:
            for raw in f:
                with contextlib.suppress(ValueError):
                    events.append(json.loads(raw))
        return events

    def log_event_time(self, name: str, timeout: float = 30.0) -> float | None:
        """Wall time (from the line's `ts`) of the first log line with event `name`."""
        deadline = time.monotonic() + timeout
        needle = f'"{name}"'.encode()
        while time.monotonic() < deadline:
            with contextlib.suppress(FileNotFoundError), open(self.log_path, "rb") as f:
                for raw in f:
                    if needle not in raw:
                        continue
                    with contextlib.suppress(ValueError):
                        line = json.loads(raw)
                        if line.get("event") == name:
                            return _parse_ts(str(line["ts"]))
            time.sleep(0.01)
        return None

    def first_log_time(self) -> float | None:
        for line in self.log_events():
            if "ts" in line:
                return _parse_ts(str(line["ts"]))
        return None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def rss_kib(self) -> int:
        value = status_kib(self.pid, "VmRSS")
        if value is None:
            raise RuntimeError("flyd is not running")
        return value

    def kill(self) -> None:
        """SIGKILL, as a crash would; machines keep running."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._close_stdout()

    def terminate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM and wait; SIGKILL after `timeout`. Returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._close_stdout()
        return self.proc.returncode

    def _close_stdout(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            with contextlib.suppress(OSError):
                self.proc.stdout.close()
