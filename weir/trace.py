"""`weir trace VIDEO_ID`: a video's journey through the stack, from the trace files its services wrote.

It reads the OTLP JSON lines of shared/tracing.py (`WEIR_TRACES_DIR/<service>-<pid>.jsonl`), finds the spans whose
`weir.video_id` is the video, takes every span of their traces and draws each trace as a tree (children in start
order) with each span's service, start offset and duration. Queries, FastStream's zero-length `create` spans and
reply publishes are hidden unless `everything` (a query's time still counts in its parent's); a replayed event's span
shows its link. The pure parts (parse, select, build, render) are apart from reading files, and tested on their own.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

VIDEO_ID = "weir.video_id"
REPLAYED_FROM = "weir.replayed_from"


@dataclass(frozen=True)
class LinkRecord:
    trace_id: str
    span_id: str
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SpanRecord:
    """One span as a trace file has it (ids in hex, times in ns since the epoch)."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    service: str
    start_ns: int
    end_ns: int
    kind: str = "internal"
    status: str = "unset"  # "ok", "error" or "unset"
    status_message: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)
    links: tuple[LinkRecord, ...] = ()

    @property
    def duration_ms(self) -> float:
        return max(0, self.end_ns - self.start_ns) / 1e6

    @property
    def is_query(self) -> bool:
        return self.kind == "client" and any(k in self.attributes for k in ("db.system", "db.system.name"))

    @property
    def is_plumbing(self) -> bool:
        """FastStream's `<subject> create` marks (no duration of their own) and replies to an inbox."""
        return self.name.endswith(" create") or self.name.startswith("_INBOX.")


@dataclass
class Node:
    span: SpanRecord
    children: list[Node] = field(default_factory=list)


@dataclass
class TraceTree:
    trace_id: str
    roots: list[Node]

    @property
    def start_ns(self) -> int:
        return min(node.span.start_ns for node in self.roots)

    @property
    def end_ns(self) -> int:
        return max(span.end_ns for span in self.spans())

    @property
    def services(self) -> list[str]:
        return sorted({span.service for span in self.spans()})

    def spans(self) -> Iterator[SpanRecord]:
        stack = list(self.roots)
        while stack:
            node = stack.pop()
            yield node.span
            stack.extend(node.children)


# --------------------------------------------------------------------------------------------------- parsing


def parse_id(value: str | None, size: int) -> str | None:
    """An id as hex: OTLP/JSON writes hex, protobuf's JSON mapping (shared/tracing.py's files) base64."""
    if not value:
        return None
    if len(value) == size * 2:
        try:
            bytes.fromhex(value)
            return value.lower()
        except ValueError:
            pass
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    if len(raw) != size or not any(raw):
        return None
    return raw.hex()


def any_value(value: dict[str, Any]) -> Any:
    """An OTLP AnyValue as a Python value (int64s come as strings in JSON)."""
    if "stringValue" in value:
        return value["stringValue"]
    if "boolValue" in value:
        return bool(value["boolValue"])
    if "intValue" in value:
        return int(value["intValue"])
    if "doubleValue" in value:
        return float(value["doubleValue"])
    if "arrayValue" in value:
        return [any_value(v) for v in value["arrayValue"].get("values", [])]
    if "kvlistValue" in value:
        return attributes_of(value["kvlistValue"].get("values", []))
    if "bytesValue" in value:
        return value["bytesValue"]
    return None


def attributes_of(items: Iterable[dict[str, Any]]) -> dict[str, Any]:
    return {item["key"]: any_value(item.get("value", {})) for item in items if "key" in item}


_KINDS = {1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
_STATUS = {0: "unset", 1: "ok", 2: "error"}


def _enum(value: Any, names: dict[int, str], prefix: str, default: str) -> str:
    if isinstance(value, int):
        return names.get(value, default)
    if isinstance(value, str):
        return value.removeprefix(prefix).lower() or default
    return default


def parse_request(document: dict[str, Any]) -> list[SpanRecord]:
    """The spans of one ExportTraceServiceRequest (as JSON)."""
    spans: list[SpanRecord] = []
    for resource_spans in document.get("resourceSpans", []):
        resource = attributes_of(resource_spans.get("resource", {}).get("attributes", []))
        service = str(resource.get("service.name", "?"))
        for scope_spans in resource_spans.get("scopeSpans", []):
            for raw in scope_spans.get("spans", []):
                span = _span(raw, service)
                if span is not None:
                    spans.append(span)
    return spans


def _span(raw: dict[str, Any], service: str) -> SpanRecord | None:
    trace_id, span_id = parse_id(raw.get("traceId"), 16), parse_id(raw.get("spanId"), 8)
    if trace_id is None or span_id is None:
        return None
    status = raw.get("status", {})
    links = tuple(
        LinkRecord(lt, ls, attributes_of(link.get("attributes", [])))
        for link in raw.get("links", [])
        if (lt := parse_id(link.get("traceId"), 16)) and (ls := parse_id(link.get("spanId"), 8))
    )
    return SpanRecord(
        trace_id=trace_id, span_id=span_id, parent_id=parse_id(raw.get("parentSpanId"), 8),
        name=str(raw.get("name", "")), service=service,
        start_ns=int(raw.get("startTimeUnixNano", 0)), end_ns=int(raw.get("endTimeUnixNano", 0)),
        kind=_enum(raw.get("kind"), _KINDS, "SPAN_KIND_", "internal"),
        status=_enum(status.get("code"), _STATUS, "STATUS_CODE_", "unset"),
        status_message=str(status.get("message", "")),
        attributes=attributes_of(raw.get("attributes", [])), links=links,
    )


def parse_lines(lines: Iterable[str]) -> list[SpanRecord]:
    """Every span of OTLP JSON lines; a line that is not one (a file being written, a stray line) is skipped."""
    spans: list[SpanRecord] = []
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            document = json.loads(line)
        except ValueError:
            continue
        if isinstance(document, dict):
            spans.extend(parse_request(document))
    return spans


# ------------------------------------------------------------------------------------------ selecting, building


def traces_of_video(spans: Iterable[SpanRecord], video_id: str) -> dict[str, list[SpanRecord]]:
    """Every span of every trace in which some span concerns the video, by trace id (each span once)."""
    by_trace: dict[str, dict[str, SpanRecord]] = {}
    wanted: set[str] = set()
    for span in spans:
        by_trace.setdefault(span.trace_id, {})[span.span_id] = span
        if span.attributes.get(VIDEO_ID) == video_id:
            wanted.add(span.trace_id)
    return {trace_id: list(by_trace[trace_id].values()) for trace_id in wanted}


def build_tree(trace_id: str, spans: Sequence[SpanRecord], *, everything: bool = False) -> TraceTree:
    """One trace as a tree. A span whose parent is not there (not written yet, or dropped) is a root; a span left out
    of the drawing (a query, plumbing) hands its children to its nearest drawn ancestor."""
    by_id = {s.span_id: s for s in spans}

    def shown(span: SpanRecord) -> bool:
        return everything or not (span.is_query or span.is_plumbing)

    def drawn_parent(span: SpanRecord) -> str | None:
        parent = span.parent_id
        while parent is not None and parent in by_id and not shown(by_id[parent]):
            parent = by_id[parent].parent_id
        return parent if parent in by_id else None

    nodes = {s.span_id: Node(s) for s in spans if shown(s)}
    roots: list[Node] = []
    for node in nodes.values():
        parent = drawn_parent(node.span)
        if parent is not None and parent in nodes:
            nodes[parent].children.append(node)
        else:
            roots.append(node)
    for node in nodes.values():
        node.children.sort(key=_order)
    roots.sort(key=_order)
    if not roots:  # nothing drawable (only queries): draw them after all
        return build_tree(trace_id, spans, everything=True)
    return TraceTree(trace_id, roots)


def _order(node: Node) -> tuple[int, int, str]:
    return node.span.start_ns, node.span.end_ns, node.span.name


def journey(spans: Iterable[SpanRecord], video_id: str, *, everything: bool = False) -> list[TraceTree]:
    """The video's traces as trees, in the order they began."""
    trees = [build_tree(t, s, everything=everything) for t, s in traces_of_video(spans, video_id).items()]
    return sorted(trees, key=lambda tree: (tree.start_ns, tree.trace_id))


# ------------------------------------------------------------------------------------------------- rendering


def format_ms(ms: float) -> str:
    if ms >= 10_000:
        return f"{ms / 1000:.1f} s"
    if ms >= 1000:
        return f"{ms / 1000:.2f} s"
    if ms >= 10:
        return f"{ms:.0f} ms"
    return f"{ms:.1f} ms"


def _time(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def render(trees: Sequence[TraceTree], video_id: str) -> str:
    """The trees as text: per trace a header line, then one line per span (`+offset` after the trace's start)."""
    if not trees:
        return f"no spans of video {video_id}"
    lines = [f"video {video_id}: {len(trees)} trace{'s' if len(trees) != 1 else ''}"]
    for tree in trees:
        start = tree.start_ns
        lines.append("")
        lines.append(f"trace {tree.trace_id}  {_time(start)}  {format_ms((tree.end_ns - start) / 1e6)}  "
                     f"[{', '.join(tree.services)}]")
        for i, root in enumerate(tree.roots):
            lines.extend(_render_node(root, start, "", i == len(tree.roots) - 1, top=True))
    return "\n".join(lines)


def _render_node(node: Node, start: int, indent: str, last: bool, *, top: bool = False) -> Iterator[str]:
    span = node.span
    branch = "" if top else ("└─ " if last else "├─ ")
    mark = "  ✗ " + (span.status_message or "error") if span.status == "error" else ""
    offset = format_ms((span.start_ns - start) / 1e6)
    yield f"{indent}{branch}{span.name}  {span.service}  +{offset}  {format_ms(span.duration_ms)}{mark}"
    child_indent = indent if top else indent + ("   " if last else "│  ")
    for link in span.links:
        why = " (replayed from)" if REPLAYED_FROM in link.attributes else ""
        yield f"{child_indent}   ↪ link to trace {link.trace_id} span {link.span_id}{why}"
    for i, child in enumerate(node.children):
        yield from _render_node(child, start, child_indent, i == len(node.children) - 1)


def as_json(trees: Sequence[TraceTree], video_id: str) -> dict[str, Any]:
    """The same as data: `{video_id, traces: [{trace_id, start, duration_ms, services, spans: [node...]}]}`."""

    def node_json(node: Node, start: int) -> dict[str, Any]:
        s = node.span
        return {
            "name": s.name, "service": s.service, "span_id": s.span_id, "parent_id": s.parent_id,
            "kind": s.kind, "start": _time(s.start_ns), "offset_ms": round((s.start_ns - start) / 1e6, 3),
            "duration_ms": round(s.duration_ms, 3), "status": s.status, "status_message": s.status_message,
            "attributes": s.attributes,
            "links": [{"trace_id": link.trace_id, "span_id": link.span_id, "attributes": link.attributes}
                      for link in s.links],
            "children": [node_json(child, start) for child in node.children],
        }

    return {
        "video_id": video_id,
        "traces": [
            {"trace_id": tree.trace_id, "start": _time(tree.start_ns),
             "duration_ms": round((tree.end_ns - tree.start_ns) / 1e6, 3), "services": tree.services,
             "spans": [node_json(root, tree.start_ns) for root in tree.roots]}
            for tree in trees
        ],
    }


# --------------------------------------------------------------------------------------------------- reading


def trace_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.jsonl")) if directory.is_dir() else []


def read_spans(directory: Path) -> list[SpanRecord]:
    """Every span of every trace file in the directory."""
    spans: list[SpanRecord] = []
    for path in trace_files(directory):
        with path.open(encoding="utf-8", errors="replace") as lines:
            spans.extend(parse_lines(lines))
    return spans
