"""Request bodies in ``/openapi.json`` for routes that parse their raw body themselves.

The generating routes read the body with pydantic directly (so every error is
our 400, never FastAPI's 422), which hides the body from FastAPI's schema.
:class:`BodySchemas` gives each such route an ``openapi_extra`` declaring its
JSON body (the pydantic model's schema) and adds the models it refers to
under ``components.schemas``, so clients and fuzzers (schemathesis) see them.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel

_REF = "#/components/schemas/{model}"


class BodySchemas:
    """Collects request-body schemas; :meth:`install` merges them into the app's schema."""

    def __init__(self) -> None:
        self._components: dict[str, Any] = {}

    def body(self, model: type[BaseModel]) -> dict[str, Any]:
        """The ``openapi_extra`` of a route whose JSON body is ``model``."""
        schema = model.model_json_schema(ref_template=_REF)
        self._components.update(schema.pop("$defs", {}))
        self._components[model.__name__] = schema
        ref = {"$ref": _REF.format(model=model.__name__)}
        return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}

    def install(self, app: FastAPI) -> None:
        """Make ``app.openapi()`` include every collected schema."""
        plain = app.openapi

        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                schema = plain()
                schema.setdefault("components", {}).setdefault("schemas", {})
                for name, definition in self._components.items():
                    schema["components"]["schemas"].setdefault(name, definition)
                app.openapi_schema = schema
            return app.openapi_schema

        app.openapi = openapi  # type: ignore[method-assign]
