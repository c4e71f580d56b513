"""vLLM's ``priority`` request field: forwarded to the engine under ``--scheduling-policy
priority``, a 400 naming it otherwise (a server that would ignore it says so), bounded."""

from __future__ import annotations

import pytest

from tests.server.conftest import ServeFactory
from tests.server.error_body import assert_error

pytestmark = pytest.mark.timeout(60)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "one two", "max_tokens": 2}


@pytest.mark.parametrize(
    ("route", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]
)
async def test_priority_reaches_the_engine_only_under_the_priority_policy(
    serve: ServeFactory, route: str, body: dict[str, object]
) -> None:
    fcfs = await serve()
    refused = await fcfs.http.post(route, json={**body, "priority": 3})
    assert_error(refused, 400, "priority")
    assert "--scheduling-policy priority" in refused.json()["error"]["message"]
    plain = await fcfs.http.post(route, json={**body, "priority": 0})
    assert plain.status_code == 200
    served = await serve(app_options={"scheduling_policy": "priority"})
    for priority in (-2, 7):
        response = await served.http.post(route, json={**body, "priority": priority})
        assert response.status_code == 200, response.text
        assert served.engine.requests[response.json()["id"]].priority == priority
    assert_error(await served.http.post(route, json={**body, "priority": 2**31}), 400, "priority")
    assert_error(await served.http.post(route, json={**body, "priority": "1"}), 400, "priority")
