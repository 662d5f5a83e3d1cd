"""Structured output, as OpenAI's two text APIs ask for it: chat's ``response_format`` and the
Responses API's ``text.format``, each parsed into the engine-neutral ``StructuredOutput``.

Shapes follow OpenAI's API reference ("Structured Outputs"):

- ``{"type": "text"}`` (or nothing): free text, no constraint.
- ``{"type": "json_object"}``: JSON mode, any JSON object.
- chat: ``{"type": "json_schema", "json_schema": {name, schema, strict, description}}``;
  responses: ``{"type": "json_schema", name, schema, strict, description}`` (the same fields one
  level up). ``name`` is 1-64 characters of ``a-zA-Z0-9_-``; ``schema`` a JSON Schema object.
  A chat ``json_schema`` without ``schema`` is any JSON object, as in OpenAI's reference.

The schema is checked here against its meta-schema (``jsonschema``; Draft 2020-12 unless it
names another in ``$schema``), so a malformed one fails its line with ``invalid_json_schema``
before it reaches an engine; what passes that check but a grammar backend cannot compile (an
unresolvable ``$ref``, say) is refused by the engine when the line is added, which fails that
line alone too. ``strict`` is accepted either way: decoding is always constrained to the schema.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from jsonschema import Draft202012Validator, SchemaError
from jsonschema.validators import validator_for

from offpeak.endpoints.base import StructuredOutput
from offpeak.endpoints.errors import fail

#: OpenAI's rule for a format's ``name``.
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
TYPES = ("text", "json_object", "json_schema")


def chat_format(value: Any) -> StructuredOutput | None:
    """Chat's ``response_format`` as a ``StructuredOutput`` (``None`` for text). Raises a
    ``fail`` error naming the offending field under ``response_format``."""
    kind = _kind(value, "response_format")
    if kind != "json_schema":
        return None if kind == "text" else StructuredOutput(param="response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise fail(
            "missing_required_parameter" if spec is None else "invalid_type",
            "'response_format.json_schema' must be an object with 'name' and 'schema'.",
            "response_format.json_schema",
        )
    return _schema_format(spec, "response_format.json_schema", schema_required=False)


def responses_format(value: Any) -> StructuredOutput | None:
    """The Responses API's ``text.format`` as a ``StructuredOutput`` (``None`` for text)."""
    kind = _kind(value, "text.format")
    if kind != "json_schema":
        return None if kind == "text" else StructuredOutput(param="text.format")
    return _schema_format(value, "text.format", schema_required=True)


def check_schema(schema: Any, param: str, name: str = "", label: str | None = None) -> None:
    """Refuse a ``schema`` that is not a valid JSON Schema (its meta-schema, formats included:
    a ``pattern`` that is not a regular expression fails). Raises a ``fail`` error with code
    ``invalid_json_schema`` at ``param``; ``label`` starts its message (a format's by
    default)."""
    # OpenAI's wording, which it uses for both APIs' formats.
    if label is None:
        label = f"Invalid schema for response_format {name!r}" if name else "Invalid schema"
    if not isinstance(schema, dict):
        raise fail("invalid_json_schema", f"{label}: a schema must be a JSON object.", param)
    try:
        validator = validator_for(schema, default=Draft202012Validator)
        validator.check_schema(schema, format_checker=validator.FORMAT_CHECKER)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(root)"
        raise fail("invalid_json_schema", f"{label}: at {where}: {exc.message}.", param) from None


def _kind(value: Any, param: str) -> str:
    if value is None:
        return "text"
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in TYPES:
        raise fail(
            "invalid_value",
            f"Invalid '{param}': 'type' must be one of {', '.join(TYPES)}.",
            f"{param}.type",
        )
    return str(kind)


def _schema_format(spec: dict[str, Any], param: str, *, schema_required: bool) -> StructuredOutput:
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise fail(
            "missing_required_parameter" if name is None else "invalid_value",
            f"'{param}.name' must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'.",
            f"{param}.name",
        )
    if not isinstance(spec.get("strict", False), bool | None):
        raise fail(
            "invalid_type",
            f"Invalid type for '{param}.strict': expected a boolean.",
            f"{param}.strict",
        )
    schema = spec.get("schema")
    if schema is None and not schema_required:
        return StructuredOutput(param=param)
    if schema is None:
        raise fail(
            "missing_required_parameter", f"'{param}.schema' is required.", f"{param}.schema"
        )
    check_schema(schema, f"{param}.schema", name)
    # JSON text: the spec stays hashable and any engine (in-process or a server) takes it.
    return StructuredOutput(json_schema=orjson.dumps(schema).decode(), param=f"{param}.schema")
