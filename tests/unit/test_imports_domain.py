"""The decisions of imports from a URL (services/api/domain.py), exhaustively: what is retried, how long it waits,
which video takes an import, what the upload routes refuse, what is shown of a URL; and the importer's readers of
an answer's headers (services/api/imports.py)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from botocore.httpchecksum import Crc32Checksum

from services.api import domain
from services.api.domain import FetchFailure, ImportRefusal
from services.api.imports import content_type_of, retry_after_seconds
from services.api.objects import Objects
from services.api.settings import ApiSettings
from shared.videos import GONE, NO_FILE_YET, ImportState, VideoStatus

DEFAULTS = ApiSettings()
NETWORK = {FetchFailure.DNS_FAILED, FetchFailure.CONNECT_FAILED, FetchFailure.TIMEOUT, FetchFailure.PROTOCOL_ERROR,
           FetchFailure.STORAGE}


@pytest.mark.parametrize("failure", [f for f in FetchFailure if f is not FetchFailure.HTTP_STATUS])
def test_the_network_and_storage_are_retried_what_the_url_says_is_not(failure: FetchFailure) -> None:
    assert domain.import_retried(failure) is (failure in NETWORK)


@pytest.mark.parametrize("status", range(100, 600))
def test_an_http_status_is_retried_when_the_server_may_answer_later(status: int) -> None:
    assert domain.import_retried(FetchFailure.HTTP_STATUS, status) is (status in {408, 425, 429} or status >= 500)


def test_an_http_failure_without_its_status_is_not_retried() -> None:
    assert not domain.import_retried(FetchFailure.HTTP_STATUS, None)


def delay(attempts: int, spread: float = 0.5, retry_after: float | None = None,
          max_attempts: int = DEFAULTS.import_max_attempts) -> float | None:
    return domain.import_retry_delay(attempts, max_attempts=max_attempts,
                                     base_seconds=DEFAULTS.import_retry_base_seconds, spread=spread,
                                     retry_after=retry_after)


def test_the_backoff_grows_4x_from_the_base_and_stops_at_the_last_attempt() -> None:
    base = DEFAULTS.import_retry_base_seconds
    waits = [delay(n) for n in range(1, DEFAULTS.import_max_attempts + 1)]
    assert waits[:-1] == [pytest.approx(base * 4 ** (n - 1)) for n in range(1, DEFAULTS.import_max_attempts)]
    assert waits[-1] is None
    assert delay(DEFAULTS.import_max_attempts + 3) is None
    assert delay(1, max_attempts=1) is None, "one attempt allowed: none after it"
    # every retry of the defaults is over long before the sweep's day (a video between attempts has no upload open)
    assert sum(w for w in waits if w is not None) * 1.2 < 3600


@pytest.mark.parametrize(("attempts", "spread"), list(itertools.product(range(1, DEFAULTS.import_max_attempts),
                                                                        [0.0, 0.25, 0.5, 0.999])))
def test_the_spread_is_within_20_percent(attempts: int, spread: float) -> None:
    middle = delay(attempts)
    got = delay(attempts, spread)
    assert middle is not None and got is not None
    assert 0.8 * middle <= got < 1.2 * middle
    assert got == pytest.approx(middle * (0.8 + 0.4 * spread))


@pytest.mark.parametrize("attempts", range(1, DEFAULTS.import_max_attempts))
def test_a_servers_retry_after_is_waited_out_up_to_4x_the_backoff(attempts: int) -> None:
    backoff = delay(attempts)
    assert backoff is not None
    assert delay(attempts, retry_after=0) == backoff, "a shorter Retry-After changes nothing"
    assert delay(attempts, retry_after=backoff * 2) == pytest.approx(backoff * 2)
    assert delay(attempts, retry_after=backoff * 100) == pytest.approx(backoff * 4)
    assert delay(DEFAULTS.import_max_attempts, retry_after=5) is None, "no attempt is left to wait for"


CASES = list(itertools.product(VideoStatus, [False, True], [None, "upload-1"], [None, *ImportState]))


@pytest.mark.parametrize(("status", "has_file", "upload_id", "state"), CASES)
def test_which_video_takes_an_import(status: VideoStatus, has_file: bool, upload_id: str | None,
                                     state: ImportState | None) -> None:
    refusal = domain.import_refusal(status, has_file, upload_id, state)
    if status in GONE:
        assert refusal is ImportRefusal.GONE
    elif has_file or status not in NO_FILE_YET:
        assert refusal is ImportRefusal.HAS_FILE
    elif state in {ImportState.QUEUED, ImportState.FETCHING}:
        assert refusal is ImportRefusal.IMPORTING
    elif upload_id is not None:
        assert refusal is ImportRefusal.UPLOADING
    else:
        assert refusal is None  # a new video, or one whose earlier import ended (cancelled) without a file


@pytest.mark.parametrize("state", [None, *ImportState])
def test_the_upload_routes_are_refused_only_while_an_import_runs(state: ImportState | None) -> None:
    assert domain.upload_blocked_by_import(state) is (state in {ImportState.QUEUED, ImportState.FETCHING})


@pytest.mark.parametrize(("url", "shown"), [
    ("https://cdn.example.com/a.mp4", "https://cdn.example.com/a.mp4"),
    ("https://bucket.s3.amazonaws.com/a.mp4?X-Amz-Signature=abc&X-Amz-Credential=k", "https://bucket.s3.amazonaws.com/a.mp4"),
    ("https://example.com/a.mp4#t=10", "https://example.com/a.mp4"),
    ("https://example.com/a.mp4?x=1#frag", "https://example.com/a.mp4"),
    ("http://example.com:8080/dir/", "http://example.com:8080/dir/"),
])
def test_a_urls_query_is_never_shown(url: str, shown: str) -> None:
    assert domain.shown_import_url(url) == shown


@pytest.mark.parametrize(("header", "stored"), [
    ("video/mp4", "video/mp4"),
    ("video/MP4; codecs=avc1", "video/mp4"),
    ("video/x-matroska", "video/x-matroska"),
    (None, "application/octet-stream"),
    ("", "application/octet-stream"),
    ("text/html\r\nX-Injected: 1", "application/octet-stream"),
    ("not a type", "application/octet-stream"),
    ("video/" + "a" * 300, "application/octet-stream"),
])
def test_the_stored_content_type_is_the_answers_media_type_or_octet_stream(header: str | None, stored: str) -> None:
    assert content_type_of(header) == stored


@pytest.mark.parametrize(("header", "seconds"), [
    ("0", 0.0), ("5", 5.0), ("1.5", 1.5), ("-3", 0.0), (None, None),
    ("Wed, 21 Oct 2015 07:28:00 GMT", None), ("soon", None),
])
def test_retry_after_is_read_in_seconds(header: str | None, seconds: float | None) -> None:
    assert retry_after_seconds(header) == seconds


class _Capturing:
    """Records what upload_part was asked (the checksum's form is pure logic: storage is not needed to read it)."""

    def __init__(self) -> None:
        self.asked: dict[str, Any] = {}

    async def upload_part(self, **asked: Any) -> dict[str, str]:
        self.asked = asked
        return {"ETag": '"e"'}


@pytest.mark.parametrize("data", [b"", b"a", bytes(range(256)) * 4099])
async def test_the_crc32_a_part_carries_is_the_one_botocore_would_compute(data: bytes) -> None:
    s3 = _Capturing()
    assert await Objects(s3, "b").upload_part("k", "u", 1, data) == '"e"'
    own = Crc32Checksum()
    own.update(data)
    assert s3.asked["ChecksumCRC32"] == own.b64digest() and s3.asked["Body"] is data
