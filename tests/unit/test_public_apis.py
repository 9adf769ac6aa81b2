"""Weir's own code uses FastStream, nats-py and asyncpg through their public APIs only.

A private name (`obj._x`, `getattr(obj, "_x")`, an import of `_x` or from a `_module`), an override of a private
method in a subclass of a library class, or a `__class__` swap ties Weir to one release's internals: the next
release can break it silently. Weir's own objects' private names are read only by their own class (`self._x`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("services", "shared")
# underscore names that are public API: NamedTuple's methods, and `from __future__`
PUBLIC_UNDERSCORE = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})
LIBRARIES = ("faststream", "nats", "asyncpg")


def sources() -> Iterator[tuple[str, ast.Module]]:
    for folder in CHECKED:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield str(path.relative_to(ROOT)), ast.parse(path.read_text(), str(path))


def private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name not in PUBLIC_UNDERSCORE


def library_names(tree: ast.Module) -> set[str]:
    """Names the module imports from FastStream, nats-py or asyncpg (classes a subclass could extend)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in LIBRARIES:
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names
                         if alias.name.split(".")[0] in LIBRARIES)
    return names


def findings(path: str, tree: ast.Module) -> Iterator[str]:
    from_libraries = library_names(tree)
    for node in ast.walk(tree):
        where = f"{path}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Attribute) and private(node.attr):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                yield f"{where}: reads {ast.unparse(node)}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in (
                "getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2:
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str) and (
                    private(name.value) or name.value == "__class__"):
                yield f"{where}: {node.func.id}(..., {name.value!r})"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module != "__future__":
            if any(private(part) for part in node.module.split(".")) or any(private(a.name) for a in node.names):
                yield f"{where}: imports {[a.name for a in node.names]} from {node.module}"
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and target.attr == "__class__":
                    yield f"{where}: swaps the class of {ast.unparse(target.value)}"
        elif isinstance(node, ast.ClassDef):
            bases = {ast.unparse(base).split(".")[0].split("[")[0] for base in node.bases}
            if bases & from_libraries:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and private(item.name):
                        yield f"{where}: {node.name} overrides the library's private {item.name}"


def test_no_private_library_names_and_no_class_swaps() -> None:
    found = [line for path, tree in sources() for line in findings(path, tree)]
    assert not found, "private names or class swaps:\n" + "\n".join(found)


def test_the_check_finds_each_kind_of_private_use() -> None:
    """The scan itself: each pattern it must refuse is refused, and public names pass."""
    bad = {
        "nc._send_command(b'')": "reads",
        "x = getattr(nc, '_transport', None)": "getattr",
        "from nats.aio.client import _SUBJECT_INVALID_RE": "imports",
        "from faststream._internal.context import ContextRepo": "imports",
        "sub.__class__ = Other": "swaps",
        "from faststream.nats import Sub\nclass Mine(Sub):\n    async def _consume(self): ...": "overrides",
    }
    for code, kind in bad.items():
        found = list(findings("x.py", ast.parse(code)))
        assert found and kind in found[0], (code, found)
    good = "from __future__ import annotations\nt = p._replace(a=1)\nself._x = 1\nclass A:\n    def _own(self): ...\n"
    assert not list(findings("x.py", ast.parse(good)))


def test_the_consumer_seam_is_for_the_faststream_it_was_written_for() -> None:
    """shared/consumer.py's `DurablePull` runs durable consumers on nats-py because FastStream 0.7.8's public pull
    subscribers have no batch that returns what one fetch brings. Another FastStream: see whether it has one now
    (bench.bus, consumer cost per event against `DurablePull`'s), then move this pin."""
    assert version("faststream") == "0.7.8"


def test_the_pull_seam_is_for_the_nats_py_it_was_written_for() -> None:
    """shared/pull.py pulls on nats-py's core client because nats-py 2.16.0's `fetch` holds a message for the rest of
    its request when the server answers its first, no-wait request "408 Requests Pending" (two readers of one durable:
    tests/integration/test_pull.py). Another nats-py: run bench.pull (its fetch beside shared/pull.py) and that test
    with its fetch, then move this pin."""
    assert version("nats-py") == "2.16.0"
