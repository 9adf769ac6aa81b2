"""A model's JSON written from its fields' values, the names and order taken from the model when the template is made.

For the two messages of every API request (auth.check's request and reply), where a model and its `model_dump_json`
cost several times more than joining bytes. `ModelTemplate(Model).bind(**fixed)` renders the fields known in advance
once (a route's class and name; a credential's identity); calling the bound template renders the rest. What it writes
reads back as the model with `model_validate_json` (tests/unit/test_api_check_json.py).
"""

from __future__ import annotations

import keyword
import types
import typing
from collections.abc import Callable
from json.encoder import encode_basestring_ascii
from typing import Any, Literal

from pydantic import BaseModel, TypeAdapter


class RawJson(bytes):
    """A field's value already written as JSON (made once and kept, e.g. an identity's), inserted as it is (fields
    that are not text, booleans or integers)."""


Render = Callable[[Any], bytes]


def _text(value: str | None) -> bytes:
    return b"null" if value is None else encode_basestring_ascii(value).encode()


def _bool(value: bool | None) -> bytes:
    return b"null" if value is None else b"true" if value else b"false"


def _int(value: int | None) -> bytes:
    return b"null" if value is None else str(int(value)).encode()


def _members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(annotation) if a is not type(None))
    return (annotation,)


def _is_text(annotation: Any) -> bool:
    if annotation is str:
        return True
    return typing.get_origin(annotation) is Literal and all(isinstance(a, str) for a in typing.get_args(annotation))


def renderer(annotation: Any) -> Render:
    """How a field of this type is written: text, booleans and integers directly, anything else by pydantic."""
    members = _members(annotation)
    if all(_is_text(a) for a in members):
        return _text
    if members == (bool,):
        return _bool
    if members == (int,):
        return _int
    dump = TypeAdapter(annotation).dump_json

    def render(value: Any) -> bytes:
        if isinstance(value, RawJson):
            return value
        return b"null" if value is None else dump(value)

    return render


Encoder = Callable[..., bytes]  # the fields not bound, by keyword


def _maker(model: str, shape: tuple[bool, ...], names: tuple[str, ...]) -> Callable[..., Encoder]:
    """The code of a template that binds the fields marked True in `shape`: a function of the others, joining the
    literals and each field's rendering (generated once per model and shape, as dataclasses generate `__init__`)."""
    free = [name for name, bound in zip(names, shape, strict=True) if not bound]
    pieces = []
    for i, name in enumerate(free):
        pieces += [f"L{i}", f"R{i}({name})"]
    params = ", ".join([f"L{i}" for i in range(len(free) + 1)] + [f"R{i}" for i in range(len(free))])
    keywords = f"*, {', '.join(free)}" if free else ""
    source = (f"def make({params}):\n"
              f"    def encode({keywords}):\n"
              f"        return b''.join(({', '.join([*pieces, f'L{len(free)}'])},))\n"
              f"    return encode\n")
    scope: dict[str, Any] = {}
    exec(compile(source, f"<{model} template>", "exec"), scope)  # our own source, made of the model's field names
    made: Callable[..., Encoder] = scope["make"]
    return made


class ModelTemplate:
    """`model`'s fields, in its order, each with its renderer: made once per model, at import."""

    def __init__(self, model: type[BaseModel]) -> None:
        self.model = model
        self.fields = tuple((name, renderer(info.annotation)) for name, info in model.model_fields.items())
        for name, _ in self.fields:
            if not name.isidentifier() or keyword.iskeyword(name):
                raise TypeError(f"{model.__name__}.{name} is not a name a template can take")
        self._makers: dict[tuple[bool, ...], Callable[..., Encoder]] = {}
        self.encode = self.bind()

    def bind(self, **fixed: Any) -> Encoder:
        """A function of the other fields (by keyword) writing the whole model's JSON, `fixed` rendered already."""
        unknown = fixed.keys() - {name for name, _ in self.fields}
        if unknown:
            raise TypeError(f"{self.model.__name__} has no field {sorted(unknown)}")
        shape = tuple(name in fixed for name, _ in self.fields)
        make = self._makers.get(shape)
        if make is None:
            make = self._makers[shape] = _maker(self.model.__name__, shape, tuple(n for n, _ in self.fields))
        literals: list[bytes] = []
        renders: list[Render] = []
        literal = b""
        for i, (name, render) in enumerate(self.fields):
            literal += (b"{" if i == 0 else b",") + encode_basestring_ascii(name).encode() + b":"
            if name in fixed:
                literal += render(fixed[name])
            else:
                literals.append(literal)
                renders.append(render)
                literal = b""
        literals.append(literal + b"}")
        return make(*literals, *renders)
