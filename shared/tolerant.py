"""Reading a closed set tolerantly (SPEC 11): a value a newer release adds is read as a fallback, and the fallback is
marked in the JSON schema (`x-weir-fallback`) so that the contract check (shared/compat.py) knows the reader takes
new values. Imports nothing of Weir's (shared/videos.py and the event catalog use it); shared/messaging.py
re-exports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from pydantic import GetJsonSchemaHandler, ValidationError, ValidatorFunctionWrapHandler, WrapValidator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

FALLBACK_KEYWORD = "x-weir-fallback"  # in a JSON schema: this closed set reads an unknown value as the one given


@dataclass(frozen=True, slots=True)
class Fallback:
    """Marks a tolerant closed set in its JSON schema (`x-weir-fallback: <value>`), for the contract check
    (shared/compat.py): a value a newer release adds is read as `value`, so adding one breaks no reader. For a closed
    set read with a validator of its own (`Annotated[E, BeforeValidator(...), Fallback(E.X)]`)."""

    value: Any

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        marked = handler(schema)
        marked[FALLBACK_KEYWORD] = self.value.value if isinstance(self.value, Enum) else self.value
        return marked


@dataclass(frozen=True, slots=True)
class UnknownAs(WrapValidator):
    """`unknown_as`'s validator, which also marks the set's fallback in the JSON schema (as `Fallback` does)."""

    fallback: Any = None

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return Fallback(self.fallback).__get_pydantic_json_schema__(schema, handler)


def unknown_as(fallback: Any) -> WrapValidator:
    """For a closed set read from another process (`Annotated[Literal[...], unknown_as(x)]`): a string value outside
    the set, one a newer release added, is read as `fallback` (a member) instead of refusing the whole message."""

    def read(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            if isinstance(value, str):
                return handler(fallback)
            raise

    return UnknownAs(read, fallback=fallback)
