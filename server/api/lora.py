"""The LoRA adapters a frontend serves by name (``--enable-lora``), and vLLM's runtime routes.

A request whose ``model`` names an adapter runs the base model with it: its
:class:`~model_shards.messages.LoraRef` travels in each ``GenerateRequest``, and rank 0 puts it
in a slot (``model_shards/engine/scheduler/lora_slots.py``). Every adapter is checked here,
torch-free (:mod:`model_shards.config.lora`), before any rank reads it.

``POST /v1/load_lora_adapter`` (``{"lora_name", "lora_path"}``) and ``POST
/v1/unload_lora_adapter`` (``{"lora_name"}``) exist only with
``SHARDSERVE_ALLOW_RUNTIME_LORA_UPDATING=1`` (vLLM's variable, ours prefixed); elsewhere they
are 404 as an unknown route. A bad adapter is a 400 naming the field; the server goes on.
"""

from __future__ import annotations

import os
import threading

from pydantic import BaseModel, ConfigDict

from model_shards.config.lora import LoraOptions, read_adapter
from model_shards.config.model import ModelConfig
from model_shards.messages import LoraRef
from server.http.errors import APIError

RUNTIME_ENV = "SHARDSERVE_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_ENV, "").lower() in ("1", "true")


class LoadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoraRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str


class LoraRegistry:
    """Adapter name → :class:`LoraRef`: the ``--lora-modules`` (checked at start-up), then
    runtime loads. Each load gets a new ``lora_id``, so a name loaded again never meets the
    old adapter's cached K/V or weights on the ranks."""

    def __init__(self, model: ModelConfig, base_name: str, options: LoraOptions) -> None:
        self.model, self.base_name, self.max_rank = model, base_name, options.max_lora_rank
        self._refs: dict[str, LoraRef] = {}
        self._next_id = 1
        self._lock = threading.Lock()  # requests are prepared in threads
        for name, path in options.modules:
            self._add(name, path)

    def get(self, name: str) -> LoraRef | None:
        return self._refs.get(name)

    def refs(self) -> list[LoraRef]:
        """The adapters served now, in the order they were added."""
        return list(self._refs.values())

    def _add(self, name: str, path: str) -> LoraRef:
        with self._lock:
            ref = LoraRef(self._next_id, name, path)
            self._next_id += 1
            self._refs[name] = ref
            return ref

    def load(self, body: LoadLoraRequest) -> LoraRef:
        """Check and add an adapter; a 400 naming the field if it cannot be served."""
        name = body.lora_name
        if not name or name == self.base_name or name in self._refs:
            raise APIError.bad_request(
                f"'lora_name' {name!r}: an adapter of that name is loaded already, or it is "
                "empty or the base model's name",
                param="lora_name",
            )
        try:
            read_adapter(name, body.lora_path, self.model, self.max_rank, flag="lora_path")
        except ValueError as exc:
            raise APIError.bad_request(str(exc), param="lora_path") from exc
        return self._add(name, body.lora_path)

    def unload(self, body: UnloadLoraRequest) -> None:
        """Forget an adapter (its slot on the ranks is reused when needed); 404 if unknown."""
        with self._lock:
            if self._refs.pop(body.lora_name, None) is None:
                raise APIError(
                    404,
                    f"'lora_name' {body.lora_name!r}: no LoRA adapter of that name is loaded",
                    param="lora_name",
                    code="lora_not_found",
                )
