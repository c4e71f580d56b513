"""The OpenAI error body a test expects: status, type and the field it names."""

from __future__ import annotations

from typing import Any

import httpx


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    if param is not None:
        assert param in error["message"]
    assert "pydantic" not in error["message"] and "loc" not in error
    return dict(error)
