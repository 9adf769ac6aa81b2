"""Which release this code is, and the releases made before it (releases.toml at the repository's root).

VERSION is the release this code is or will be; releases.toml lists the releases made, each with its commit. The
commit of the running code is WEIR_COMMIT (an image is built with it) or, in a checkout, git's HEAD.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

VERSION = "1.1.0"
# the first release whose services answer `GET /version`: an instance that answers it 404 runs an older one
FIRST_WITH_VERSION_ROUTE = "1.1.0"

ROOT = Path(__file__).resolve().parent.parent
RELEASES_FILE = ROOT / "releases.toml"
_SEMVER = re.compile(r"^(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)$")


class ReleaseError(ValueError):
    """releases.toml or a version is malformed."""


def parse_version(text: str) -> tuple[int, int, int]:
    """`1.2.3` -> (1, 2, 3); raises ReleaseError for anything that is not MAJOR.MINOR.PATCH."""
    match = _SEMVER.match(text)
    if not match:
        raise ReleaseError(f"{text!r} is not a MAJOR.MINOR.PATCH version")
    return int(match.group(1)), int(match.group(2)), int(match.group(3))


@dataclass(frozen=True)
class Release:
    version: str
    commit: str
    date: str = ""
    notes: str = ""


def read_releases(path: Path = RELEASES_FILE) -> tuple[Release, ...]:
    """The releases listed, oldest first; () when the file is absent (an installed image carries none)."""
    if not path.exists():
        return ()
    try:
        rows = tomllib.loads(path.read_text(encoding="utf-8")).get("release", [])
        found = tuple(Release(str(r["version"]), str(r["commit"]), str(r.get("date", "")), str(r.get("notes", "")))
                      for r in rows)
    except (tomllib.TOMLDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ReleaseError(f"{path}: {e}") from None
    for r in found:
        parse_version(r.version)
        if not re.fullmatch(r"[0-9a-f]{40}", r.commit):
            raise ReleaseError(f"{path}: release {r.version}: commit must be a full 40-digit hash, not {r.commit!r}")
    return found


def previous_release(path: Path = RELEASES_FILE) -> Release | None:
    """The last release made: what the code before this one runs, and the mixed-version test's other side."""
    listed = read_releases(path)
    return listed[-1] if listed else None


@functools.cache
def commit() -> str:
    """The commit this code was built from: WEIR_COMMIT, else git's HEAD of the checkout, else "unknown"."""
    if os.environ.get("WEIR_COMMIT"):
        return os.environ["WEIR_COMMIT"]
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    head = out.stdout.strip()
    return head if out.returncode == 0 and re.fullmatch(r"[0-9a-f]{40}", head) else "unknown"


@functools.cache
def dirty() -> bool | None:
    """Whether the checkout's tracked files differed from that commit when this process started (WEIR_DIRTY `1`/`0`
    for an image built with it); None: not known (an image without it, no git)."""
    if os.environ.get("WEIR_COMMIT"):
        flag = os.environ.get("WEIR_DIRTY") or None  # an image built without it has it empty
        return None if flag is None else flag == "1"
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


class VersionInfo(BaseModel):
    """A service instance's release, as `GET /version` and `/healthz` show it. Read tolerantly: a newer release
    may add fields, which a reader ignores."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    service: str = Field(description="the service's name (api, auth, encode, media, sweep)")
    version: str = Field(description="the release this instance runs (MAJOR.MINOR.PATCH)")
    commit: str = Field("unknown", description="the commit it was built from (WEIR_COMMIT, else git's HEAD)")
    dirty: bool | None = Field(None, description="it runs changes not in that commit (a checkout's modified tracked "
                               "files); null: not known")
    contracts: dict[str, Any] = Field(default_factory=dict, description=(
        "the contract versions it speaks (shared/contractversions.py), e.g. {\"events\": {type: version}}"))


def version_info(service: str) -> VersionInfo:
    """This code's VersionInfo for `service` (its contract versions derived from the declarations)."""
    from shared.contractversions import contract_versions  # the catalog: only where a service is described

    return VersionInfo(service=service, version=VERSION, commit=commit(), dirty=dirty(),
                       contracts=contract_versions(service))
