"""vLLM's runtime LoRA routes (:mod:`server.api.lora`), added only when
``SHARDSERVE_ALLOW_RUNTIME_LORA_UPDATING=1``: ``POST /v1/load_lora_adapter`` and
``POST /v1/unload_lora_adapter``, each answering 200 with a line of text as vLLM does."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse

from server.api.lora import (
    LoadLoraRequest,
    LoraRegistry,
    UnloadLoraRequest,
    runtime_updates_allowed,
)
from server.http.respond import parse_body

LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")


def add_lora_routes(app: FastAPI, registry: LoraRegistry | None) -> None:
    """The routes, if there are adapters (``--enable-lora``) and runtime updates are allowed."""
    if registry is None or not runtime_updates_allowed():
        return

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await parse_body(request, LoadLoraRequest)
        registry.load(body)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await parse_body(request, UnloadLoraRequest)
        registry.unload(body)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
