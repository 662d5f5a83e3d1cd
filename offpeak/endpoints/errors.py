"""A request line's own failure (``LineError``), and pydantic's validation errors worded as
OpenAI's real-time endpoints word them.

Body models raise two kinds of errors. Checks written by hand inside a model (a validator for a
field whose rules pydantic cannot say, such as ``stop`` or a chat message's content) raise
``fail(code, message)``, which carries OpenAI's code and message as they are. Pydantic's own
errors (a wrong type, a value outside a ``Field``'s ``ge``/``le``) are mapped here by error type,
using the field's declared bounds, to the messages this server has always returned.
"""

from __future__ import annotations

import typing
from collections.abc import Sequence
from typing import Any

from annotated_types import Ge, Le
from pydantic import BaseModel
from pydantic_core import ErrorDetails, PydanticCustomError

from offpeak import wire


class LineError(Exception):
    """A request line that fails alone: a ``status_code`` line in the error file.

    A 4xx is the line's own fault (``invalid_request_error``, OpenAI's type for a request the
    endpoint rejects); a 5xx is the server's (``server_error``, the type OpenAI's API gives its
    own failures), so a client can tell which lines are worth sending again.
    """

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status_code: int = 400,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status_code = message, param, code, status_code

    @property
    def type(self) -> str:
        """``server_error`` for a 5xx, else ``invalid_request_error``."""
        return "server_error" if self.status_code >= 500 else "invalid_request_error"

    def body(self) -> dict[str, Any]:
        """OpenAI's error body, ``{"error": {message, type, param, code}}``."""
        return wire.error_object(self.message, self.type, self.param, self.code)


#: Marks a ``fail`` error in pydantic's error context.
_OURS = "offpeak_line_error"


def fail(code: str, message: str, param: str | None = None) -> PydanticCustomError:
    """An error for a validator to raise: the line fails with ``code`` and ``message``.

    ``param`` defaults to the error's location (``messages[0].content``); ``{param}`` in
    ``message`` is replaced by it, for validators of nested fields that do not know where
    they are."""
    # The message goes in the context, not the template: pydantic would read the braces of
    # "{'type': 'text'}" as a placeholder.
    return PydanticCustomError(code, "{message}", {_OURS: True, "message": message, "param": param})


def location(loc: Sequence[int | str]) -> str:
    """``("messages", 0, "role")`` → ``messages[0].role``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def line_error(error: ErrorDetails, model: type[BaseModel]) -> LineError:
    """The ``LineError`` of pydantic's ``error`` on a body of ``model``."""
    loc = error["loc"]
    param = location(loc) or None
    ctx = error.get("ctx") or {}
    if ctx.get(_OURS):
        where = ctx.get("param") or param
        return LineError(
            str(ctx["message"]).replace("{param}", where or "body"), where, error["type"]
        )
    name = str(loc[0]) if loc else "body"
    kind = error["type"]
    expected = _EXPECTED.get(kind)
    if expected is not None:
        return LineError(f"Invalid type for '{name}': expected {expected}.", name, "invalid_type")
    if kind in _RANGE and len(loc) == 1 and name in model.model_fields:
        return _out_of_range(name, error["input"], model)
    if kind == "missing":
        return LineError(f"'{param}' is required.", param, "missing_required_parameter")
    return LineError(f"Invalid '{param}': {error['msg']}.", param, "invalid_value")


_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "finite_number": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
}
_RANGE = ("greater_than_equal", "less_than_equal", "greater_than", "less_than")


def _out_of_range(name: str, value: Any, model: type[BaseModel]) -> LineError:
    field = model.model_fields[name]
    low = next((m.ge for m in field.metadata if isinstance(m, Ge)), None)
    high = next((m.le for m in field.metadata if isinstance(m, Le)), None)
    number = float in typing.get_args(field.annotation) or field.annotation is float
    if number and low is not None and high is not None:
        message = f"Invalid '{name}': {value} is not between {low:g} and {high:g}."
    else:
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        message = f"Invalid '{name}': {value} must be {bound}."
    return LineError(message, name, "invalid_value")
