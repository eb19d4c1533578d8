"""The dashboard in a real browser: sign in, one card per shard, and a shard wedged
under load by `fleetwarden chaos` that the page shows turning DEAD, RESTARTING, then HEALTHY,
with the timeline to match. Every wait is on the page's DOM state (Playwright's waiting), never
a sleep. The screenshot goes to tmp_path, or to $FLEETWARDEN_DASHBOARD_SCREENSHOT
(`make dashboard-screenshot` writes docs/dashboard.png)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
from pathlib import Path

import pytest
from playwright.async_api import BrowserContext, Page, expect

from fleetwarden.router.keys import add_key
from fleetwarden.testing.load import Load
from support.fleet import running_fleet, stamp, until
from support.wait import free_port

pytestmark = pytest.mark.browser

#: Every value card 1's data-state takes, in order, however briefly (DEAD and RESTARTING
#: arrive in one tick: a MutationObserver sees both where a poll might not).
RECORD_STATES = """(index) => {
  const card = document.querySelector(`#shards .card[data-shard="${index}"]`);
  window.seen = [card.dataset.state];
  new MutationObserver((records) => {
    window.seen.push(...records.slice(1).map((r) => r.oldValue), card.dataset.state);
  }).observe(card, {attributes: true, attributeFilter: ["data-state"], attributeOldValue: true});
}"""

#: States taken, in order, with repeats (a snapshot re-renders the same state) removed.
SEEN = """() => window.seen.filter((s, i, all) => i === 0 || s !== all[i - 1])"""

#: True once the page showed ``want`` as a subsequence of the card's states.
SHOWED = """(want) => {
  let at = 0;
  for (const s of window.seen) if (s === want[at]) at += 1;
  return at === want.length;
}"""


async def chaos_cli(fault: str, shard: int, admin_url: str, token_file: Path) -> str:
    """`fleetwarden chaos` as an operator runs it: another process, the admin API over HTTP."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fleetwarden", "chaos", fault, str(shard),
        "--admin", admin_url, "--token-file", str(token_file),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        cwd=token_file.parent)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, out.decode()
    assert token_file.read_text().strip() not in out.decode()
    return out.decode()


async def sign_in_with_the_form(page: Page, admin_url: str, token: str) -> None:
    await page.goto(admin_url + "/")
    await page.fill("#token", "not-the-token-at-all")
    await page.click("#signin button[type=submit]")
    await expect(page.locator("#signin .problem")).to_contain_text("not accepted")
    await page.fill("#token", token)
    await page.click("#signin button[type=submit]")
    await expect(page.locator("#shards .card").first).to_be_visible()


async def test_the_dashboard_shows_a_wedged_shard_condemned_restarted_and_back(
        tmp_path: Path, browser: BrowserContext, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    token_file = tmp_path / "admin.token"
    errors: list[str] = []
    said: list[str] = []
    async with running_fleet(tmp_path, fleet={"engines": 3}) as fleet:
        admin, token = fleet.admin_url, fleet.admin.token
        page = await browser.new_page()
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda msg: said.append(msg.text))

        # Without the token: the sign-in form, and every data route is 401.
        resp = await page.goto(admin + "/")
        assert resp is not None and resp.status == 200
        await expect(page.locator("#signin")).to_be_visible()
        for path in ("/admin/shards", "/admin/events", "/admin/status", "/metrics"):
            assert (await page.request.get(admin + path)).status == 401, path

        await sign_in_with_the_form(page, admin, token)
        await page.click("#top form button")  # sign out
        await expect(page.locator("#signin")).to_be_visible()
        assert (await page.request.get(admin + "/admin/shards")).status == 401

        # The link `fleetwarden up` prints: the token leaves the address bar at once.
        await page.goto(f"{admin}/?token={token}")
        assert page.url == admin + "/"
        cards = page.locator("#shards .card")
        await expect(cards).to_have_count(3)
        await expect(page.locator("#link")).to_have_attribute("data-link", "live")
        for i in range(3):
            card = cards.nth(i)
            await expect(card).to_have_attribute("data-state", "HEALTHY")
            await expect(card.locator(".url")).to_have_text(fleet.ledger.shard(i).base_url)
            await expect(card.locator("dd[data-field=budget]")).to_have_text("5 of 5")
            await expect(card.locator("dd[data-field=config]")).to_have_text("—")  # no fault

        # A confirmation stands before every action: cancelled, nothing happens.
        await cards.nth(0).locator("button[data-action=crash]").click()
        dialog = page.locator("#confirm")
        await expect(dialog).to_be_visible()
        await expect(page.locator("#confirm-title")).to_have_text("Crash shard 0?")
        await page.click("#confirm-cancel")
        await expect(dialog).to_be_hidden()
        assert fleet.ledger.state(0).value == "HEALTHY" and fleet.supervisor.engines[0]
        # Confirmed, it calls the admin route with the page's cookie.
        await cards.nth(2).locator("button[data-action=unwedge]").click()
        await page.click("#confirm-ok")
        await expect(page.locator("#notice")).to_contain_text("shard 2: cleared")

        await page.evaluate(RECORD_STATES, 1)
        wedged = fleet.ledger.shard(1).base_url
        async with Load(fleet.router_url, concurrency=6, max_tokens=40) as load:
            await until(lambda: fleet.router.in_flight().get(wedged, 0) >= 1,
                        what="requests in flight on shard 1")
            assert "wedge set" in await chaos_cli("wedge", 1, admin, token_file)

            card = cards.nth(1)
            await page.wait_for_function(SHOWED, arg=["DEAD"], timeout=30_000)
            await page.wait_for_function(SHOWED, arg=["DEAD", "RESTARTING"], timeout=30_000)
            await expect(card).to_have_attribute("data-state", "HEALTHY", timeout=60_000)
        assert load.failures == [], load.failures[:3]
        # The engine's own prefix-cache hit rate, from its counters, and beside it what the
        # cache-aware router (the default) predicted.
        await expect(cards.nth(0).locator("dd[data-field=cache]")).to_have_text(
            re.compile(r"^\d+\.\d %( \(predicted \d+\.\d %\))?$"), timeout=30_000)
        seen = await page.evaluate(SEEN)
        assert await page.evaluate(SHOWED, ["HEALTHY", "DEAD", "RESTARTING", "HEALTHY"]), seen
        await expect(card.locator(".url")).to_have_text(fleet.ledger.shard(1).base_url)
        await expect(card.locator("dd[data-field=budget]")).to_have_text("4 of 5")
        await expect(card.locator(".trail span")).to_contain_text(
            ["DEAD", "RESTARTING", "STALE", "HEALTHY"])

        # The timeline shows it: shard 1's row has the bands, the cause on the DEAD one.
        bands = page.locator('#timeline rect[data-shard="1"]')
        await expect(bands.and_(page.locator('[data-state="DEAD"]'))).to_have_count(1)
        await expect(bands.and_(page.locator('[data-state="RESTARTING"]'))).to_have_count(1)
        dead_tip = await page.locator('#timeline rect[data-shard="1"][data-state="DEAD"]') \
            .get_attribute("data-tip")
        assert dead_tip is not None and "STUCK" in dead_tip, dead_tip
        # Hovering a band says what it was (the widest of shard 0's bands: drawn first).
        await page.locator('#timeline rect[data-shard="0"]').first.hover(force=True)
        await expect(page.locator("#tip")).to_contain_text("shard 0: ")
        await expect(page.locator('#changes li[data-shard="1"][data-to="DEAD"]')) \
            .to_contain_text("STUCK")
        # The router's rates: a line once two points of its counters are in.
        await expect(page.locator('#traffic polyline[data-series="requests"]')) \
            .to_have_count(1, timeout=30_000)
        await expect(page.locator("#traffic-now")).to_contain_text("rescued")

        # The refit history: a trainer's weight sync, as the page lists it.
        await fleet.begin_refit(1)
        await stamp(fleet, 1)  # the push's end: each engine told the version it holds
        await fleet.complete_refit(1)
        await expect(page.locator('#refits tbody tr[data-outcome="completed"]')) \
            .to_contain_text("v1")
        await expect(cards.nth(0).locator("dd[data-field=weights]")).to_have_text("v1")

        shot = Path(os.environ.get("FLEETWARDEN_DASHBOARD_SCREENSHOT")
                    or tmp_path / "dashboard.png")
        await page.mouse.move(0, 0)
        await page.screenshot(path=str(shot), full_page=True)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        await page.close()

    assert errors == []
    # The token is in no log line: the test's own (every logger, DEBUG up), the engines' log
    # files, or what the browser's console said.
    assert token not in "\n".join(r.getMessage() for r in caplog.records)
    for log_file in (tmp_path / "logs").iterdir():
        assert token not in log_file.read_text(errors="replace"), log_file
    assert token not in "\n".join(said)


async def test_the_page_reconnects_by_itself_and_asks_to_sign_in_when_its_token_changed(
        tmp_path: Path, browser: BrowserContext) -> None:
    port = free_port()  # one admin port for both runs: the page's address stays
    page = await browser.new_page()
    keys = tmp_path / "keys"
    secret = add_key(keys, "trainer")
    async with running_fleet(tmp_path, fleet={"engines": 1}, admin={"port": port},
                             router={"keys_file": str(keys)}) as fleet:
        await page.goto(f"{fleet.admin_url}/?token={fleet.admin.token}")
        await expect(page.locator("#link")).to_have_attribute("data-link", "live")
        first_url = fleet.ledger.shard(0).base_url
        await expect(page.locator("#shards .card .url")).to_have_text(first_url)
        # The data port's keys: the router panel counts each key's requests, and refusals.
        for authorization in (f"Bearer {secret}", f"Bearer {secret}", None):
            answer = await page.request.get(
                fleet.router_url + "/v1/models",
                headers={"Authorization": authorization} if authorization else {})
            assert answer.status == (200 if authorization else 401)
        row = page.locator('#keys tr[data-key="trainer"] td')
        await expect(row).to_have_text(["trainer", "2", "0", "0"], timeout=20_000)
        await expect(page.locator("#key-refusals")).to_have_text("refused 401: 1 missing")
    # The fleet said bye as it stopped; the page waits for it, retrying on its own.
    await expect(page.locator("#link")).to_have_attribute("data-link", "stopped")
    # A larger fleet this time (its own journal): the page must rebuild from a fresh hello.
    async with running_fleet(tmp_path, fleet={"engines": 2}, admin={"port": port},
                             journal={"path": str(tmp_path / "second.sqlite")}) as fleet:
        # The same page, never reloaded.
        await expect(page.locator("#link")).to_have_attribute("data-link", "live",
                                                               timeout=20_000)
        await expect(page.locator("#shards .card .url")).to_have_text(
            [fleet.ledger.shard(0).base_url, fleet.ledger.shard(1).base_url])
    # A run with another token: the page's cookie is refused, and it goes to the sign-in form.
    async with running_fleet(tmp_path, fleet={"engines": 1}, admin={
            "port": port, "token_file": str(tmp_path / "other.token")},
            journal={"path": str(tmp_path / "third.sqlite")}):
        await expect(page.locator("#signin .problem")).to_contain_text(
            "no longer valid", timeout=20_000)
        await page.close()
