"""`dmd2 serve` publishes the distill flow as a deployment users start with `prefect deployment run`."""

import asyncio

from prefect.client.orchestration import get_client

from flows.recipe import RECIPES
from flows.commands import build_deployment


def test_the_deployment_carries_the_recipe_run_id_and_schedule(prefect_server):
    deployment_id = build_deployment("nightly", RECIPES / "digits-4step.toml", None, "0 3 * * *").apply()

    async def read():
        async with get_client() as client:
            return await client.read_deployment_by_name("distill/nightly")

    deployment = asyncio.run(read())
    assert deployment.id == deployment_id
    assert deployment.parameters == {"recipe": str((RECIPES / "digits-4step.toml").resolve()),
                                     "run_id": "digits-4step"}
    assert [schedule.schedule.cron for schedule in deployment.schedules] == ["0 3 * * *"]
    assert "rollouts" in deployment.parameter_openapi_schema["properties"]  # --param rollouts=N works
    # One flow run at a time: a run started while one is running waits for it.
    assert deployment.global_concurrency_limit.limit == 1
    assert deployment.concurrency_options.collision_strategy == "ENQUEUE"
