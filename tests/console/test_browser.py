"""The console in a real browser against a real local cluster.

Debian's chromium, headless, driven by Selenium through chromedriver (bench.browser: both
from the system, nothing downloaded at run time). One cluster (tests.console.cluster) and one
browser serve the module; the browser logs in as the operator does, with the one-time URL
`nonomad up` prints. Every page visited is screenshotted into the test's own directory, and a
test fails if the browser logged an error on any page (a failed request, a script error, a
violation of the console's content security policy). The failover test goes last: it kills a
worker.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from bench.browser import MISSING, chromium
from flaps.v1 import machines_pb2 as m
from flaps.v1 import platform_pb2 as p
from flaps.v1 import platform_pb2_grpc
from flyd.v1 import machine_pb2 as pb
from tests.console.cluster import ConsoleProcess
from tests.proxy.support import ProxyFleet, T, eventually

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING)
# Any one wait on the page; never reached when things work.
PAGE_DEADLINE = 30.0


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    driver = chromium(
        tmp_path_factory.mktemp("profile"),
        tmp_path_factory.mktemp("chromedriver") / "chromedriver.log",
        PAGE_DEADLINE,
    )
    try:
        yield driver
    finally:
        driver.quit()


class Page:
    """The browser on the console: visits pages, waits on them, screenshots each, and keeps
    every error the browser logged."""

    def __init__(self, driver: Any, console: ConsoleProcess, out: Path) -> None:
        self.driver = driver
        self.console = console
        self.out = out
        self.shots = 0
        self.errors: list[dict[str, Any]] = []

    def visit(self, path: str) -> None:
        self.driver.get(self.console.url + path)
        self.until(lambda: self.js("return document.readyState") == "complete", "page loaded")

    def path(self) -> str:
        return str(self.js("return location.pathname + location.search"))

    def log_in(self) -> None:
        """As the operator does: open the one-time login URL `nonomad up` prints (from the
        terminal, so the browser asks nothing), and land on the fleet."""
        self.visit(self.console.login_url().removeprefix(self.console.url))
        self.until(lambda: self.path() == "/", "the fleet page after the login")

    def logged_in(self) -> bool:
        return any(c["name"].startswith("nonomad-console-") for c in self.driver.get_cookies())

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def until(self, check: Callable[[], object], what: str) -> None:
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(self.driver, PAGE_DEADLINE, poll_frequency=0.05).until(
            lambda _: check(), f"timed out waiting for {what}"
        )

    def attr(self, css: str, name: str) -> str | None:
        """An attribute of the first element `css` selects (None: no such element)."""
        return self.js(  # type: ignore[no-any-return]
            "const el = document.querySelector(arguments[0]);"
            "return el ? el.getAttribute(arguments[1]) : null;",
            css,
            name,
        )

    def texts(self, css: str) -> list[str]:
        return self.js(  # type: ignore[no-any-return]
            "return [...document.querySelectorAll(arguments[0])].map(e => e.textContent.trim());",
            css,
        )

    def shot(self, name: str) -> Path:
        self.shots += 1
        path = self.out / f"{self.shots:02d}-{name}.png"
        assert self.driver.save_screenshot(str(path)), f"no screenshot written to {path}"
        return path

    def collect_errors(self) -> None:
        self.errors += [e for e in self.driver.get_log("browser") if e["level"] == "SEVERE"]


@pytest.fixture
def page(
    browser: Any, cluster: tuple[ProxyFleet, ConsoleProcess], tmp_path: Path
) -> Iterator[Page]:
    """The browser, logged in, its screenshots in this test's directory; fails the test on any
    error the browser logged meanwhile."""
    browser.get_log("browser")  # what earlier tests left
    on = Page(browser, cluster[1], tmp_path)
    if not on.logged_in():
        on.log_in()
    yield on
    on.collect_errors()
    assert not on.errors, f"the browser logged errors: {on.errors}"
    assert list(tmp_path.glob("*.png")), "no screenshot was written"


async def list_workers(fleet: ProxyFleet) -> dict[str, p.WorkerEntry]:
    stub = platform_pb2_grpc.PlatformServiceStub(fleet._channel(fleet.flaps_address, flaps=True))
    resp = await stub.ListWorkers(p.ListWorkersRequest(), timeout=T)
    return {w.info.id: w for w in resp.workers}


def shown_worker(page: Page, worker_id: str) -> dict[str, str | None]:
    """What the fleet page's row of the worker says."""
    row = f"#worker-{worker_id}"
    numbers = page.texts(f"{row} .meter .num b")
    return {
        "status": page.attr(row, "data-status"),
        "cpu": numbers[0] if numbers else None,
        "memory": numbers[1] if len(numbers) > 1 else None,
        "total": " / ".join(page.texts(f"{row} .meter .num")),
        "machines": (page.texts(f"{row} .machines .total") or [None])[0],
        "images": ", ".join(page.texts(f"{row} .images .chip")),
    }


def expected_worker(entry: p.WorkerEntry) -> dict[str, str | None]:
    cap = entry.capacity
    cpu = cap.total.cpu_millicores - cap.free.cpu_millicores
    mib = cap.total.memory_mib - cap.free.memory_mib
    live = sum(n for state, n in cap.machines_by_state.items() if state != "destroyed")
    return {
        "status": "alive",
        "cpu": str(cpu),
        "memory": str(mib),
        "total": f"{cpu} / {cap.total.cpu_millicores} m / {mib} / {cap.total.memory_mib} MiB",
        "machines": str(live),
        "images": ", ".join(sorted(i.ref for i in cap.images)),
    }


def shown_region(page: Page, region: str) -> dict[str, str]:
    """What the fleet page's card of the region says: its counts and its sums."""
    card = f'#regions .card[data-region="{region}"]'
    return {
        "counts": " ".join(page.texts(f"{card} > p:first-of-type")),
        "sums": " / ".join(page.texts(f"{card} .meter .num")),
    }


def expected_region(entries: list[p.WorkerEntry]) -> dict[str, str]:
    def reserved(part: str) -> tuple[int, int]:
        total = sum(getattr(e.capacity.total, part) for e in entries)
        free = sum(getattr(e.capacity.free, part) for e in entries)
        return total - free, total

    live = sum(
        n for e in entries for s, n in e.capacity.machines_by_state.items() if s != "destroyed"
    )
    alive = sum(1 for e in entries if e.status == p.WORKER_STATUS_ALIVE)
    (cpu, cpus), (mib, mibs) = reserved("cpu_millicores"), reserved("memory_mib")
    return {
        "counts": f"{alive} of {len(entries)} workers alive \N{MIDDLE DOT} {live} machines",
        "sums": f"{cpu} / {cpus} m / {mib} / {mibs} MiB",
    }


async def slot(fleet: ProxyFleet, app: str) -> tuple[pb.Machine, pb.Machine]:
    """A primary of `app` on w1 and its standby on w2."""
    await fleet.until_alive()
    primary = await fleet.create(app, labels={"side": "a"})
    standby = await fleet.create(app, standby_for=[primary.id])
    assert (primary.worker_id, standby.worker_id) == ("w1", "w2")
    return primary, standby


async def test_the_fleet_page_shows_every_worker_with_the_right_numbers(
    cluster: tuple[ProxyFleet, ConsoleProcess], page: Page
) -> None:
    fleet, console = cluster
    primary, standby = await slot(fleet, "web")
    await fleet.create("web", labels={"side": "b"})
    workers = await list_workers(fleet)
    assert set(workers) == {"w1", "w2"}

    page.visit("/")
    page.shot("fleet")
    # The page follows the cluster live: it comes to what flaps says without a reload.
    for worker_id, count in (("w1", "1"), ("w2", "2")):

        async def agrees(worker_id: str = worker_id, count: str = count) -> bool:
            want = expected_worker((await list_workers(fleet))[worker_id])
            return want["machines"] == count and shown_worker(page, worker_id) == want

        await eventually(agrees, f"the fleet page's {worker_id} as flaps has it")
    # Both as flaps has them: the three machines of 100m and 64 MiB each, two on w2, and the
    # image each worker pulled for them, cached.
    assert shown_worker(page, "w1")["cpu"] == "100"
    assert (shown_worker(page, "w2")["cpu"], shown_worker(page, "w2")["memory"]) == ("200", "128")
    assert shown_worker(page, "w1")["images"] == shown_worker(page, "w2")["images"] == "demo:v1"
    # The region's card sums its workers.

    async def region_agrees() -> bool:
        now = await list_workers(fleet)
        return shown_region(page, "ams") == expected_region(list(now.values()))

    await eventually(region_agrees, "the fleet page's region as flaps has its workers")
    assert shown_region(page, "ams") == {
        "counts": "2 of 2 workers alive \N{MIDDLE DOT} 3 machines",
        "sums": f"300 / {2 * workers['w1'].capacity.total.cpu_millicores} m"
        f" / 192 / {2 * workers['w1'].capacity.total.memory_mib} MiB",
    }
    page.shot("fleet-three-machines")
    # The JSON twin holds the numbers the page is rendered from.
    data = console.json("/")
    rows = {w["id"]: w for w in data["workers"]}
    assert (rows["w2"]["cpu"]["reserved"], rows["w2"]["memory"]["reserved"]) == (200, 128)
    assert rows["w1"]["machines"]["total"] == 1
    assert [a["name"] for a in data["apps"]] == ["web"]
    # The app's page: its machines and the slot's relations.
    page.visit("/apps/web")
    page.until(lambda: page.attr(f"#m-{primary.id}", "data-state") == "started", "primary up")
    assert page.attr(f"#m-{primary.id}", "data-role") == "primary"
    assert page.attr(f"#m-{standby.id}", "data-role") == "standby"
    page.shot("app")
    twin = console.json("/apps/web")
    assert {m["id"] for m in twin["machines"]} >= {primary.id, standby.id}
    assert twin["page"] == {
        "number": 1,
        "pages": 1,
        "first": 1,
        "rows_per_page": 100,
        "machines": 3,
    }
    assert console.refusal("/apps/web?page=0") == (400, "page: must be a page number, 1 or more")
    assert console.refusal("/apps/web?page=2") == (404, "page: app web has 1 pages")
    assert console.refusal("/apps/Not_An_App")[0] == 400
    assert console.refusal("/machines/w1-0000000000ff")[0] == 404


async def test_the_placement_explanation_matches_simulate_placement(
    cluster: tuple[ProxyFleet, ConsoleProcess], page: Page
) -> None:
    fleet, console = cluster
    await fleet.until_alive()
    stub = platform_pb2_grpc.PlatformServiceStub(fleet._channel(fleet.flaps_address, flaps=True))
    config = pb.MachineConfig(
        image="demo:v1",
        guest=pb.GuestConfig(cpu_millicores=100, memory_mib=64),
        services=[pb.ServiceConfig(internal_port=8080, autostart=True)],
        placement=pb.PlacementConfig(required_labels={"side": "b"}),
    )
    # Nothing changes between the simulation and the create: the same state.
    sim = await stub.SimulatePlacement(
        p.SimulatePlacementRequest(app="why", region="ams", config=config), timeout=T
    )
    # Made with a secret: its value reaches the machine and nowhere else, the console included.
    secret = f"s3cret-{uuid.uuid4().hex}"
    with_secret = pb.MachineConfig()
    with_secret.CopyFrom(config)
    with_secret.secrets["API_KEY"] = secret
    made = (
        await fleet.machines().CreateMachine(
            m.CreateMachineRequest(app="why", region="ams", config=with_secret), timeout=T
        )
    ).machine
    assert made.worker_id == sim.candidates[0].worker_id == "w2"

    page.visit(f"/machines/{made.id}")
    page.shot("machine")
    region = '#placement .region-decision[data-region="ams"]'
    assert page.attr(region, "data-outcome") == "placed"
    shown = page.js(
        "return [...document.querySelectorAll(arguments[0] + ' table.candidates tbody tr')]"
        ".map(tr => ({worker: tr.dataset.worker, score: Number(tr.dataset.score),"
        " chosen: tr.classList.contains('chosen'),"
        " subs: Object.fromEntries([...tr.querySelectorAll('td.sub')]"
        "   .filter(td => td.dataset.value !== '')"
        "   .map(td => [td.dataset.part, Number(td.dataset.value)]))}));",
        region,
    )
    want = [
        {
            "worker": c.worker_id,
            "score": pytest.approx(c.score),
            "chosen": i == 0,
            "subs": pytest.approx(dict(c.sub_scores)),
        }
        for i, c in enumerate(sim.candidates)
    ]
    assert shown == want
    rejected = page.js(
        "return Object.fromEntries([...document.querySelectorAll(arguments[0] +"
        " ' .rejections .chip')].map(c => [c.dataset.reason, Number(c.dataset.count)]));",
        region,
    )
    assert rejected == dict(sim.rejections_by_reason) != {}  # w1 lacks the label
    # The JSON twin says the same, and the CLI's `nonomad machines why` reads the same record.
    twin = console.json(f"/machines/{made.id}")
    (decision,) = twin["placement"]["regions"]
    assert [c["worker_id"] for c in decision["candidates"]] == [c.worker_id for c in sim.candidates]
    assert decision["rejections_by_reason"] == dict(sim.rejections_by_reason)
    # The machine's log tail arrives over its own stream.
    page.until(lambda: page.js("return document.getElementById('logs').textContent") != "", "log")
    page.until(lambda: page.attr("#live-status", "data-state") == "live", "the stream open")
    page.shot("machine-log")
    # The secret by name, its value redacted: not in the page (as the browser has it, after
    # its live updates) nor in its JSON twin.
    shown = json.loads(page.js("return document.querySelector('pre.config').textContent"))
    assert shown["secrets"] == twin["config"]["secrets"] == {"API_KEY": "<redacted>"}
    assert secret not in page.js("return document.documentElement.outerHTML")
    assert secret not in json.dumps(console.json(f"/machines/{made.id}"))


def feed_has(page: Page, kind: str, css: str, text: str) -> bool:
    """Whether the page's feed has an item of `kind` holding an element `css` selects, and
    saying `text`."""
    return bool(
        page.js(
            "return [...document.querySelectorAll('#feed .feed-item')].some(li =>"
            " li.dataset.kind === arguments[0] && li.querySelector(arguments[1])"
            " && li.textContent.includes(arguments[2]))",
            kind,
            css,
            text,
        )
    )


async def test_the_events_page_shows_a_placement_and_a_refusal_as_they_happen(
    cluster: tuple[ProxyFleet, ConsoleProcess], page: Page
) -> None:
    fleet, console = cluster
    await fleet.until_alive()
    await eventually(
        lambda: console.json("/events")["placements_watched"], "the console watching placements"
    )
    page.visit("/events")
    page.js("window.notReloaded = true")
    page.until(lambda: page.attr("#live-status", "data-state") == "live", "the stream open")
    page.shot("events")

    made = await fleet.create("events", labels={"side": "b"})
    page.until(
        lambda: feed_has(page, "placed", f'a[href="/machines/{made.id}"]', "placed on w2"),
        "the placement on the events page",
    )
    # Bigger than any worker: refused, and the page says why.
    too_big = pb.MachineConfig(
        image="demo:v1", guest=pb.GuestConfig(cpu_millicores=100, memory_mib=8192)
    )
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await fleet.machines().CreateMachine(
            m.CreateMachineRequest(app="toobig", region="ams", config=too_big), timeout=T
        )
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    page.until(
        lambda: feed_has(page, "refused", 'a[href="/apps/toobig"]', "no worker in ams took it"),
        "the refusal on the events page",
    )
    assert page.js("return window.notReloaded") is True
    page.shot("events-placed-and-refused")

    # The JSON twin has them, newest first; asked for one app, that app's only.
    def kinds() -> list[tuple[str, str, str]]:
        return [(i["kind"], i["app"], i["machine_id"]) for i in console.json("/events")["events"]]

    # (the worker's own word of the create comes through the registry, on its own time)
    await eventually(lambda: ("created", "events", made.id) in kinds(), "the create in events")
    said = kinds()
    assert said.index(("refused", "toobig", "")) < said.index(("placed", "events", made.id))
    only = console.json("/events?app=toobig")["events"]
    assert [(i["kind"], i["region"]) for i in only] == [("refused", "ams")]
    assert only[0]["text"] == "no worker in ams took it (2 insufficient_memory)"

    # The apps page lists every app with its machines, as its JSON twin does.
    page.visit("/apps")
    page.shot("apps")
    listed = page.js(
        "return [...document.querySelectorAll('#apps-list a.chip')].map(a =>"
        " [a.getAttribute('href'), a.querySelector('.muted').textContent])"
    )
    twin = console.json("/apps")["apps"]
    assert listed == [[f"/apps/{a['name']}", str(a["machines"])] for a in twin]
    assert {"name": "events", "machines": 1} in twin
    assert "toobig" not in [a["name"] for a in twin]  # refused: no machine


async def test_the_browser_logs_out_and_in_again_with_the_token(page: Page) -> None:
    """The page fixture logged in with the one-time URL. The cookie is out of scripts' reach;
    the logout ends the session; the login form with the admin token opens another, and goes
    back where the browser was sent from; a used login URL opens nothing."""
    cookie = next(c for c in page.driver.get_cookies() if c["name"].startswith("nonomad-console"))
    assert (cookie["httpOnly"], cookie["sameSite"], cookie["path"]) == (True, "Strict", "/")
    assert page.js("return document.cookie") == ""
    page.visit("/")
    page.driver.find_element("css selector", "#logout button").click()
    page.until(lambda: page.path() == "/login", "the login page after the logout")
    page.shot("logged-out")
    assert not page.logged_in()
    page.visit("/apps")
    assert page.path() == "/login?next=%2Fapps"
    page.driver.find_element("css selector", "#token").send_keys(page.console.admin_token)
    page.driver.find_element("css selector", "#login-submit").click()
    page.until(lambda: page.path() == "/apps", "the apps page after the login")
    assert page.logged_in()
    page.shot("logged-in-with-the-form")
    # A login URL works once.
    url = page.console.login_url()
    page.driver.find_element("css selector", "#logout button").click()
    page.until(lambda: page.path() == "/login", "logged out again")
    page.visit(url.removeprefix(page.console.url))
    page.until(lambda: page.path() == "/", "the fleet page after the login")
    page.driver.find_element("css selector", "#logout button").click()
    page.until(lambda: page.path() == "/login", "logged out once more")
    page.visit(url.removeprefix(page.console.url))
    assert "login code: unknown, used or expired" in page.js(
        "return document.getElementById('login-error').textContent"
    )
    assert not page.logged_in()
    page.collect_errors()
    # (the used code's page answered 401: the browser logs that as an error of its own)
    page.errors = [e for e in page.errors if "401" not in e["message"]]
    page.log_in()


async def test_a_killed_worker_turns_dead_and_its_standby_starts_without_a_reload(
    cluster: tuple[ProxyFleet, ConsoleProcess], page: Page
) -> None:
    fleet, console = cluster
    primary, standby = await slot(fleet, "fail")
    await fleet.until_routed("fail", 2)
    # Two tabs: the fleet page and the app's page, each marked to prove it is never reloaded.
    page.visit("/")
    fleet_tab = page.driver.current_window_handle
    page.js("window.notReloaded = true")
    page.driver.switch_to.new_window("tab")
    page.visit("/apps/fail")
    app_tab = page.driver.current_window_handle
    page.js("window.notReloaded = true")
    page.until(lambda: page.attr(f"#m-{primary.id}", "data-state") == "started", "primary up")
    page.until(lambda: page.attr("#live-status", "data-state") == "live", "the stream open")
    assert page.attr(f"#m-{standby.id}", "data-state") != "started"
    page.shot("before-failover")
    # A third: the live events.
    page.driver.switch_to.new_window("tab")
    page.visit("/events")
    events_tab = page.driver.current_window_handle
    page.js("window.notReloaded = true")
    page.until(lambda: page.attr("#live-status", "data-state") == "live", "the events stream")
    page.driver.switch_to.window(app_tab)

    fleet.workers["w1"].kill()  # flyd is gone; the proxy fails the slot over to the standby

    page.until(lambda: page.attr(f"#m-{standby.id}", "data-state") == "started", "promoted")
    page.until(lambda: page.attr(f"#m-{standby.id}", "data-role") == "primary", "now primary")
    page.until(lambda: page.attr(f"#m-{primary.id}", "data-role") == "superseded", "superseded")
    page.until(
        lambda: page.attr(f"#m-{primary.id}", "data-worker-status") == "dead", "w1 dead here"
    )
    assert page.js("return window.notReloaded") is True
    page.shot("app-after-failover")
    page.until(
        lambda: page.js(
            "return [...document.querySelectorAll('#feed .feed-item')]"
            ".some(li => li.dataset.machine === arguments[0] && li.dataset.kind === 'promoted')",
            standby.id,
        ),
        "the standby's promotion in the feed",
    )
    page.collect_errors()  # (each tab's log is read while it is the current one)
    page.driver.switch_to.window(fleet_tab)
    page.until(lambda: page.attr("#worker-w1", "data-status") == "dead", "w1 dead on the fleet")
    assert page.js("return window.notReloaded") is True
    page.shot("fleet-after-failover")
    page.collect_errors()
    page.driver.switch_to.window(events_tab)
    page.until(
        lambda: feed_has(page, "worker_dead", "time", "worker w1 is dead"), "w1's death in events"
    )
    page.until(
        lambda: feed_has(page, "promoted", f'a[href="/machines/{standby.id}"]', ""),
        "the promotion in events",
    )
    assert page.js("return window.notReloaded") is True
    page.shot("events-after-failover")
    page.collect_errors()
    for tab in (app_tab, events_tab):
        page.driver.switch_to.window(tab)
        page.driver.close()
    page.driver.switch_to.window(fleet_tab)
    assert console.json("/")["workers"][0]["status"] == "dead"
    dead = [i for i in console.json("/events")["events"] if i["kind"] == "worker_dead"]
    assert [i["worker_id"] for i in dead] == ["w1"]
