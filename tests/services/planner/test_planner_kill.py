"""Two ``greyhound planner`` processes (issue 21): the standby does nothing while the owner
lives; the owner killed with SIGKILL between two saves of an escalation, the standby takes the
partition over, restores the escalation from the last save, counts again the loss the dead
owner had not saved, and proposes the plan once, at the loss where one planner would have."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path

from greyhound.core.tracked_incident import Tracked
from services.common.db import repository as repo
from services.planner.service import Planner
from services.planner.settings import PlannerSettings
from tests.conftest import Bus, new_bus
from tests.services.common.service_procs import ServiceProcesses, until
from tests.services.planner.conftest import FAST, Rig

STARTED_WITHIN_S = 40.0  # two interpreters starting at once on a loaded 2-core machine
TAKEOVER_WITHIN_S = 10.0
SETTINGS = {"GREYHOUND_PLANNER_POLL_S": "0.05", "GREYHOUND_PLANNER_S2_OVERHEAD_S": "4",
            "GREYHOUND_PLANNER_S3_OVERHEAD_S": "5", "GREYHOUND_PLANNER_S4_OVERHEAD_S": "1000000",
            "GREYHOUND_PLANNER_RECHECK_S": "0", "GREYHOUND_PLANNER_HOLD_MAX_S": "0",
            "GREYHOUND_PLANNER_LEASE_RETRY_S": "0.5",
            "GREYHOUND_PLANNER_TRUST": "1"}  # the break-even: the loss is counted to 4 s


async def _saved_loss(rig: Rig, incident: str) -> float:
    async with rig.ctx.db()() as session:
        rows = await repo.open_escalations(session)
    return next((Tracked.from_state(row.incident_id, row.job_id, row.state).esc.loss_s
                 for row, _ in rows if row.incident_id == incident), 0.0)


def test_a_standby_planner_finishes_the_escalation_of_a_killed_owner_once(
        fresh_db_url: str, tmp_path: Path) -> None:
    async def scenario(bus: Bus) -> None:
        procs = ServiceProcesses("planner", bus, fresh_db_url, tmp_path, SETTINGS)
        async with bus.service("analyzer", fresh_db_url) as ctx:
            # the test writes and announces as the analyzer and validator do (no planner runs here)
            rig = Rig(ctx, Planner(ctx, PlannerSettings(**FAST)), f"pk-{uuid.uuid4().hex[:6]}",
                      bus)
            try:
                owner, standby = await procs.owner_and_standby(STARTED_WITHIN_S)
                await rig.layout(tp=1, dp=4, pp=1, gpus_per_node=4, microbatches=16)
                inc = await rig.incident(kind="compute_slow", before_s=1.0, after_s=2.0, gpus=[1])

                async def escalating() -> bool:
                    return f"incident {inc} (compute_slow): escalation from S1" in procs.log(owner)

                await until("the owner to escalate", 20.0, escalating)
                await rig.iterations(2.0, 2)

                async def saved_two() -> bool:  # the owner's periodic save (every 5 s)
                    return await _saved_loss(rig, inc) >= 2.0

                await until("2 s of loss saved", 15.0, saved_two)
                await rig.iterations(2.0, 1)  # counted by the owner, saved only later if ever
                await asyncio.sleep(0.5)
                saved = await _saved_loss(rig, inc)  # 2.0 unless a periodic save just ran
                os.kill(owner.pid, signal.SIGKILL)
                killed_at = time.monotonic()
                owner.wait(10)

                async def taken() -> bool:
                    return await procs.owner() is standby

                await until("the standby to take the partition", TAKEOVER_WITHIN_S, taken)
                print(f"takeover: standby held the lease {time.monotonic() - killed_at:.2f}s "
                      f"after the kill; {saved:g} s of loss saved then")

                async def restored() -> bool:
                    return f"incident {inc} of job {rig.job}: escalation restored" in \
                        procs.log(standby)

                await until("the standby to restore the escalation", 15.0, restored)
                assert await rig.plans() == []  # 3 s of loss of 4
                await rig.iterations(2.0, 1)  # the 4th second of loss
                await rig.wait(rig.plans, "the S2 plan")
                await asyncio.sleep(1.5)  # a second proposal or delivery would show by now
                (plan,) = await rig.plans()
                assert plan.strategy == "S2" and plan.params.loss_s == 4.0, plan.params
                assert plan.version == 1 and [d.version for d in await rig.deliveries()] == [1]
                stages = await rig.stages(inc)
                assert stages.count("plan_proposed") == 1 and stages.count("plan_approved") == 1
                assert standby.poll() is None
            finally:
                await rig.close()
                await rig.planner.state.watches.close()
                procs.stop()
        assert "planner owns partition 0 of 1" in procs.log(owner)
        assert "escalation from S1" not in procs.log(standby)  # it never escalated on its own

    with new_bus("gh-pl-kill-") as bus:
        asyncio.run(scenario(bus))
