"""OpenAI's batch file format: input lines, the requests they make, output records.

An input line is ``{"custom_id": str, "method": "POST", "url": URL, "body": {...}}`` with URL
one of :data:`URLS`; ``body`` is that route's request (``stream`` refused: a batch answers
whole). :func:`parse_line` reads one line into a :class:`Job` (or the reason it cannot run);
:func:`run_job` sends a job to the app and returns its output record, as OpenAI's and vLLM's:
``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}``
when the route answered (a 4xx's body is its OpenAI-style error), else ``{"id",
"custom_id", "response": null, "error": {"code", "message"}}`` (a line that is not a request).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

Url = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
URLS: tuple[str, ...] = get_args(Url)


class BatchLine(BaseModel):
    """One request of a batch file (other keys are ignored)."""

    model_config = ConfigDict(extra="ignore")

    custom_id: Annotated[str, Field(min_length=1)]
    method: Literal["POST"]
    url: Url
    body: dict[str, Any]


@dataclass(frozen=True)
class Job:
    """Line ``number`` (1-based) of the input: its request, or why it is none."""

    number: int
    custom_id: str | None
    line: BatchLine | None = None
    problem: str | None = None


def _custom_id(value: Any) -> str | None:
    if isinstance(value, dict) and isinstance(value.get("custom_id"), str):
        return str(value["custom_id"])
    return None


def _problem(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "line"
    return f"'{where}': {first['msg']}"


def parse_line(number: int, text: str) -> Job:
    """Line ``number`` of the input file as a job; a bad line is a job with a ``problem``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return Job(number, None, problem=f"line {number} is not JSON: {exc.msg}")
    custom_id = _custom_id(value)
    try:
        line = BatchLine.model_validate(value)
    except ValidationError as exc:
        return Job(number, custom_id, problem=f"line {number}: {_problem(exc)}")
    if line.body.get("stream"):
        problem = f"line {number}: 'body.stream' is not supported in a batch (answers are whole)"
        return Job(number, custom_id, problem=problem)
    return Job(number, custom_id, line)


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"


def error_record(job: Job, code: str, message: str) -> dict[str, Any]:
    """The output record of a line that could not be sent."""
    error = {"code": code, "message": message}
    return {"id": _record_id(), "custom_id": job.custom_id, "response": None, "error": error}


async def run_job(http: httpx.AsyncClient, job: Job) -> dict[str, Any]:
    """Send ``job`` to the app behind ``http`` and return its output record."""
    if job.line is None:
        return error_record(job, "invalid_request", job.problem or "not a batch request")
    request_id = f"batch-{uuid.uuid4().hex}"
    try:
        reply = await http.post(
            job.line.url, json=job.line.body, headers={"X-Request-Id": request_id}
        )
        body = reply.json()
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        return error_record(job, "server_error", f"line {job.number}: {exc!r}")
    response = {
        "status_code": reply.status_code,
        "request_id": reply.headers.get("x-request-id", request_id),
        "body": body,
    }
    return {"id": _record_id(), "custom_id": job.custom_id, "response": response, "error": None}


def done_custom_ids(lines: list[str]) -> set[str]:
    """The ``custom_id`` of every record among an output file's ``lines`` that needs no rerun:
    not one cut short by a crash, nor a server error (a 5xx, the engine gone)."""
    out = set()
    for text in lines:
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            continue
        custom_id = _custom_id(record)
        response, error = record.get("response"), record.get("error")
        failed = (isinstance(response, dict) and response.get("status_code", 0) >= 500) or (
            isinstance(error, dict) and error.get("code") == "server_error"
        )
        if custom_id is not None and not failed:
            out.add(custom_id)
    return out
