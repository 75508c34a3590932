"""The dashboard in headless Chromium: it loads, shows an incident that the tracker and the
analyzer produced from telemetry on a real NATS server, and an operator's approve click moves
a plan to approved. Screenshots go to the test's tmp dir (and to docs/ with
GREYHOUND_DOCS_SCREENSHOTS=1)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from services.common.bus.auth import agent_user
from services.common.db import repository as repo
from services.common.db.documents import Culprit, Evidence, Gpu, MicrobatchParams, Validation
from services.common.db.models import Plan
from services.common.runtime import start_service
from tests.conftest import Bus
from tests.services.api.browser import chrome, ensure_chromium
from tests.services.api.conftest import api_settings
from tests.services.api.live import (
    AGENT,
    LiveJob,
    detecting_services,
    publish_history,
    run_slow,
    serve_api,
)
from tests.services.notifier.receiver import free_port

DOCS = Path(__file__).resolve().parents[3] / "docs"


async def _until(pred: Any, timeout_s: float, what: str) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        value = await pred()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


async def _history(helper: Any) -> None:
    """Earlier jobs on the same machine: GPU node-a:2 confirmed slow three times in two jobs."""
    for n, job in enumerate(("etl-embed-3", "llm-sft-12", "llm-sft-12")):
        await helper.job(job, hosts=("node-a",))
        await helper.incident(
            job, kind="compute_slow", culprit=Culprit(ranks=[2], gpus=[
                Gpu(rank=2, host="node-a", device=2, node=0)]),
            evidence=Evidence(validation=Validation(suspicion=f"s{n}", verdict="compute_slow",
                                                    pause_s=1.1 + n / 10)),
            stages=("localized", "validated", "resolved"))


def _dump(driver: Any, where: Path) -> None:
    """What the browser showed when a wait failed (kept in the test's tmp dir)."""
    driver.save_screenshot(str(where / "failure.png"))
    (where / "failure.html").write_text(driver.page_source)
    logs = driver.get_log("browser") if hasattr(driver, "get_log") else []
    (where / "failure-console.txt").write_text("\n".join(str(e) for e in logs))


async def test_dashboard_shows_a_live_incident_and_approves_a_plan(
        own_bus: Bus, fresh_db_url: str, tmp_path: Path) -> None:
    ensure_chromium()
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    settings = api_settings(own_bus.url, fresh_db_url, tmp_path)
    ctx = await start_service("api", settings, backends=own_bus.backends("api", fresh_db_url))
    agent = await own_bus.connect(agent_user(AGENT))
    job = LiveJob("llm-pretrain-7")
    stop = asyncio.Event()
    slow: asyncio.Task[None] | None = None
    try:
        async with detecting_services(own_bus, settings):
            nxt = await publish_history(agent.jetstream(), job)
            await asyncio.sleep(1.0)  # healthy for a while, then rank 2 slows down, live
            slow = asyncio.create_task(run_slow(agent.jetstream(), job, nxt, stop))

            async def incident() -> Any:
                async with ctx.db()() as session:
                    rows = await repo.list_incidents(session, job_id=job.job_id)
                return rows[0] if rows else None

            inc = await _until(incident, 60, "the tracker and analyzer to open an incident")
        await asyncio.sleep(4.0)  # a few more slow iterations on the chart
        assert inc.kind == "slowdown" and inc.status == "detected"
        async with ctx.db()() as session:  # what the planner would propose
            plan = Plan(incident_id=inc.id, job_id=job.job_id, strategy="S2",
                        params=MicrobatchParams(
                            kind="microbatch", microbatches=[9, 9, 5, 9], previous=[8, 8, 8, 8],
                            times=[1.0, 1.0, 1.5, 1.0], multiple_of=1, slow_dp_groups=[2],
                            makespan_before=12.0, makespan_after=9.0), expected_gain=1.28,
                        expires_at=datetime.now(UTC) + timedelta(minutes=15))
            session.add(plan)
            await session.commit()
            plan_id = plan.id
        from tests.services.api.conftest import Api

        helper = Api(ctx, None, None)
        token = await helper.token("operator", "alice")
        await _history(helper)

        async with serve_api(ctx, free_port()) as base:
            driver = await asyncio.to_thread(chrome, 1400, 1700)
            try:
                def load_overview() -> tuple[str, str, str]:
                    driver.get(f"{base}/dashboard/")
                    driver.execute_script(f"localStorage.setItem('greyhound.token', '{token}')")
                    driver.refresh()
                    row = WebDriverWait(driver, 30).until(ec.presence_of_element_located(
                        (By.CSS_SELECTOR, f"tr[data-incident='{inc.id}']")))
                    WebDriverWait(driver, 10).until(
                        lambda d: "node-a:2" in d.find_element(By.ID, "fleet").text)
                    WebDriverWait(driver, 10).until(
                        lambda d: "alice" in d.find_element(By.ID, "who").text)
                    waiting = driver.find_element(By.CSS_SELECTOR,
                                                  f"#awaiting tr[data-waiting='{plan_id}']")
                    first = waiting.text
                    WebDriverWait(driver, 10).until(lambda d: waiting.text != first)  # it ticks
                    driver.save_screenshot(str(tmp_path / "dashboard-overview.png"))
                    return str(row.text), str(driver.find_element(By.ID, "fleet").text), str(first)

                try:
                    row_text, fleet, waiting = await asyncio.to_thread(load_overview)
                except Exception:
                    await asyncio.to_thread(_dump, driver, tmp_path)
                    raise
                assert "slowdown" in row_text and job.job_id in row_text and "rank" in row_text
                assert "gpu node-a:2 drain 3 confirmed of 3, 2 jobs" in fleet
                # the proposal's time left, counted down (15 minutes when it was made)
                assert "S2" in waiting and job.job_id in waiting
                left = re.search(r"(\d+):(\d\d) left to decide", waiting)
                assert left is not None and 13 * 60 < int(left[1]) * 60 + int(left[2]) <= 15 * 60

                def open_incident_and_approve() -> tuple[str, str]:
                    driver.find_element(By.CSS_SELECTOR, f"tr[data-incident='{inc.id}'] td").click()
                    WebDriverWait(driver, 30).until(ec.presence_of_element_located(
                        (By.CSS_SELECTOR, "#heatmap svg rect")))
                    WebDriverWait(driver, 10).until(ec.presence_of_element_located(
                        (By.CSS_SELECTOR, "#timeline .marker.incident")))
                    driver.save_screenshot(str(tmp_path / "dashboard-incident.png"))
                    heat = driver.find_element(By.ID, "heatmap").text
                    assert "left to decide" in driver.find_element(
                        By.CSS_SELECTOR, f"tr[data-plan='{plan_id}']").text
                    button = driver.find_element(
                        By.CSS_SELECTOR, f"tr[data-plan='{plan_id}'] button[data-action='approve']")
                    button.click()
                    WebDriverWait(driver, 30).until(lambda d: d.find_element(
                        By.CSS_SELECTOR, f"tr[data-plan='{plan_id}'] .plan-status").text
                        == "approved")
                    driver.execute_script("window.scrollTo(0, 0)")
                    driver.save_screenshot(str(tmp_path / "dashboard-approved.png"))
                    return heat, driver.find_element(By.ID, "flash").text

                heat, flash = await asyncio.to_thread(open_incident_and_approve)
                assert "lateness" in heat and flash == "Plan S2 approved."
            finally:
                await asyncio.to_thread(driver.quit)
        async with ctx.db()() as session:
            stored = await repo.get_plan(session, plan_id)
            assert stored is not None and stored.status == "approved"
            assert [(a.decision, a.approver) for a in stored.approvals] == [("approve", "alice")]
        if os.environ.get("GREYHOUND_DOCS_SCREENSHOTS") == "1":
            for name in ("dashboard-overview.png", "dashboard-incident.png"):
                shutil.copy(tmp_path / name, DOCS / name)
    finally:
        stop.set()
        if slow is not None:
            await slow
        await agent.close()
        await ctx.close()
