"""The videos vocabulary, declared once: statuses, encode's processing and output states, job classes, the sweep's
candidate rule and the large-output rule.

The SQL CHECKs and the stores' literals are tested against these sets (tests/unit/test_videos_vocabulary.py). A value
a newer release adds to a closed set is read with the fallback named here (SPEC section 11).
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Final

from pydantic import BeforeValidator

from shared.tolerant import Fallback


class VideoStatus(StrEnum):
    """A video's status as the api keeps and shows it (SPEC section 4)."""

    CREATED = "created"
    UPLOADING = "uploading"
    UPLOADED = "uploaded"
    PROCESSING = "processing"
    READY = "ready"
    FAILED = "failed"
    RETIRED = "retired"
    DELETED = "deleted"


GONE: Final = frozenset({VideoStatus.RETIRED, VideoStatus.DELETED})
"""Not listed, take no upload, never a sweep candidate."""

NO_FILE_YET: Final = frozenset({VideoStatus.CREATED, VideoStatus.UPLOADING})
"""May open an upload; the only statuses that may become retired (SPEC section 4)."""

BEFORE_PROCESSING: Final = frozenset({VideoStatus.CREATED, VideoStatus.UPLOADING, VideoStatus.UPLOADED})
"""An encode.started moves these to processing."""


class ProcessingState(StrEnum):
    """encode's state of a video's processing: the statuses a video has while and after encode holds it."""

    PROCESSING = VideoStatus.PROCESSING.value
    READY = VideoStatus.READY.value
    FAILED = VideoStatus.FAILED.value
    DELETED = VideoStatus.DELETED.value  # video.deleted: processing stops for good, whatever state it was in


class OutputState(StrEnum):
    """encode's stored state of one output."""

    PENDING = "pending"  # waiting for a round
    OFFERED = "offered"  # an offer is out (or its answer was lost): not offered again until that is settled
    ENCODING = "encoding"  # a worker accepted this attempt
    DONE = "done"
    CANCELLED = "cancelled"  # its video was deleted: never offered again; a result of it is stale


class ShownOutputState(StrEnum):
    """An output as `GET /v1/videos/{id}` shows it: from encode.status, or from the api's projection of events."""

    PENDING = "pending"
    ENCODING = "encoding"
    DONE = "done"
    FAILED = "failed"  # the projection's: an attempt failed (encode offers it again, and shows it pending)
    CANCELLED = "cancelled"  # the video was deleted


def shown_output_state(state: OutputState) -> ShownOutputState:
    """An offer in doubt is still pending to whoever asks."""
    return ShownOutputState.PENDING if state is OutputState.OFFERED else ShownOutputState(state.value)


class JobClass(StrEnum):
    DEVELOPER = "developer"  # from upload.completed
    FIRST_PARTY = "first_party"  # from recording.completed, published by the platform's own services


def is_large_output(job_class: JobClass, height: int, large_height: int) -> bool:
    """At most one developer output this tall runs on a worker at a time (SPEC section 6; the threshold is the
    `large_output_height` setting)."""
    return job_class == JobClass.DEVELOPER and height >= large_height


# ------------------------------------------------------------------------------ reading a newer release's values


def read_job_class(value: Any) -> Any:
    """An unknown job class is a developer job: the stricter class (the reserved slot and the large rule apply)."""
    return known_or(value, frozenset(JobClass), JobClass.DEVELOPER)


def read_shown_output_state(value: Any) -> Any:
    """An unknown output state shows as pending: not done, no rendition yet."""
    return known_or(value, frozenset(ShownOutputState), ShownOutputState.PENDING)


def read_processing_state(value: Any) -> Any:
    """An unknown processing state reads as None: the api shows its own status (from encode's events)."""
    return known_or(value, frozenset(ProcessingState), None)


def known_or(value: Any, known: frozenset[str], fallback: Any) -> Any:
    """A string outside `known` becomes `fallback`; anything else is left for the model to validate (or refuse)."""
    return fallback if isinstance(value, str) and value not in known else value


# each marked with its fallback in its JSON schema (the contract check: a new value breaks no reader)
TolerantJobClass = Annotated[JobClass, BeforeValidator(read_job_class), Fallback(JobClass.DEVELOPER)]
TolerantShownOutputState = Annotated[ShownOutputState, BeforeValidator(read_shown_output_state),
                                     Fallback(ShownOutputState.PENDING)]
TolerantProcessingState = Annotated[ProcessingState | None, BeforeValidator(read_processing_state), Fallback(None)]


class ImportState(StrEnum):
    """An import's state (`POST /v1/videos/{id}/import`, the api's importer), shown as `import.state`."""

    QUEUED = "queued"  # waiting for its first attempt, or for the next one after a failure worth retrying
    FETCHING = "fetching"  # an api instance holds it (a lease), reading the URL into storage
    COMPLETED = "completed"  # the file is recorded: the video goes on as an upload completed
    FAILED = "failed"  # given up: the video is failed, reason `import_failed` (or `unsupported_file`)
    CANCELLED = "cancelled"  # the video was deleted or retired meanwhile


IMPORT_ACTIVE: Final = frozenset({ImportState.QUEUED, ImportState.FETCHING})
"""An import on its way: the upload routes refuse the video, and the sweep leaves it (its file is coming)."""


# ------------------------------------------------------------------------------------- the sweep's candidates


def sql_list(values: Iterable[str]) -> str:
    """`('a', 'b')`, sorted: the SQL form of a set of this module's values (no quotes inside them)."""
    return "(" + ", ".join(f"'{v}'" for v in sorted(values)) + ")"


RETIRABLE: Final = NO_FILE_YET

SWEEP_CANDIDATE_SQL: Final = (
    f"file_recorded_at IS NULL AND status NOT IN {sql_list(GONE)} AND status IN {sql_list(RETIRABLE)}"
    f" AND created_at < $1 AND (import_state IS NULL OR import_state NOT IN {sql_list(IMPORT_ACTIVE)})"
)
"""`is_sweep_candidate` as the sweep's queries run it ($1: the cutoff). `NOT IN` GONE repeats the predicate of the
index videos_sweep_candidates, so PostgreSQL reads candidates through it."""


def is_sweep_candidate(status: str, file_recorded_at: datetime | None, created_at: datetime, *,
                       cutoff: datetime, import_state: str | None = None) -> bool:
    """SPEC section 5: created before the cutoff, its file never recorded, and still retirable; not while an import
    from a URL is on its way (between two attempts no upload is open to show it: the import ends within a quarter
    hour, failing the video if it never gets the file)."""
    return (file_recorded_at is None and status not in GONE and status in RETIRABLE and created_at < cutoff
            and import_state not in IMPORT_ACTIVE)
