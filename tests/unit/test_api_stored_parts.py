"""The api's ListParts pagination (services/api/objects.py collect_parts), against pages made up here."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from services.api.objects import StorageUnavailable, StoredPart, collect_parts


def part(n: int) -> dict[str, Any]:
    return {"PartNumber": n, "ETag": f'"e{n}"', "Size": 100 + n}


class Pages:
    """A ListParts paginator: `pages` answers in turn; `asked` records the marker of each call."""

    def __init__(self, *pages: Mapping[str, Any]) -> None:
        self.pages = list(pages)
        self.asked: list[int | None] = []

    async def __call__(self, marker: int | None) -> Mapping[str, Any]:
        self.asked.append(marker)
        return self.pages.pop(0)


async def test_every_page_is_followed_by_its_marker() -> None:
    pages = Pages({"Parts": [part(1), part(2)], "IsTruncated": True, "NextPartNumberMarker": 2},
                  {"Parts": [part(4), part(3)], "IsTruncated": True, "NextPartNumberMarker": "4"},
                  {"Parts": [part(5)], "IsTruncated": False})
    found = await collect_parts(pages)
    assert found == [StoredPart(n, f'"e{n}"', 100 + n) for n in range(1, 6)]
    assert pages.asked == [None, 2, 4]


async def test_one_page_and_none() -> None:
    assert await collect_parts(Pages({"Parts": [part(1)], "IsTruncated": False})) == [StoredPart(1, '"e1"', 101)]
    assert await collect_parts(Pages({"IsTruncated": False})) == []


@pytest.mark.parametrize("cut", [{}, {"NextPartNumberMarker": None}, {"NextPartNumberMarker": ""},
                                 {"NextPartNumberMarker": "x"}, {"NextPartNumberMarker": 0}])
async def test_a_page_cut_short_with_no_way_on_is_unavailable(cut: dict[str, Any]) -> None:
    with pytest.raises(StorageUnavailable):
        await collect_parts(Pages({"Parts": [part(1)], "IsTruncated": True, **cut}))


async def test_a_marker_that_does_not_move_on_is_unavailable_not_a_loop() -> None:
    pages = Pages({"Parts": [part(1), part(2)], "IsTruncated": True, "NextPartNumberMarker": 2},
                  {"Parts": [part(2)], "IsTruncated": True, "NextPartNumberMarker": 2})
    with pytest.raises(StorageUnavailable):
        await collect_parts(pages)
