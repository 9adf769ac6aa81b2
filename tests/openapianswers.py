"""Real answers held to the api's OpenAPI document: each JSON answer (a 2xx or a problem body) must validate against the
schema the document gives its route, status and media type. OpenAPI 3.1 schemas are JSON Schema 2020-12; their `$ref`s
are resolved in the document itself.

A drift between what the api serves and what its document says fails here: the integration test of the current api
(tests/integration/test_api.py) and the mixed-version test, whose older api's answers verify the findings
contracts/accepted.toml accepts."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

import httpx
from jsonschema import Draft202012Validator, FormatChecker
from jsonschema.exceptions import best_match
from referencing import Registry
from referencing.jsonschema import DRAFT202012

DOCUMENT_URI = "urn:weir:openapi"
METHODS = ("get", "put", "post", "delete", "patch", "head", "options")
RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
FORMATS = FormatChecker(formats=())


@FORMATS.checks("date-time", raises=ValueError)
def _date_time(value: object) -> bool:
    """RFC 3339 (jsonschema asserts it only with an extra package installed)."""
    if not isinstance(value, str):
        return True
    return bool(RFC3339.match(value)) and datetime.fromisoformat(value.replace("Z", "+00:00")) is not None


@dataclass(frozen=True)
class HttpAnswer:
    """One JSON answer as a client got it."""

    method: str
    path: str  # without the query
    status: int
    media_type: str
    body: Any
    source: str = ""  # who answered: "api 1.0.0"

    @staticmethod
    def of(response: httpx.Response, source: str = "") -> HttpAnswer | None:
        """The answer, or None when its body is not JSON (none, a playlist, a redirect)."""
        media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
        if not media_type.endswith("json") or not response.content:
            return None
        return HttpAnswer(response.request.method, response.request.url.path, response.status_code, media_type,
                          response.json(), source)

    def __str__(self) -> str:
        return f"{self.source + ': ' if self.source else ''}{self.method} {self.path} {self.status} ({self.media_type})"


def _pointer(*parts: str) -> str:
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


class OpenApiAnswers:
    """What an OpenAPI document says of answers; `problems` of each answer that it does not describe as served."""

    def __init__(self, document: Mapping[str, Any]) -> None:
        self.document = document
        self.registry: Registry[Any] = Registry().with_resource(DOCUMENT_URI, DRAFT202012.create_resource(document))
        self.routes: list[tuple[int, re.Pattern[str], str]] = []
        for template in document.get("paths", {}):
            parts = re.split(r"(\{[^/}]+\})", template)
            pattern = "".join("[^/]+" if p.startswith("{") else re.escape(p) for p in parts)
            # a literal segment wins over a parameter: /{id}/index.m3u8 before /{id}/{file}
            self.routes.append((template.count("{"), re.compile(f"^{pattern}$"), template))
        self.routes.sort(key=lambda r: r[0])

    def template(self, method: str, path: str) -> str | None:
        """The document's path template of a request, if it documents that method there."""
        for _, pattern, template in self.routes:
            if pattern.match(path) and method.lower() in self.document["paths"][template]:
                return template
        return None

    def problems(self, answer: HttpAnswer) -> list[str]:
        """What is wrong with one answer by the document ([] for a route it does not document: operations, internal
        routes and paths no route serves are not its business)."""
        template = self.template(answer.method, answer.path)
        if template is None:
            return []
        method = answer.method.lower()
        # named by its route, not its path: the same problem of many answers is told once (`unexplained`)
        answer = replace(answer, path=template)
        responses: Mapping[str, Any] = self.document["paths"][template][method].get("responses", {})
        status = next((s for s in (str(answer.status), f"{answer.status // 100}XX", "default") if s in responses), None)
        if status is None:
            return [f"{answer}: the document names no such status for {answer.method} {template}"]
        content: Mapping[str, Any] = responses[status].get("content", {})
        if answer.media_type not in content:
            return [f"{answer}: the document names {sorted(content)} for it, not {answer.media_type}"]
        if "schema" not in content[answer.media_type]:
            return [f"{answer}: the document gives {answer.media_type} no schema"]
        pointer = _pointer("paths", template, method, "responses", status, "content", answer.media_type, "schema")
        validator = Draft202012Validator({"$ref": f"{DOCUMENT_URI}#{pointer}"}, registry=self.registry,
                                         format_checker=FORMATS)
        # an error in a union (`X | null`) is told by the branch that came closest
        errors = [best_match([e]) if e.context else e for e in validator.iter_errors(answer.body)]
        errors.sort(key=lambda e: [str(p) for p in e.absolute_path])
        return [f"{answer}: `{'.'.join(str(p) for p in e.absolute_path) or '(the body)'}`: {e.message[:300]}"
                for e in errors[:5]]

    def unexplained(self, answers: Iterable[HttpAnswer]) -> list[str]:
        """Every problem of every answer, each distinct one once."""
        return list(dict.fromkeys(p for a in answers for p in self.problems(a)))
