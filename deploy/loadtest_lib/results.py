"""The result file: a versioned JSON document, and its exact loader.

Schema ``shardserve.loadtest``, version 1::

    {
      "schema": "shardserve.loadtest",
      "version": 1,
      "started_at": "2025-01-01T12:00:00+00:00",     # UTC, ISO 8601
      "prompt_source": "server-tokenizer" | "words" | "dataset",
      "config": {                                    # RunConfig; never the API key
        "base_url", "model", "endpoint": "completions" | "chat",
        "points": [{"concurrency": int|null, "request_rate": float|null, "burstiness": float}],
        "input_len", "output_len", "dataset": str|null, "num_requests": int|null,
        "duration_s": float|null, "timeout_s", "seed",
        "slo": {"ttft_ms": float|null, "tpot_ms": float|null, "e2e_ms": float|null},
        "ignore_eos": bool, "extra_body": {...}
      },
      "points": [{                                   # one per load point, in run order
        "load": {"concurrency", "request_rate", "burstiness"},
        "metrics": {                                 # PointMetrics
          "duration_s", "sent", "completed", "errors": {"http_500": 3, "cancelled": 1},
          "input_tokens", "output_tokens",
          "request_throughput", "output_throughput",   # per second
          "goodput": float|null,                       # req/s meeting every SLO
          "ttft_ms" | "tpot_ms" | "itl_ms" | "e2e_ms":
              {"count", "mean", "p50", "p90", "p99"}   # ms; null when count is 0
        },
        "requests": [{                               # RequestRecord, in send order
          "index", "output_len", "prompt_tokens", "start_s", "status", "output_tokens",
          "chunks", "usage_reported", "ttft_ms", "e2e_ms", "itl_ms": [float], "error"
        }]
      }]
    }

A reader must reject another ``schema`` and any ``version`` it does not know; a new
field is a version bump. ``load_result(save_result(r))`` equals ``r``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deploy.loadtest_lib.config import SLO, LoadPoint, RunConfig
from deploy.loadtest_lib.metrics import PointMetrics
from deploy.loadtest_lib.records import RequestRecord

SCHEMA = "shardserve.loadtest"
VERSION = 1


@dataclass(frozen=True)
class PointResult:
    """One load point: its load, its summary, and every request sent."""

    load: LoadPoint
    metrics: PointMetrics
    requests: tuple[RequestRecord, ...]


@dataclass(frozen=True)
class RunResult:
    """A whole run, as written by ``--out`` and read by ``--compare``."""

    config: RunConfig
    started_at: str
    prompt_source: str
    points: tuple[PointResult, ...]


def _config_to_json(config: RunConfig) -> dict[str, Any]:
    data = asdict(config)
    data["points"] = [asdict(p) for p in config.points]
    return data


def _config_from_json(data: dict[str, Any]) -> RunConfig:
    fields = dict(data)
    fields["points"] = tuple(LoadPoint(**p) for p in data["points"])
    fields["slo"] = SLO(**data["slo"])
    return RunConfig(**fields)


def result_to_json(result: RunResult) -> dict[str, Any]:
    """The JSON document of ``result`` (see the module docstring)."""
    return {
        "schema": SCHEMA,
        "version": VERSION,
        "started_at": result.started_at,
        "prompt_source": result.prompt_source,
        "config": _config_to_json(result.config),
        "points": [
            {
                "load": asdict(point.load),
                "metrics": point.metrics.to_json(),
                "requests": [r.to_json() for r in point.requests],
            }
            for point in result.points
        ],
    }


def result_from_json(data: dict[str, Any]) -> RunResult:
    """Rebuild a :class:`RunResult`; ``ValueError`` for another schema or version."""
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ValueError(f"not a {SCHEMA} result file")
    if data.get("version") != VERSION:
        raise ValueError(
            f"{SCHEMA} version {data.get('version')} is not supported (want {VERSION})"
        )
    return RunResult(
        config=_config_from_json(data["config"]),
        started_at=data["started_at"],
        prompt_source=data["prompt_source"],
        points=tuple(
            PointResult(
                load=LoadPoint(**p["load"]),
                metrics=PointMetrics.from_json(p["metrics"]),
                requests=tuple(RequestRecord.from_json(r) for r in p["requests"]),
            )
            for p in data["points"]
        ),
    )


def save_result(result: RunResult, path: str | Path) -> None:
    """Write ``result`` as indented JSON (strict: no NaN or Infinity)."""
    text = json.dumps(result_to_json(result), indent=1, allow_nan=False)
    Path(path).write_text(text + "\n", encoding="utf-8")


def load_result(path: str | Path) -> RunResult:
    """Read a file written by :func:`save_result`; the result equals the one saved."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    try:
        return result_from_json(data)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: malformed {SCHEMA} file ({exc!r})") from None
