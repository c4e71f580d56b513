"""LoRA adapters at the frontend: listed in ``/v1/models`` with their parent, named by a
request's ``model`` (its ``GenerateRequest`` carries the adapter), loaded and unloaded at
runtime only under ``SHARDSERVE_ALLOW_RUNTIME_LORA_UPDATING=1``, a bad one refused with a 400
naming the field while the server goes on; per-adapter counts in ``/metrics``."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_shards.config.lora import LoraOptions
from model_shards.config.model import ModelConfig
from server.api.lora import RUNTIME_ENV, LoraRegistry
from tests.raw_adapters import write_raw_adapter
from tests.server.conftest import ServeFactory, write_tiny_model_config
from tests.server.error_body import assert_error

pytestmark = pytest.mark.timeout(60)


def _registry(tmp_path: Path) -> LoraRegistry:
    write_tiny_model_config(tmp_path, vocab_size=400)
    a1 = write_raw_adapter(tmp_path / "a1")
    options = LoraOptions(modules=(("a1", str(a1)),), max_lora_rank=8)
    return LoraRegistry(ModelConfig.from_dir(tmp_path), "tiny", options)


def _completion(model: str) -> dict[str, object]:
    return {"model": model, "prompt": "one two", "max_tokens": 2}


async def test_adapters_are_listed_and_named_by_model(serve: ServeFactory, tmp_path: Path) -> None:
    served = await serve(app_options={"loras": _registry(tmp_path)})
    cards = (await served.http.get("/v1/models")).json()["data"]
    assert [(c["id"], c["parent"]) for c in cards] == [("tiny", None), ("a1", "tiny")]
    ok = await served.http.post("/v1/completions", json=_completion("a1"))
    assert ok.status_code == 200, ok.text
    assert ok.json()["model"] == "a1"  # the response names the adapter, as vLLM's does
    lora = served.engine.requests[ok.json()["id"]].lora
    assert lora is not None and (lora.name, lora.path) == ("a1", str(tmp_path / "a1"))
    base = await served.http.post("/v1/completions", json=_completion("tiny"))
    assert served.engine.requests[base.json()["id"]].lora is None
    missing = await served.http.post("/v1/completions", json=_completion("a2"))
    assert assert_error(missing, 404, "model")["code"] == "model_not_found"
    metrics = (await served.http.get("/metrics")).text
    assert 'shardserve_lora_requests_total{lora_name="a1"} 1.0' in metrics
    assert 'shardserve_lora_tokens_total{kind="generation",lora_name="a1"} 2.0' in metrics
    off = await served.http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"})
    assert off.status_code == 404  # no runtime updates without the variable


async def test_runtime_load_and_unload(
    serve: ServeFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RUNTIME_ENV, "1")
    served = await serve(app_options={"loras": _registry(tmp_path)})
    http = served.http
    load, unload = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
    rank16 = str(write_raw_adapter(tmp_path / "r", r=16))  # above the max rank of 8
    bad = [
        ({"lora_name": "a2", "lora_path": str(tmp_path / "none")}, "lora_path"),
        ({"lora_name": "a2", "lora_path": rank16}, "lora_path"),
        ({"lora_name": "a1", "lora_path": str(tmp_path / "a1")}, "lora_name"),
        ({"lora_name": "tiny", "lora_path": str(tmp_path / "a1")}, "lora_name"),
        ({"lora_name": "a2"}, "lora_path"),
    ]
    for body, param in bad:
        assert_error(await http.post(load, json=body), 400, param)
    good = write_raw_adapter(tmp_path / "a2", ("q_proj", "k_proj", "down_proj"), r=8)
    assert (await http.post(load, json={"lora_name": "a2", "lora_path": str(good)})).is_success
    ids = [(await http.get("/v1/models")).json()["data"][i]["id"] for i in range(3)]
    assert ids == ["tiny", "a1", "a2"]
    ran = await http.post("/v1/completions", json=_completion("a2"))
    assert ran.status_code == 200, ran.text
    first = served.engine.requests[ran.json()["id"]].lora
    assert (await http.post(unload, json={"lora_name": "a2"})).is_success
    assert_error(await http.post("/v1/completions", json=_completion("a2")), 404, "model")
    assert_error(await http.post(unload, json={"lora_name": "a2"}), 404, "lora_name")
    assert (await http.post(load, json={"lora_name": "a2", "lora_path": str(good)})).is_success
    again = await http.post("/v1/completions", json=_completion("a2"))
    second = served.engine.requests[again.json()["id"]].lora
    assert first is not None and second is not None and first.lora_id != second.lora_id
