"""A worker's decisions: which offers it takes (every combination up to 4 slots), the ffmpeg command, its progress."""

from __future__ import annotations

import itertools

import pytest

from services.media.domain import (
    EncodeOptions,
    ProgressReader,
    Refusal,
    Slotted,
    admission,
    developer_capacity,
    duration_seconds,
    encode_args,
    progress_fraction,
    scale_filter,
)
from services.media.settings import MediaSettings
from shared.media.content import Container
from shared.videos import JobClass

LARGE = MediaSettings().large_output_height
DEV, FIRST = JobClass.DEVELOPER, JobClass.FIRST_PARTY
KINDS = [Slotted(c, h) for c in JobClass for h in (360, 1080, LARGE, 2160)]


def expected(slots: int, running: tuple[Slotted, ...], offered: Slotted, leaving: bool) -> Refusal | None:
    """SPEC section 6, sentence by sentence."""
    if leaving:
        return Refusal.LEAVING
    if len(running) >= slots:  # a worker that cannot take a job answers busy; it never queues
        return Refusal.FULL
    developers = [j for j in running if j.job_class == DEV]
    if offered.job_class == DEV and len(developers) >= slots - 1:  # one slot kept for first-party jobs
        return Refusal.RESERVED
    if offered.job_class == DEV and offered.height >= LARGE and any(j.height >= LARGE for j in developers):
        return Refusal.LARGE_RUNNING  # at most one large developer output at a time
    return None


@pytest.mark.parametrize("slots", [1, 2, 3, 4])
@pytest.mark.parametrize("leaving", [False, True])
def test_admission_over_every_combination_of_running_jobs(slots: int, leaving: bool) -> None:
    cases = 0
    for n in range(slots + 1):
        for running in itertools.combinations_with_replacement(KINDS, n):
            for offered in KINDS:
                refusal = admission(slots, running, offered, large_height=LARGE, leaving=leaving)
                assert refusal == expected(slots, running, offered, leaving)
                cases += 1
    assert cases > 0


def test_with_developer_jobs_filling_a_worker_a_first_party_job_is_still_accepted() -> None:
    slots = 3
    running = [Slotted(DEV, 720)] * developer_capacity(slots)
    assert admission(slots, running, Slotted(DEV, 360), large_height=LARGE) == Refusal.RESERVED
    assert admission(slots, running, Slotted(FIRST, 2160), large_height=LARGE) is None
    assert admission(slots, [*running, Slotted(FIRST, 360)], Slotted(FIRST, 360), large_height=LARGE) == Refusal.FULL


def test_a_second_large_developer_job_is_refused_by_a_worker_running_one() -> None:
    running = [Slotted(DEV, LARGE)]
    assert admission(4, running, Slotted(DEV, LARGE), large_height=LARGE) == Refusal.LARGE_RUNNING
    assert admission(4, running, Slotted(DEV, 2 * LARGE), large_height=LARGE) == Refusal.LARGE_RUNNING
    assert admission(4, running, Slotted(DEV, LARGE - 2), large_height=LARGE) is None
    assert admission(4, running, Slotted(FIRST, 2 * LARGE), large_height=LARGE) is None  # for developer outputs
    assert admission(4, [Slotted(FIRST, 2 * LARGE)], Slotted(DEV, 2 * LARGE), large_height=LARGE) is None


def test_the_large_threshold_is_the_setting() -> None:
    running = [Slotted(DEV, 720)]
    assert admission(4, running, Slotted(DEV, 1080), large_height=720) == Refusal.LARGE_RUNNING
    assert admission(4, running, Slotted(DEV, 1080), large_height=1081) is None


def test_one_slot_means_first_party_only_and_the_default_is_half_the_cores() -> None:
    assert developer_capacity(1) == 0 and admission(1, [], Slotted(DEV, 360), large_height=LARGE) == Refusal.RESERVED
    assert admission(1, [], Slotted(FIRST, 360), large_height=LARGE) is None
    assert MediaSettings().media_slots >= 1


# ------------------------------------------------------------------------------------------------- ffmpeg


def test_the_command_encodes_h264_aac_mp4_at_the_height_without_upscaling() -> None:
    args = encode_args("https://s3/x?sig", skip=0, container=Container.MP4, height=720, output="/tmp/o.mp4",
                       options=EncodeOptions(preset="veryfast", crf=23, audio_bitrate_kbps=128))
    joined = " ".join(args)
    assert args[args.index("-i") + 1] == "https://s3/x?sig"
    assert "-c:v libx264 -preset veryfast -crf 23 -pix_fmt yuv420p" in joined
    assert "-c:a aac -b:a 128k" in joined and "-map 0:a:0?" in joined  # audio when there is some
    assert args[args.index("-vf") + 1] == scale_filter(720) == "scale=-2:'trunc(min(ih,720)/2)*2'"
    assert "-progress pipe:1" in joined and args[-3:] == ["-f", "mp4", "/tmp/o.mp4"]
    assert "-readrate" not in args and args[args.index("-f") + 1] == "mov"
    assert "-format_whitelist" in args and "subfile" not in joined


def test_a_source_behind_id3_tags_is_read_through_subfile_and_read_rate_applies_to_the_input() -> None:
    args = encode_args("https://s3/x", skip=1353, container=Container.MATROSKA, height=360, output="o.mp4",
                       options=EncodeOptions(read_rate=1))
    assert args[args.index("-i") + 1] == "subfile,,start,1353,end,0,,:https://s3/x"
    assert "subfile" in args[args.index("-protocol_whitelist") + 1]
    assert args.index("-readrate") < args.index("-i") and args[args.index("-readrate") + 1] == "1"
    assert args[args.index("-f") + 1] == "matroska"


PROGRESS = """frame=25
fps=0.00
out_time_us=N/A
progress=continue
frame=50
out_time_us=1000000
out_time_ms=1000000
progress=continue
frame=100
out_time_us=2000000
progress=continue
out_time_us=4000000
progress=end
"""


def test_progress_is_read_from_ffmpeg_blocks() -> None:
    assert duration_seconds("  Duration: 00:00:04.00, start: 0.000000, bitrate: 347 kb/s") == 4.0
    assert duration_seconds("  Duration: 01:02:03.50, start: 0") == 3723.5
    assert duration_seconds("  Duration: N/A, bitrate: N/A") is None
    assert duration_seconds("Stream #0:0: Video: h264") is None
    reader = ProgressReader(duration=4.0)
    fractions = [f for line in PROGRESS.splitlines() if (f := reader.feed(line)) is not None]
    assert fractions == [0.25, 0.5, 1.0] and reader.ended and reader.out_time_seconds == 4.0
    unknown = ProgressReader()
    assert [unknown.feed(line) for line in PROGRESS.splitlines()][-1] == 1.0
    assert progress_fraction(5_000_000, 4.0) == 0.999  # never done before ffmpeg says so
    assert progress_fraction(None, 4.0) is None and progress_fraction(1, 0) is None
