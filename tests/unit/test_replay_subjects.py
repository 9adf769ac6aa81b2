"""Which durables a replay's subject reaches: NATS patterns that share a subject (shared/replay.py)."""

from __future__ import annotations

import itertools

import pytest

from shared.replay import subjects_overlap
from shared.streams import subject_matches


@pytest.mark.parametrize(("a", "b", "overlap"), [
    ("video.created.*", "*.*.acc1", True),  # every account's type, a team's account: video.created.acc1
    ("video.created", "*.*.acc1", False),  # the bare type has two tokens
    ("video.created.*", "encode.*.acc1", False),
    ("video.created.*", "video.created.acc1", True),
    ("video.created.acc2", "*.*.acc1", False),
    ("video.>", "*.*.acc1", True),
    ("video.>", "video", False),  # `>` needs a token
    (">", "video.created", True),
    ("a.*.c", "a.b.*", True),
    ("a.*.c", "a.b.d", False),
    ("a.b", "a.b.c", False),
    ("a.b", "a.b", True),
])
def test_subjects_overlap(a: str, b: str, overlap: bool) -> None:
    assert subjects_overlap(a, b) is overlap
    assert subjects_overlap(b, a) is overlap  # symmetric


TOKENS = ("a", "b", "*", ">")


def _concrete(pattern: str) -> list[str]:
    """Every concrete subject of up to 3 tokens over a, b, c that the pattern matches."""
    subjects = [".".join(t) for n in (1, 2, 3) for t in itertools.product("abc", repeat=n)]
    return [s for s in subjects if subject_matches(pattern, s)]


@pytest.mark.parametrize(("a", "b"), [
    (".".join(x), ".".join(y))
    for n, m in itertools.product((1, 2, 3), repeat=2)
    for x in itertools.product(TOKENS, repeat=n) for y in itertools.product(TOKENS, repeat=m)
    if ">" not in x[:-1] and ">" not in y[:-1]
])
def test_overlap_is_a_shared_concrete_subject(a: str, b: str) -> None:
    """Against the definition, over every pattern of up to 3 tokens: some subject matches both (patterns this short
    that share a subject share one of at most 3 tokens, so the small alphabet decides)."""
    assert subjects_overlap(a, b) is bool(set(_concrete(a)) & set(_concrete(b)))
