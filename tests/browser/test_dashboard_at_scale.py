"""The dashboard with a hundred shards: a page of cards at a time, the pager's counts across
every page, and the fleet's own work in the header (``workmeter.py``). The engines are one
``SimGroup`` in this process, attached as backends."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.async_api import BrowserContext, expect

from fleetwarden.sim import SimConfig
from fleetwarden.sim.many import SimGroup
from support.fleet import running_fleet, until

pytestmark = pytest.mark.browser

SHARDS = 100
PAGE_SIZE = 48  # dashboard.js's


async def test_a_hundred_shards_are_shown_a_page_at_a_time(
        tmp_path: Path, browser: BrowserContext) -> None:
    errors: list[str] = []
    async with SimGroup([SimConfig() for _ in range(SHARDS)]) as group, running_fleet(
            tmp_path, fleet={"engines": 0, "backends": group.urls}) as fleet:
        await until(lambda: fleet.controller.tick_number >= 2
                    and all(fleet.ledger.state(i).value == "HEALTHY" for i in range(SHARDS)),
                    120, "a hundred attached engines healthy")
        page = await browser.new_page()
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        await page.goto(f"{fleet.admin_url}/?token={fleet.admin.token}")
        cards = page.locator("#shards .card")
        await expect(cards).to_have_count(PAGE_SIZE)
        await expect(page.locator("#pager")).to_be_visible()
        await expect(page.locator("#page-of")).to_have_text(f"shards 0–47 of {SHARDS}")
        await expect(page.locator("#page-counts")).to_have_text(f"{SHARDS} HEALTHY")
        await expect(page.locator("#page-prev")).to_be_disabled()
        await expect(page.locator("#work")).to_contain_text("tick p50")
        await expect(page.locator("#work")).to_contain_text("reads/s")
        await expect(page.locator("#timeline .row-label")).to_have_count(PAGE_SIZE)

        await page.click("#page-next")
        await expect(cards.first).to_have_attribute("data-shard", str(PAGE_SIZE))
        await page.click("#page-next")
        await expect(cards).to_have_count(SHARDS - 2 * PAGE_SIZE)  # the last, shorter page
        await expect(page.locator("#page-next")).to_be_disabled()
        await expect(page.locator("#timeline .row-label")).to_have_count(SHARDS - 2 * PAGE_SIZE)
        # A snapshot after the next tick keeps the page the operator turned to.
        seen = fleet.controller.tick_number
        await until(lambda: fleet.controller.tick_number > seen + 1, 60, "two more ticks")
        await expect(cards.first).to_have_attribute("data-shard", str(2 * PAGE_SIZE))
        await page.click("#page-prev")
        await expect(cards.first).to_have_attribute("data-shard", str(PAGE_SIZE))
    assert errors == []
