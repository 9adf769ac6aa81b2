"""NKEY seeds of the bus identities, and nats-server's `authorization` block rendered from shared/identities.py.

`ensure_seeds` makes one seed per identity and keeps those already there (a restarted stack keeps its identities);
a seed file is what `nats.connect(url, nkeys_seed=path)` reads. `authorization_config` renders each identity's public
key and allow lists, `allow_responses` for a responder. Only public keys reach the server's configuration, and no
secret crosses the wire (NKEY authentication signs the server's nonce).
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

import nkeys  # type: ignore[import-untyped]

from shared.identities import IDENTITIES, RESPONSE_EXPIRES, RESPONSE_MAX, Identity, Right, valid_name

SEED_SUFFIX = ".nk"
DIR_MODE = 0o700
SEED_MODE = 0o600
_SUBJECT = re.compile(r"^[A-Za-z0-9_$*>.-]+$")


class SeedError(Exception):
    """A seed file that cannot be used (not a user seed, unreadable): never replaced silently."""


def new_seed() -> bytes:
    """A fresh NKEY user seed (`SU...`)."""
    seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed


def public_key_of(seed: bytes) -> str:
    """The user's public key (`U...`) of a seed; raises SeedError if it is not a user seed."""
    try:
        kp = nkeys.from_seed(bytearray(seed.strip()))
        public: str = kp.public_key.decode()
        kp.wipe()
    except Exception as exc:
        raise SeedError(f"not an NKEY seed: {type(exc).__name__}") from None
    if not public.startswith("U"):
        raise SeedError("not a user seed (its public key does not start with U)")
    return public


def seed_path(directory: Path, name: str) -> Path:
    return directory / f"{name}{SEED_SUFFIX}"


def public_key(path: Path) -> str:
    """The public key of a seed file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise SeedError(f"{path}: {exc.strerror or exc}") from None
    try:
        return public_key_of(data)
    except SeedError as exc:
        raise SeedError(f"{path}: {exc}") from None


def ensure_seeds(directory: Path, names: Iterable[str] | None = None) -> dict[str, Path]:
    """One seed file per identity under `directory` (0700), each 0600; existing seeds are kept (and their mode made
    0600 again). Returns {name: path of its seed file}."""
    directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    os.chmod(directory, DIR_MODE)
    seeds: dict[str, Path] = {}
    for name in IDENTITIES if names is None else names:
        if not valid_name(name):
            raise ValueError(f"not an identity name: {name!r}")
        path = seed_path(directory, name)
        if path.exists():
            public_key(path)  # a damaged seed is an error to look at, not a new identity
            if stat.S_IMODE(path.stat().st_mode) != SEED_MODE:
                os.chmod(path, SEED_MODE)
        else:
            _write_new(path)
        seeds[name] = path
    return seeds


def _write_new(path: Path) -> None:
    """A new seed, written whole or not at all, never readable by others (created 0600, then renamed in place)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, SEED_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(new_seed() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, SEED_MODE)  # whatever the umask did
        os.link(tmp, path)  # fails if another process made this seed meanwhile: theirs stays
    except FileExistsError:
        pass
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


def public_keys(seeds: Mapping[str, Path]) -> dict[str, str]:
    return {name: public_key(path) for name, path in seeds.items()}


# ------------------------------------------------------------------------------------------- server configuration


def _quoted(subject: str) -> str:
    if not _SUBJECT.match(subject):
        raise ValueError(f"not a subject to put in the server configuration: {subject!r}")
    return f'"{subject}"'


def _comment(text: str) -> str:
    return " ".join(text.split())


def _listed(kind: str, rights: Iterable[Right], indent: str) -> list[str]:
    """An allow or deny list, one subject a line with its reason (the first given for a subject)."""
    seen: dict[str, str] = {}
    for r in rights:
        seen.setdefault(r.subject, r.why)
    lines = [f"{indent}{kind}: ["]
    lines += [f"{indent}  {_quoted(subject)}  # {_comment(why)}" for subject, why in seen.items()]
    lines.append(f"{indent}]")
    return lines


def _allow_list(rights: Iterable[Right], indent: str) -> list[str]:
    """An allow list; an empty one denies everything (`deny: [">"]`), since an absent allow list would allow
    everything."""
    rights = list(rights)
    return _listed("allow", rights, indent) if rights else [f'{indent}deny: [">"]']


def user_entry(identity: Identity, key: str, indent: str = "    ") -> list[str]:
    """One user of the `users` list: the identity's public key and permissions."""
    if not (key.startswith("U") and len(key) == 56 and key.isalnum()):
        raise ValueError(f"{identity.name}: not an NKEY user public key: {key!r}")
    i2, i3, i4 = indent + "  ", indent + "    ", indent + "      "
    lines = [f"{indent}# {identity.name}: {_comment(identity.description)}", f"{indent}{{",
             f'{i2}nkey: "{key}"', f"{i2}permissions: {{", f"{i3}publish: {{"]
    lines += _allow_list(identity.publish_rights(), i4)
    if identity.deny_publish and identity.publish_rights():  # without an allow list, `deny: [">"]` says it all
        lines += _listed("deny", identity.deny_publish, i4)
    lines += [f"{i3}}}", f"{i3}subscribe: {{"]
    lines += _allow_list(identity.subscribe_rights(), i4)
    lines.append(f"{i3}}}")
    if identity.responds:
        lines.append(f'{i3}allow_responses: {{max: {RESPONSE_MAX}, expires: "{RESPONSE_EXPIRES}"}}'
                     "  # one reply to each request it received, on the requester's inbox")
    lines += [f"{i2}}}", f"{indent}}}"]
    return lines


def authorization_config(
    keys: Mapping[str, str],
    *,
    identities: Mapping[str, Identity] | None = None,
    extra: Iterable[Identity] = (),
) -> str:
    """nats-server's `authorization` block: one NKEY user per identity (`identities`, default every declared one,
    plus `extra`, e.g. an outside team's `publisher_like` or a test's own), each with the public key `keys[name]`.
    No `no_auth_user`: an anonymous or unknown connection is refused. The rules are not checked here (a test may
    want an identity that breaks them): check `shared.identityrules.violations` before serving a configuration."""
    chosen = list((IDENTITIES if identities is None else identities).values()) + list(extra)
    names = [i.name for i in chosen]
    bad = [n for n in names if not valid_name(n)]
    if bad:
        raise ValueError(f"not identity names: {bad}")
    if len(set(names)) != len(names):
        raise ValueError(f"an identity is listed twice: {names}")
    missing = [n for n in names if n not in keys]
    if missing:
        raise KeyError(f"no public key for {', '.join(missing)}")
    if len({keys[n] for n in names}) != len(names):
        raise ValueError("two identities share a public key: each needs its own seed")
    lines = ["# Generated by Weir (shared/natsauth.py) from shared/identities.py: edit the declaration, not this.",
             "authorization {", "  # every client connects with its identity's NKEY seed; nothing else is let in",
             "  users = ["]
    for identity in chosen:
        lines += user_entry(identity, keys[identity.name])
    lines += ["  ]", "}", ""]
    return "\n".join(lines)

