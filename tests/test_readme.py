"""The README, run as a new user runs it: every shell block, in order, against a real local
cluster (`nonomad up --demo`, what `make up` starts), pasted into one shell as written.

Only what the cluster prints is substituted: the machine id a block calls `ID` (the one the
block's last create printed, else the demo's primary in ams), a lease's `NONCE`, and the
addresses `make up` would have had on a machine of its own (the edge on 127.0.0.1:8080, the
console on :8090; here on free ports). `$F` (flaps) and `$A` (a worker) are set as the README
says to set them. A command that runs until Ctrl-C says so in its comment ("Ctrl-C ends it"):
it runs until it has printed something (15 s at most), is stopped as Ctrl-C would stop it, and
must have printed something.
A block the README marks `<!-- readme-test: skip: WHY -->` is not run, and says why.

A command fails the test when it exits non-zero or writes an error to stderr; the Python
snippet runs from the README's own text.
"""

from __future__ import annotations

import os
import re
import select
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import host_ports
from tests.harness import REPO_ROOT, VENV_BIN, clean_env

README = REPO_ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\s*$")
SKIP = re.compile(r"^<!-- readme-test: skip: (.+) -->$")
MACHINE_ID = re.compile(r"\b[a-z][a-z0-9]*-\d+-[0-9a-f]{12}\b")
JSON_ID = re.compile(r'"id": "([a-z0-9-]+)"')
NONCE = re.compile(r'"nonce": "([^"]+)"')
ERROR = re.compile(r"(?i)\berror\b|traceback|\bfailed\b")
UNTIL_CTRL_C = "Ctrl-C ends it"
RUN_FOR = 15.0  # the most seconds a command that runs until Ctrl-C is given to print something
COMMAND_DEADLINE = 120.0


@dataclass
class Block:
    lang: str
    line: int  # of the opening fence, 1-based
    text: str
    skip: str = ""


def blocks(markdown: str) -> list[Block]:
    """The fenced blocks of `markdown`, with the skip mark that stands right before one."""
    out: list[Block] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        opened = FENCE.match(lines[i])
        if not opened:
            i += 1
            continue
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        i += 1
        before = [line for line in lines[max(0, start - 3) : start] if line.strip()]
        mark = SKIP.match(before[-1]) if before else None
        out.append(
            Block(opened.group(1), start + 1, "\n".join(body), mark.group(1) if mark else "")
        )
    return out


def _complete(command: str) -> bool:
    """Whether `command` is whole: no open quote and no line continuation at its end."""
    if command.rstrip().endswith("\\"):
        return False
    try:
        shlex.split(command, comments=True)
    except ValueError:
        return False
    return True


def commands(block: Block) -> list[str]:
    """The commands of a block as a user pastes them: in a `console` block the lines after
    `$ `, in an `sh` block every line that is not a comment; a command goes on over the lines
    that close its quotes or follow a backslash."""
    out: list[str] = []
    pending: list[str] = []
    for line in block.text.splitlines():
        if pending:
            pending.append(line)
        elif block.lang == "console":
            if line.startswith("$ "):
                pending = [line[2:]]
        elif line.strip() and not line.lstrip().startswith("#"):
            pending = [line]
        if pending and _complete("\n".join(pending)):
            out.append("\n".join(pending))
            pending = []
    assert not pending, f"README line {block.line}: a command never ends: {pending[0]!r}"
    return out


def test_blocks_and_commands_are_read_as_a_user_pastes_them() -> None:
    text = "\n".join(
        [
            "<!-- readme-test: skip: it is the test itself -->",
            "```sh",
            "make test",
            "```",
            "```console",
            "$ nonomad machines list demo",
            "ID  STATE",
            '$ grpcurl -d \'{"a": 1,',
            '  "b": 2}\' $F x.Y/Z',
            "```",
            "```sh",
            "# a comment",
            "A=(-x y)",
            "curl \\",
            "  http://x/   # Ctrl-C ends it",
            "```",
        ]
    )
    skipped, console, sh = blocks(text)
    assert (skipped.skip, console.skip) == ("it is the test itself", "")
    assert commands(console) == [
        "nonomad machines list demo",
        'grpcurl -d \'{"a": 1,\n  "b": 2}\' $F x.Y/Z',
    ]
    assert commands(sh) == ["A=(-x y)", "curl \\\n  http://x/   # Ctrl-C ends it"]


# -- the cluster and the shell --------------------------------------------------------------


@dataclass
class Cluster:
    """A `nonomad up --demo` run from a directory of its own, and what it printed."""

    proc: subprocess.Popen[str]
    workdir: Path
    printed: str
    flaps: str = ""
    edge: str = ""
    console: str = ""
    workers: dict[str, str] = field(default_factory=dict)


def _start_cluster(workdir: Path) -> Cluster:
    # The README runs from a checkout: its paths (nonomad/demo/...) and .venv are the repo's.
    for name in ("nonomad", ".venv"):
        (workdir / name).symlink_to(REPO_ROOT / name)
    proc = subprocess.Popen(
        [
            str(VENV_BIN / "nonomad"),
            "up",
            "--demo",
            "--proxy-port",
            "0",
            "--console-port",
            "0",
            "--base-port",
            str(host_ports.block(400).start),  # 100 for each of its 4 workers
        ],
        cwd=workdir,
        env=clean_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    out: list[str] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        assert line, f"nonomad up ended (exit {proc.poll()}):\n{''.join(out)}"
        out.append(line)
        if line.startswith("running;"):
            break
    else:
        raise AssertionError("nonomad up was not running within 90 s:\n" + "".join(out))
    printed = "".join(out)
    cluster = Cluster(proc, workdir, printed)
    for row in re.finditer(r"^(\S+)\s+(\S+)\s+(127\.0\.0\.1:\d+)\s", printed, re.M):
        cluster.workers[row.group(1)] = row.group(3)
    cluster.flaps = cluster.workers.pop("flaps")
    cluster.workers.pop("proxy")
    edge = re.search(r"-H 'Host: demo\.\S+' http://(127\.0\.0\.1:\d+)/", printed)
    console = re.search(r"the web console: http://(127\.0\.0\.1:\d+)/", printed)
    assert edge, printed
    assert console, printed
    cluster.edge, cluster.console = edge.group(1), console.group(1)
    return cluster


class Shell:
    """One bash, as a terminal a user pastes into: variables set by one command hold for
    the next. Each command's stdout and stderr are kept apart."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.bash = subprocess.Popen(
            ["bash", "--norc", "--noprofile"],
            cwd=workdir,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        # Job control: a command stopped as Ctrl-C stops it is its own process group.
        self._send("set -m")

    def _send(self, script: str) -> str:
        assert self.bash.stdin is not None
        assert self.bash.stdout is not None
        self.bash.stdin.write(script + '\necho "__done__ $?"\n')
        self.bash.stdin.flush()
        deadline = time.monotonic() + COMMAND_DEADLINE
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.bash.stdout], [], [], max(0.0, left))
            if not ready:
                os.killpg(self.bash.pid, signal.SIGKILL)
                raise AssertionError(f"no answer within {COMMAND_DEADLINE:g} s to {script!r}")
            line = self.bash.stdout.readline()
            assert line, "the shell ended"
            if line.startswith("__done__ "):
                return line.split()[1]

    def run(self, command: str, until_ctrl_c: bool) -> tuple[int, str, str]:
        out, err = self.workdir / ".readme.out", self.workdir / ".readme.err"
        redirect = f'> "{out}" 2> "{err}" < /dev/null'
        if until_ctrl_c:
            # It runs until it has printed something (or ended, or RUN_FOR passed), then
            # Ctrl-C: SIGINT to its process group. A background job ignores SIGINT, so the
            # stop is SIGTERM to the group, which every command here ends on too.
            polls = int(RUN_FOR / 0.1)
            script = (
                f': > "{out}"; {{ {command}\n}} {redirect} & __job=$!; __n=0; '
                f'until [ -s "{out}" ] || [ $__n -ge {polls} ] || ! kill -0 $__job 2>/dev/null; '
                "do sleep 0.1; __n=$((__n+1)); done; "
                "kill -TERM -- -$__job 2>/dev/null; wait $__job; (exit 0)"
            )
        else:
            script = f"{{ {command}\n}} {redirect}"
        code = int(self._send(script))
        return code, out.read_text(), err.read_text()

    def close(self) -> None:
        if self.bash.stdin is not None:
            self.bash.stdin.close()
        try:
            self.bash.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.bash.pid, signal.SIGKILL)
            self.bash.wait()
        if self.bash.stdout is not None:
            self.bash.stdout.close()


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cluster = _start_cluster(tmp_path)
    try:
        yield cluster
    finally:
        if cluster.proc.poll() is None:
            cluster.proc.send_signal(signal.SIGINT)  # Ctrl-C, as the README says
            try:
                cluster.proc.wait(60)
            except subprocess.TimeoutExpired:
                cluster.proc.kill()
                cluster.proc.wait()
        if cluster.proc.stdout is not None:
            cluster.proc.stdout.close()


def _substitute(command: str, cluster: Cluster, machine_id: str, nonce: str) -> str:
    command = re.sub(r"\bID\b", machine_id, command)
    command = command.replace("NONCE", nonce)
    command = command.replace("127.0.0.1:8080", cluster.edge)
    return command.replace("127.0.0.1:8090", cluster.console)


@pytest.mark.timeout(900)
def test_every_block_of_the_readme_works_as_written(cluster: Cluster) -> None:
    env = clean_env(
        PATH=f"{cluster.workdir / '.venv' / 'bin'}:{os.environ['PATH']}",
        F=cluster.flaps,
        A=cluster.workers["ams-2"],
    )
    demo = MACHINE_ID.search(cluster.printed)
    assert demo, cluster.printed
    machine_id, nonce = demo.group(0), ""
    shell = Shell(cluster.workdir, env)
    ran: list[str] = []
    try:
        for block in blocks(README.read_text()):
            if block.lang == "python":
                snippet = cluster.workdir / f"readme_{block.line}.py"
                snippet.write_text(block.text)
                done = subprocess.run(
                    [sys.executable, str(snippet)],
                    cwd=cluster.workdir,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=COMMAND_DEADLINE,
                )
                where = f"README line {block.line} (python)"
                print(where, flush=True)
                assert done.returncode == 0, f"{where}: exit {done.returncode}\n{done.stderr}"
                assert not ERROR.search(done.stderr), f"{where}: {done.stderr}"
                # It printed the machine it made, started, by name, and where it serves.
                assert re.search(r" started http://127\.0\.0\.1:\d+/", done.stdout), done.stdout
                ran.append(where)
                continue
            if block.lang not in ("sh", "console") or block.skip:
                continue
            for command in commands(block):
                pasted = _substitute(command, cluster, machine_id, nonce)
                where = f"README line {block.line}: {pasted!r}"
                print(where, flush=True)  # shown with the failure: how far it came
                code, out, err = shell.run(pasted, UNTIL_CTRL_C in command)
                assert code == 0, f"{where} exited {code}\nstdout: {out}\nstderr: {err}"
                assert not ERROR.search(err), f"{where} wrote an error\n{err}"
                if UNTIL_CTRL_C in command:
                    assert out.strip(), f"{where} printed nothing before it was stopped"
                if "machines run" in command or "/CreateMachine" in command:
                    made = JSON_ID.search(out) or MACHINE_ID.search(out)
                    assert made, f"{where} printed no machine id:\n{out}"
                    machine_id = made.group(1) if made.re is JSON_ID else made.group(0)
                found = NONCE.search(out)
                if found:
                    nonce = found.group(1)
                ran.append(where)
    finally:
        shell.close()
    assert len(ran) > 20, ran  # the README's walkthroughs, not an empty parse
    # "Ctrl-C stops it all."
    cluster.proc.send_signal(signal.SIGINT)
    assert cluster.proc.wait(60) == 0
