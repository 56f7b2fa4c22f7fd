"""The services draw their ids, random numbers and time from what they are given, not from the
process: every `secrets`, module-level `random`, `uuid`, `os.urandom` and wall or monotonic
clock read in the service packages is one the allow-list below names, with its reason.

A simulated cluster (issue 29) runs every node from one seed on virtual time; a draw that
bypasses the node's `Entropy` (runtime.entropy) or `Clock` (runtime.clock) would make two runs
of one seed differ. `loop.time()` is fine: a simulated node's loop runs on virtual time.
"""

from __future__ import annotations

import ast
from pathlib import Path

from flyd.fakes import FakeHost
from flyd.store import MemoryMachineLog
from runtime.clock import ManualClock
from runtime.entropy import SeededEntropy, SystemEntropy
from tests.flyd.support import boot, config, image_cache, image_source

ROOT = Path(__file__).resolve().parent.parent

SERVICES = ("runtime", "model", "flyd", "flaps", "registry", "proxy")
"""The packages a simulated cluster runs (the CLI and console in `nonomad` drive it)."""

FORBIDDEN = {
    "secrets": None,  # every name
    "uuid": frozenset({"uuid1", "uuid4"}),
    "os": frozenset({"urandom", "getrandom"}),
    "time": frozenset({"time", "time_ns", "monotonic", "monotonic_ns"}),
    "random": None,  # every name but a seeded `random.Random(seed)` (or its type)
}

ALLOWED: dict[tuple[str, str], str] = {
    ("runtime/clock.py", "time.time"): "SystemClock is the real clock",
    ("runtime/entropy.py", "secrets.token_hex"): "SystemEntropy is the real randomness",
    ("runtime/entropy.py", "random.Random()"): "SystemEntropy's generators (os.urandom seeds)",
    ("runtime/server.py", "time.monotonic"): "waits on a real child process's readiness",
    ("model/tokens.py", "secrets.token_bytes"): "key material: unpredictable in every run",
    ("model/tokens.py", "secrets.token_hex"): "a token's id, minted by the operator's CLI",
    ("model/tokens.py", "time.time"): "the default of `now=` (the CLI's; services pass theirs)",
    ("model/images/oci.py", "secrets.token_hex"): "a temporary file's name on this disk",
    ("flyd/secrets.py", "secrets.token_bytes"): "an AEAD nonce: unpredictable in every run",
    ("flyd/main.py", "secrets.token_hex"): "the boot id, in the production wiring",
    ("flyd/main.py", "time.monotonic"): "the default of `Parts.monotonic`",
    ("flyd/worker.py", "time.monotonic"): "the default of `monotonic=`",
    ("flyd/fencing.py", "time.monotonic"): "the default of `monotonic=`",
    ("flyd/images/base.py", "secrets.token_hex"): "a temporary file's name on this disk",
    ("flyd/images/build.py", "secrets.token_hex"): "a temporary file's name on this disk",
    ("flyd/images/cache.py", "secrets.token_hex"): "a scratch or trash directory's name",
    ("flyd/images/cache.py", "time.time"): "the default of `clock=`",
    ("flyd/drivers/netd.py", "time.time"): "netd's log stamps: a real helper process",
    ("flyd/drivers/spares.py", "secrets.token_hex"): "crun's run directories: the real driver",
    ("flyd/drivers/netclient.py", "time.monotonic"): "waits on the real netd process",
    ("flyd/storage/diskfile.py", "time.monotonic"): "waits on a real loop device",
}
"""(file, what it reads) -> why a real draw is right there. The simulator runs none of these
paths, or runs them with the injected value."""


def reads(tree: ast.AST) -> list[tuple[int, str]]:
    """Each (line, name) of a forbidden read in a module: `secrets.token_hex`, ..., an unseeded
    `random.Random()` (as "random.Random()"), and `from secrets import x` forms."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and _name(node.func) == "random.Random" and not node.args:
            found.append((node.lineno, "random.Random()"))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            names = FORBIDDEN.get(node.value.id, frozenset())
            if node.value.id == "random" and node.attr == "Random":
                continue  # a seeded generator or its type; an unseeded one is the Call above
            if names is None or node.attr in names:
                found.append((node.lineno, f"{node.value.id}.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module in FORBIDDEN and node.level == 0:
            names = FORBIDDEN[node.module]
            for alias in node.names:
                if (names is None and alias.name != "Random") or (names and alias.name in names):
                    found.append((node.lineno, f"{node.module}.{alias.name}"))
    return sorted(found)


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return ""


def violations(root: Path) -> tuple[list[str], set[tuple[str, str]]]:
    """The reads under `root`'s service packages the allow-list does not name, as
    "file:line: name", and the allow-list entries that were used."""
    bad: list[str] = []
    used: set[tuple[str, str]] = set()
    for package in SERVICES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if "/v1/" in rel or path.name == "fakes.py":
                continue  # generated code; the fakes are test doubles a simulation seeds
            for line, name in reads(ast.parse(path.read_text(), rel)):
                if (rel, name) in ALLOWED:
                    used.add((rel, name))
                else:
                    bad.append(f"{rel}:{line}: {name}")
    return bad, used


def test_the_services_draw_only_from_what_they_are_given() -> None:
    bad, used = violations(ROOT)
    assert not bad, (
        "a direct draw of randomness or time in a service: take an Entropy (runtime.entropy) or "
        "a Clock (runtime.clock), or name it in ALLOWED with why:\n" + "\n".join(bad)
    )
    assert not set(ALLOWED) - used, f"allowed but gone (drop them): {set(ALLOWED) - used}"


def test_a_planted_draw_is_caught(tmp_path: Path) -> None:
    (tmp_path / "flaps").mkdir(parents=True)
    for package in SERVICES:
        (tmp_path / package).mkdir(exist_ok=True)
    (tmp_path / "flaps" / "ids.py").write_text(
        "import random, secrets, time, uuid\n"
        "from secrets import token_bytes\n"
        "def new_id():\n"
        "    return secrets.token_hex(6)\n"
        "RNG = random.Random()\n"
        "SEEDED = random.Random(7)  # seeded: fine\n"
        "def pick(xs: list[int], rng: random.Random) -> int:  # the type: fine\n"
        "    return random.choice(xs) + time.time() + uuid.uuid4().int\n"
    )
    bad, _ = violations(tmp_path)
    assert bad == [
        "flaps/ids.py:2: secrets.token_bytes",
        "flaps/ids.py:4: secrets.token_hex",
        "flaps/ids.py:5: random.Random()",
        "flaps/ids.py:8: random.choice",
        "flaps/ids.py:8: time.time",
        "flaps/ids.py:8: uuid.uuid4",
    ]


def test_one_seed_draws_the_same_values_in_every_run() -> None:
    one, two = SeededEntropy(42), SeededEntropy(42)
    assert [one.token_hex(8) for _ in range(5)] == [two.token_hex(8) for _ in range(5)]
    assert one.rng().random() == two.rng().random()
    assert SeededEntropy("run-7").token_hex(6) == SeededEntropy("run-7").token_hex(6)
    assert SeededEntropy(1).token_hex(8) != SeededEntropy(2).token_hex(8)


def test_a_child_stream_does_not_shift_with_its_parents_draws() -> None:
    quiet, busy = SeededEntropy(9), SeededEntropy(9)
    for _ in range(100):
        busy.token_hex(16)
    assert quiet.child("flyd-1").token_hex(8) == busy.child("flyd-1").token_hex(8)
    assert quiet.child("flyd-1").token_hex(8) != quiet.child("flyd-2").token_hex(8)


def test_the_system_draws_are_hex_of_the_size_asked_and_differ() -> None:
    system = SystemEntropy()
    drawn = {system.token_hex(8) for _ in range(20)}
    assert len(drawn) == 20
    assert all(len(t) == 16 and int(t, 16) >= 0 for t in drawn)
    assert system.rng().random() != system.rng().random()


async def _seeded_run(root: Path, seed: int) -> list[str]:
    """Boot a worker whose log and worker draw from `seed`; create two machines and take a
    lease: what it drew."""

    entropy = SeededEntropy(seed)
    store = MemoryMachineLog(entropy=entropy.child("log"))
    flyd = boot(
        store=store,
        host=FakeHost(),
        clock=ManualClock(),
        images=image_cache(root, image_source(root)),
    )
    flyd.worker.entropy = entropy.child("worker")
    try:
        flyd.worker.recover()
        drawn = [store.epoch()]
        for _ in range(2):
            made = await flyd.worker.create(
                machine_id="", name="", app="a", config=config(), skip_launch=True
            )
            drawn += [made.id, made.instance_id]
        lease = await flyd.worker.acquire_lease(
            drawn[1], ttl=10, owner="t", description="", nonce=""
        )
        return [*drawn, lease.nonce]
    finally:
        await flyd.kill()


async def test_a_seeded_worker_draws_the_same_ids_every_run(tmp_path: Path) -> None:
    first = await _seeded_run(tmp_path / "1", seed=3)
    again = await _seeded_run(tmp_path / "2", seed=3)
    other = await _seeded_run(tmp_path / "3", seed=4)
    assert first == again
    assert len(set(first)) == len(first)  # an epoch, 2 machine and instance ids, a nonce
    assert not set(first) & set(other)
