"""Imports from a URL (`POST /v1/videos/{id}/import`): any api instance takes a due import from the videos table
under a lease, reads the URL through the SSRF guard (shared/ssrf.py: every hop of a redirect judged anew, a name
resolved once and connected to as judged), stores it part by part as a multipart upload, and completes it as the
upload routes do (`Videos.complete`: the content check, the file recorded, `upload.completed`). A failure worth
another attempt is retried later (domain.import_retry_delay); one the URL itself causes, or the last attempt's,
fails the video (`import_failed`, `video.failed`). An instance that dies mid-import loses it to another when its
lease runs out; one that stops gives it back at once."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import re
import ssl
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import aiohttp
import asyncpg
import httpx
from botocore.exceptions import BotoCoreError, ClientError

from services.api import domain, store
from services.api.domain import FetchFailure
from services.api.objects import StorageUnavailable
from services.api.settings import ApiSettings
from services.api.videos import Videos
from shared.metrics import Metrics
from shared.problems import Problem
from shared.release import VERSION
from shared.ssrf import (
    AddressRefused,
    InvalidEndpointUrl,
    NameNotResolved,
    Resolver,
    choose_address,
    connect_url,
    guarded_client,
    parse_endpoint_url,
    resolve,
)
from shared.videos import GONE, ImportState

log = logging.getLogger("weir.api.imports")
USER_AGENT = f"Weir-Import/{VERSION}"
REDIRECTS = frozenset({301, 302, 303, 307, 308})
READ_CHUNK = 256 * 1024
CONTENT_TYPE = re.compile(r"^[\w.+-]+/[\w.+-]+$")
STORAGE_ERRORS = (ClientError, BotoCoreError, StorageUnavailable, OSError)


class AttemptFailed(Exception):
    """One attempt's failure, as `import.error` shows it."""

    def __init__(self, failure: FetchFailure, message: str, *, status: int | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.failure, self.message, self.status, self.retry_after = failure, message, status, retry_after

    def shown(self, attempt: int) -> dict[str, Any]:
        shown: dict[str, Any] = {"code": str(self.failure), "message": self.message, "attempt": attempt,
                                 "at": datetime.now(UTC).isoformat()}
        if self.status is not None:
            shown["status"] = self.status
        return shown


class AttemptEnded(Exception):
    """The attempt no longer holds the import (the video was deleted or retired, or its lease was taken over)."""


def retry_after_seconds(value: str | None) -> float | None:
    """A `Retry-After` in seconds (its HTTP-date form is not waited for: the backoff decides)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def content_type_of(value: str | None) -> str:
    """The answer's media type as storage keeps it (parameters dropped); anything odd is octet-stream: the content
    check decides what the file is, not the header."""
    kind = (value or "").split(";", 1)[0].strip().lower()
    return kind if CONTENT_TYPE.fullmatch(kind) and len(kind) <= 200 else "application/octet-stream"


@dataclass
class Importer:
    videos: Videos
    settings: ApiSettings
    metrics: Metrics
    resolver: Resolver = resolve
    tls: ssl.SSLContext = field(default_factory=ssl.create_default_context)  # made once: it loads the CA file

    async def run(self, stop: asyncio.Event) -> None:
        """Take due imports while `stop` is not set, at most `import_concurrency` at a time; on stop, the running
        ones are cancelled by the runtime after its grace, and give their imports back."""
        running: set[asyncio.Task[None]] = set()
        wake = asyncio.Event()
        try:
            while not stop.is_set():
                free = self.settings.import_concurrency - len(running)
                claimed: list[store.Video] = []
                if free > 0:
                    try:
                        async with self.videos.pool.acquire() as conn:
                            claimed = await store.claim_imports(conn, free, self.settings.import_lease_seconds)
                    except Exception as exc:  # the database away: look again at the next tick
                        log.warning("imports: could not look for due imports: %r", exc)
                for video in claimed:
                    task = asyncio.create_task(self.attempt(video), name=f"import-{video.id}")
                    running.add(task)
                    task.add_done_callback(running.discard)
                    task.add_done_callback(lambda _: wake.set())
                if claimed and len(claimed) == free:
                    continue  # more may be due: the slots are full, the next look waits for one to free
                wake.clear()
                waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())]
                try:
                    await asyncio.wait(waiters, timeout=self.settings.import_poll_seconds,
                                       return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for w in waiters:
                        w.cancel()
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def attempt(self, video: store.Video) -> None:
        """One attempt at the video's import, which this instance claimed."""
        job = video.import_job
        assert job is not None
        attempt = job.attempts
        try:
            if video.status in GONE:
                raise AttemptEnded
            async with asyncio.timeout(self.settings.import_attempt_timeout_seconds):
                parts, size = await self._read_into_storage(video, attempt)
                await self._complete(video, attempt, parts, size)
        except AttemptFailed as failed:
            await self._failed(video, attempt, failed)
        except TimeoutError:
            most = self.settings.import_attempt_timeout_seconds
            await self._failed(video, attempt, AttemptFailed(FetchFailure.TIMEOUT,
                                                             f"the attempt took longer than {most:g} s"))
        except AttemptEnded:
            await self._ended(video, attempt)
        except asyncio.CancelledError:
            await asyncio.shield(self._give_back(video, attempt))
            raise
        except Exception as exc:  # Weir's side (a bug, the database): the import is retried, never left fetching
            log.exception("imports: %s: attempt %d failed on Weir's side", video.id, attempt)
            await self._failed(video, attempt, AttemptFailed(FetchFailure.STORAGE, f"Weir could not store the file "
                                                             f"({type(exc).__name__})"))

    # ------------------------------------------------------------------------------------------- reading

    async def open_url(self, client: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
        """The URL's answer, a 200, after at most `import_max_redirects` redirects (each URL judged and resolved
        anew: a redirect is another URL the developer did not give)."""
        s = self.settings
        for hop in range(s.import_max_redirects + 1):
            try:
                endpoint = parse_endpoint_url(url, allow_private=s.import_allow_private, https_only=False)
            except InvalidEndpointUrl as exc:
                raise AttemptFailed(FetchFailure.BAD_REDIRECT, f"a redirect led to a URL Weir does not read: {exc}"
                                    ) from None
            try:
                async with asyncio.timeout(s.import_read_timeout_seconds):
                    chosen = choose_address(await self.resolver(endpoint.host, endpoint.port), s.import_allow_private)
                    response = await client.get(
                        connect_url(endpoint, chosen), allow_redirects=False,
                        headers={"Host": endpoint.host_header, "User-Agent": USER_AGENT,
                                 "Accept-Encoding": "identity"},
                        server_hostname=endpoint.host if endpoint.url.scheme == "https" else None)
            except AddressRefused as exc:
                raise AttemptFailed(FetchFailure.ADDRESS_REFUSED, f"{endpoint.host} resolves to a {exc.reason} "
                                    "address, which Weir does not connect to") from None
            except NameNotResolved as exc:
                raise AttemptFailed(FetchFailure.DNS_FAILED, f"{endpoint.host} did not resolve: {exc}") from None
            except TimeoutError:
                raise AttemptFailed(FetchFailure.TIMEOUT, f"{endpoint.host} did not answer within "
                                    f"{s.import_read_timeout_seconds:g} s") from None
            except (aiohttp.ClientResponseError, aiohttp.ServerDisconnectedError) as exc:
                raise AttemptFailed(FetchFailure.PROTOCOL_ERROR, f"{endpoint.host} sent no HTTP answer "
                                    f"({type(exc).__name__})") from None
            except (aiohttp.ClientError, OSError) as exc:
                raise AttemptFailed(FetchFailure.CONNECT_FAILED, f"could not connect to {endpoint.host} "
                                    f"({type(exc).__name__})") from None
            if response.status in REDIRECTS:
                location = response.headers.get("Location")
                response.close()
                if not location:
                    raise AttemptFailed(FetchFailure.BAD_REDIRECT, f"a {response.status} without a Location")
                try:
                    url = str(httpx.URL(url).join(location))
                except httpx.InvalidURL as exc:
                    raise AttemptFailed(FetchFailure.BAD_REDIRECT, f"a redirect to no URL: {exc}") from None
                log.info("imports: hop %d: redirected to %s", hop + 1, domain.shown_import_url(url))
                continue
            if response.status != 200:
                response.close()
                raise AttemptFailed(FetchFailure.HTTP_STATUS, f"the URL answered {response.status}",
                                    status=response.status,
                                    retry_after=retry_after_seconds(response.headers.get("Retry-After")))
            return response
        raise AttemptFailed(FetchFailure.TOO_MANY_REDIRECTS, f"more than {s.import_max_redirects} redirects")

    async def _read_into_storage(self, video: store.Video, attempt: int) -> tuple[list[tuple[int, str]], int]:
        """The URL's body stored as the video's multipart upload, part by part (the lease renewed with each):
        the parts and the size read."""
        s = self.settings
        assert video.import_job is not None
        if video.upload_id is not None:  # an earlier attempt's, whose instance died: this one starts afresh
            async with self.videos.pool.acquire() as conn, conn.transaction():
                if await self._held(conn, video.id, attempt) is None:
                    raise AttemptEnded
        async with guarded_client(concurrency=1, tls=self.tls) as client:
            response = await self.open_url(client, video.import_job.url)
            try:
                said = response.content_length
                if said is not None and said > s.import_max_bytes:
                    raise AttemptFailed(FetchFailure.TOO_LARGE, f"the file is {said} bytes, more than the "
                                        f"{s.import_max_bytes} an import reads")
                try:
                    opened = await self.videos.initiate(video.id, video.app_id,
                                                        content_type_of(response.headers.get("Content-Type")),
                                                        by_import=True)
                except Problem as refused:
                    raise AttemptEnded from refused  # retired or deleted since the claim
                upload_id: str = opened["upload_id"]
                parts: list[tuple[int, str]] = []
                pending: list[bytes] = []  # the next part's chunks (joined once: one copy)
                pending_bytes = read = 0
                # parts are stored while the next is read, up to `import_parts_in_flight` at once: the URL's bytes
                # and storage's writes overlap instead of taking turns, and storage takes parts side by side, as
                # from a browser (bench.imports)
                storing: collections.deque[asyncio.Task[str]] = collections.deque()

                async def stored(most: int) -> None:
                    """Wait for the oldest parts until at most `most` are in flight."""
                    while len(storing) > most:
                        try:
                            etag = await storing[0]
                        except STORAGE_ERRORS as exc:
                            raise AttemptFailed(FetchFailure.STORAGE, f"storage did not take a part "
                                                f"({type(exc).__name__})") from None
                        storing.popleft()
                        parts.append((len(parts) + 1, etag))
                        await self._renew(video.id, attempt, read)

                async def store_part() -> None:
                    nonlocal pending_bytes
                    await stored(s.import_parts_in_flight - 1)
                    storing.append(asyncio.create_task(self.videos.objects.upload_part(
                        video.object_key, upload_id, len(parts) + len(storing) + 1, b"".join(pending))))
                    pending.clear()
                    pending_bytes = 0

                try:
                    while True:
                        chunk = await self._next_chunk(response)
                        if not chunk:
                            break
                        read += len(chunk)
                        if read > s.import_max_bytes:
                            raise AttemptFailed(FetchFailure.TOO_LARGE, f"the file is more than the "
                                                f"{s.import_max_bytes} bytes an import reads")
                        pending.append(chunk)
                        pending_bytes += len(chunk)
                        if pending_bytes >= s.import_part_bytes:
                            await store_part()
                    if read == 0:
                        raise AttemptFailed(FetchFailure.EMPTY, "the URL answered 200 with no bytes")
                    if said is not None and read != said:
                        raise AttemptFailed(FetchFailure.PROTOCOL_ERROR, f"the answer ended after {read} of its "
                                            f"{said} bytes")
                    if pending:
                        await store_part()
                    await stored(0)
                finally:
                    for task in storing:  # failed or cancelled mid-read: the parts in flight are not waited for
                        task.cancel()
                    await asyncio.gather(*storing, return_exceptions=True)
                return parts, read
            finally:
                response.close()

    async def _next_chunk(self, response: aiohttp.ClientResponse) -> bytes:
        try:
            async with asyncio.timeout(self.settings.import_read_timeout_seconds):
                return await response.content.read(READ_CHUNK)
        except TimeoutError:
            raise AttemptFailed(FetchFailure.TIMEOUT, f"no bytes for {self.settings.import_read_timeout_seconds:g}"
                                " s") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise AttemptFailed(FetchFailure.PROTOCOL_ERROR, f"the answer was cut off ({type(exc).__name__})"
                                ) from None

    async def _renew(self, video_id: str, attempt: int, read: int) -> None:
        async with self.videos.pool.acquire() as conn:
            status = await store.renew_import(conn, video_id, attempt, read, self.settings.import_lease_seconds)
        if status is None or status in GONE:
            raise AttemptEnded

    # ------------------------------------------------------------------------------------------- ending

    async def _complete(self, video: store.Video, attempt: int, parts: list[tuple[int, str]], size: int) -> None:
        """The upload completed as the upload routes complete one, then the import ended."""
        try:
            await self.videos.complete(video.id, video.app_id, parts, key_id=video.key_id, by_import=True)
        except Problem as refused:
            if refused.code == "unsupported_file":  # the video is failed, `video.failed` said so: the import too
                async with self.videos.pool.acquire() as conn:
                    await store.end_import(conn, video.id, attempt, ImportState.FAILED, read=size, error={
                        "code": "unsupported_file", "message": refused.detail, "attempt": attempt,
                        "at": datetime.now(UTC).isoformat()})
                self._count("unsupported_file")
                return
            if refused.status == 409:
                raise AttemptEnded from refused
            raise AttemptFailed(FetchFailure.STORAGE, f"storage did not assemble the file: {refused.detail}"
                                ) from refused
        async with self.videos.pool.acquire() as conn:
            await store.end_import(conn, video.id, attempt, ImportState.COMPLETED, read=size)
        self._count("completed")
        log.info("imports: %s: %d bytes stored in %d parts (attempt %d)", video.id, size, len(parts), attempt)

    async def _failed(self, video: store.Video, attempt: int, failed: AttemptFailed) -> None:
        """A failed attempt: retried later, or the import and its video failed for good. Either way the attempt's
        upload is aborted (the next attempt starts afresh), under the row lock."""
        s = self.settings
        delay = None
        if domain.import_retried(failed.failure, failed.status):
            delay = domain.import_retry_delay(attempt, max_attempts=s.import_max_attempts,
                                              base_seconds=s.import_retry_base_seconds, spread=random.random(),
                                              retry_after=failed.retry_after)
        assert video.import_job is not None
        log.info("imports: %s: attempt %d failed (%s: %s); %s", video.id, attempt, failed.failure, failed.message,
                 f"again in {delay:.1f} s" if delay is not None else "given up")
        async with self.videos.pool.acquire() as conn, conn.transaction():
            current = await self._held(conn, video.id, attempt)
            if current is None:
                return
            if current.status in GONE:
                await store.end_import(conn, video.id, attempt, ImportState.CANCELLED)
                return
            if delay is not None:
                await store.retry_import(conn, video.id, attempt, failed.shown(attempt), delay)
                self._count("retried")
                return
            tries = f" (attempt {attempt} of {s.import_max_attempts})" if attempt > 1 else ""
            await store.mark_failed(conn, current, "import_failed", f"the import from "
                                    f"{domain.shown_import_url(video.import_job.url)} failed{tries}: {failed.message}")
            await store.end_import(conn, video.id, attempt, ImportState.FAILED, error=failed.shown(attempt))
        self._count("failed")

    async def _ended(self, video: store.Video, attempt: int) -> None:
        async with self.videos.pool.acquire() as conn, conn.transaction():
            if await self._held(conn, video.id, attempt) is not None:
                await store.end_import(conn, video.id, attempt, ImportState.CANCELLED)
                self._count("cancelled")

    async def _give_back(self, video: store.Video, attempt: int) -> None:
        """On stop: the import queued again at once (for another instance), its upload aborted; best effort (a
        lapsed lease does the same later)."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(5):
                async with self.videos.pool.acquire() as conn, conn.transaction():
                    if await self._held(conn, video.id, attempt) is not None:
                        await store.retry_import(conn, video.id, attempt, {
                            "code": "interrupted", "message": "the api instance stopped mid-import",
                            "attempt": attempt, "at": datetime.now(UTC).isoformat()}, 0)

    async def _held(self, conn: asyncpg.Connection, video_id: str, attempt: int) -> store.Video | None:
        """The video, locked, if this attempt still holds its import (its upload, if any, aborted); else None."""
        current = await store.get(conn, video_id, lock=True)
        job = current.import_job if current is not None else None
        if current is None or job is None or job.state is not ImportState.FETCHING or job.attempts != attempt:
            return None
        if current.upload_id is not None:
            with contextlib.suppress(*STORAGE_ERRORS):
                await self.videos.objects.abort(current.object_key, current.upload_id)
            await store.clear_upload(conn, video_id)
        return current

    def _count(self, outcome: str) -> None:
        self.metrics.inc("imports_total", help="imports from a URL by how an attempt ended (completed, retried, "
                         "failed, unsupported_file, cancelled)", outcome=outcome)
