"""Structured outputs in the frontend: request fields → one checked :class:`GrammarSpec`.

Accepted, on both generating routes (only one of them per request):

* ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``;
* vLLM's ``structured_outputs: {json | regex | choice | grammar}`` and the older
  ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.

A choice becomes the EBNF alternation of its strings; a grammar is xgrammar's EBNF
(GBNF style, ``root ::= ...``). Each spec is checked here with ``xgrammar`` (schema
→ grammar conversion, regex parse, EBNF parse; no vocabulary needed), once per
distinct spec (an LRU cache), so an invalid one is a 400 naming the field before
anything is queued. Schemas travel as canonical JSON (sorted keys, compact), which
is also the key rank 0 caches the compiled grammar under
(:mod:`model_shards.engine.structured.grammars`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from model_shards.messages import GrammarKind, GrammarSpec
from server.http.errors import APIError

_XGRAMMAR_CONTEXT = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def choice_grammar(choices: list[str]) -> str:
    """The EBNF grammar matching exactly one of ``choices``."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@functools.lru_cache(maxsize=512)
def grammar_problem(kind: GrammarKind, spec: str) -> str | None:
    """Why xgrammar cannot build ``spec`` (the message, without its C++ context), or ``None``."""
    import xgrammar

    try:
        if kind == "json_schema":
            xgrammar.Grammar.from_json_schema(spec, any_whitespace=False)
        elif kind == "regex":
            xgrammar.Grammar.from_regex(spec)
        elif kind == "ebnf":
            xgrammar.Grammar.from_ebnf(spec)
    except Exception as exc:  # RuntimeError (and friends) from the C++ side
        return _XGRAMMAR_CONTEXT.sub("", str(exc).strip().splitlines()[0] if str(exc) else "")
    return None


def checked(kind: GrammarKind, spec: str, param: str) -> GrammarSpec:
    """``GrammarSpec(kind, spec)``; a 400 naming ``param`` if xgrammar refuses it."""
    problem = grammar_problem(kind, spec)
    if problem is not None:
        raise APIError.bad_request(f"'{param}' is not a valid {kind}: {problem}", param=param)
    return GrammarSpec(kind, spec)


def _schema(value: Any, param: str) -> GrammarSpec:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise APIError.bad_request(f"'{param}' is not valid JSON: {exc}", param=param) from exc
    if not isinstance(value, dict | bool):
        raise APIError.bad_request(f"'{param}' must be a JSON schema object", param=param)
    return checked("json_schema", canonical_json(value), param)


def _choice(value: Any, param: str) -> GrammarSpec:
    if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
        raise APIError.bad_request(f"'{param}' must be a non-empty list of strings", param=param)
    return checked("ebnf", choice_grammar(value), param)


def _text(value: Any, kind: GrammarKind, param: str) -> GrammarSpec:
    if not isinstance(value, str) or not value:
        raise APIError.bad_request(f"'{param}' must be a non-empty string", param=param)
    return checked(kind, value, param)


def from_response_format(value: dict[str, Any]) -> GrammarSpec | None:
    """``response_format``'s grammar (``None`` for text); 400 naming the bad field."""
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise APIError.bad_request(
            f"'response_format.type' must be text, json_object or json_schema, not {kind!r}",
            param="response_format.type",
        )
    inner = value.get("json_schema")
    if not isinstance(inner, dict) or "schema" not in inner:
        raise APIError.bad_request(
            "'response_format.json_schema' must be an object with a 'schema'",
            param="response_format.json_schema",
        )
    return _schema(inner["schema"], "response_format.json_schema.schema")


def from_structured_outputs(value: dict[str, Any], prefix: str) -> GrammarSpec | None:
    """vLLM's ``structured_outputs`` object (or the ``guided_*`` fields, ``prefix`` ``guided_``)."""
    sep = "." if prefix.endswith("outputs") else ""
    given = [k for k in ("json", "regex", "choice", "grammar") if value.get(k) is not None]
    if not given:
        return None
    if len(given) > 1:
        names = ", ".join(f"'{prefix}{sep}{k}'" for k in given)
        raise APIError.bad_request(f"only one of {names} may be given", param=prefix)
    key = given[0]
    param = f"{prefix}{sep}{key}"
    if key == "json":
        return _schema(value[key], param)
    if key == "choice":
        return _choice(value[key], param)
    return _text(value[key], "regex" if key == "regex" else "ebnf", param)


def grammar_param(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
) -> str | None:
    """The field the one grammar :func:`grammar_of` accepted comes from (what a 400 about
    it, e.g. a compile past the engine's deadline, names), or ``None``."""
    kind = (response_format or {}).get("type")
    if kind == "json_schema":
        return "response_format.json_schema.schema"
    if kind == "json_object":
        return "response_format"
    for value, prefix in ((structured_outputs or {}, "structured_outputs."), (guided, "guided_")):
        key = next(
            (k for k in ("json", "regex", "choice", "grammar") if value.get(k) is not None), None
        )
        if key is not None:
            return prefix + key
    return None


def grammar_of(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
) -> GrammarSpec | None:
    """The one grammar a request asks for, or ``None``; 400 when several are asked for."""
    found: list[tuple[str, GrammarSpec]] = []
    if response_format is not None and (spec := from_response_format(response_format)):
        found.append(("response_format", spec))
    if structured_outputs is not None:
        spec = from_structured_outputs(structured_outputs, "structured_outputs")
        if spec is not None:
            found.append(("structured_outputs", spec))
    spec = from_structured_outputs(guided, "guided_")
    if spec is not None:
        found.append(("guided_*", spec))
    if len(found) > 1:
        names = " and ".join(f"'{name}'" for name, _ in found)
        message = f"{names} both constrain the output; give one"
        raise APIError.bad_request(message, param=found[1][0])
    return found[0][1] if found else None
