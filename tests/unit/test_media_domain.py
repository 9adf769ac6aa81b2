"""A worker's decisions: which offers it takes (every combination up to 4 slots), the ffmpeg command, its progress."""

from __future__ import annotations

import itertools
import math
import os
import re
import struct
import subprocess
from functools import cache

import pytest
from pydantic import ValidationError

from services.media.domain import (
    HLS_INIT,
    HLS_PLAYLIST,
    SPRITE,
    EncodeOptions,
    ProgressReader,
    Refusal,
    Slotted,
    StoryboardPlan,
    admission,
    content_type,
    developer_capacity,
    duration_seconds,
    encode_args,
    ffmpeg_niceness,
    height_cap_filter,
    hls_args,
    jpeg_size,
    keyframe_args,
    poster_args,
    poster_time,
    progress_fraction,
    scale_filter,
    storyboard_args,
    storyboard_plan,
    storyboard_tile,
    storyboard_vtt,
)
from services.media.settings import MediaSettings
from services.media.worker import child_setup
from shared.media.content import Container
from shared.media.probe import ffmpeg_exe
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
    assert args[args.index("-vf") + 1] == scale_filter(720) == (
        "scale=w='if(gte(iw,ih),-2,trunc(min(iw,720)/2)*2)':h='if(gte(iw,ih),trunc(min(ih,720)/2)*2,-2)'")
    assert "-progress pipe:1" in joined and args[-3:] == ["-f", "mp4", "/tmp/o.mp4"]
    assert "-readrate" not in args and args[args.index("-f") + 1] == "mov"
    assert "-format_whitelist" in args and "subfile" not in joined


def test_keyframes_are_forced_at_every_multiple_of_the_interval_and_nowhere_else() -> None:
    seconds = MediaSettings().media_keyframe_seconds
    args = encode_args("in.mp4", skip=0, container=Container.MP4, height=360, output="o.mp4",
                       options=EncodeOptions(keyframe_seconds=seconds))
    assert args[args.index("-force_key_frames") + 1] == f"expr:gte(t,n_forced*{seconds:g})"
    assert args[args.index("-sc_threshold") + 1] == "0"  # no scene-cut keyframes: they would differ by rendition
    assert keyframe_args(1.5) == ["-force_key_frames", "expr:gte(t,n_forced*1.5)", "-sc_threshold", "0"]
    for flag in ("-r", "-fps_mode", "-vsync"):  # every rendition keeps the source's frames and their times
        assert flag not in args
    assert args.index("-force_key_frames") > args.index("-c:v")  # an output option, of the video encoder


def test_a_source_behind_id3_tags_is_read_through_subfile_and_read_rate_applies_to_the_input() -> None:
    args = encode_args("https://s3/x", skip=1353, container=Container.MATROSKA, height=360, output="o.mp4",
                       options=EncodeOptions(read_rate=1))
    assert args[args.index("-i") + 1] == "subfile,,start,1353,end,0,,:https://s3/x"
    assert "subfile" in args[args.index("-protocol_whitelist") + 1]
    assert args.index("-readrate") < args.index("-i") and args[args.index("-readrate") + 1] == "1"
    assert args[args.index("-f") + 1] == "matroska"


# ------------------------------------------------------------------------------------ the size of a rendition
#
# `scaled` is what ffmpeg's scale filter makes of a picture (its w and h expressions evaluated as ffmpeg does, then its
# rules for 0 and -n), checked against the real ffmpeg below; the tests of scale_filter run it over many sizes.

_FUNCTIONS = {"if_": lambda cond, then, other: then if cond else other, "gte": lambda a, b: float(a >= b),
              "trunc": math.trunc, "min": min}


@cache
def _compiled(expr: str) -> object:
    py = re.sub(r"\bif\(", "if_(", expr)
    assert re.fullmatch(r"[\w().,*/+\- ]*", py), expr
    return compile(py, "<scale expression>", "eval")


def _expressions(scale: str) -> tuple[str, str]:
    """The w and h of a `scale=` filter, positional or named (w=, h=), quotes removed."""
    assert scale.startswith("scale=")
    parts, current, quoted = [], "", False
    for ch in scale[len("scale="):]:
        if ch == "'":
            quoted = not quoted
        elif ch == ":" and not quoted:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    named = dict(p.split("=", 1) for p in parts if re.match(r"(w|h)=", p))
    positional = [p for p in parts if not re.match(r"(w|h)=", p)] + ["iw", "ih"]
    return named.get("w", positional[0]), named.get("h", positional[1])


def _rescale(a: int, b: int, c: int) -> int:
    return (a * b + c // 2) // c  # av_rescale: a * b / c rounded to the nearest, halves up


def scaled(scale: str, iw: int, ih: int) -> tuple[int, int]:
    """(width, height) ffmpeg's scale filter makes of an iw x ih picture (libavfilter/scale_eval.c): each expression
    cast to int, 0 meaning the input's; then -n keeps the aspect ratio from the other side, a multiple of n."""
    w_expr, h_expr = _expressions(scale)
    names = {**_FUNCTIONS, "iw": iw, "ih": ih, "__builtins__": {}}
    w = int(eval(_compiled(w_expr), names)) or iw  # type: ignore[arg-type]
    h = int(eval(_compiled(h_expr), names)) or ih  # type: ignore[arg-type]
    factor_w, factor_h = (-w if w < -1 else 1), (-h if h < -1 else 1)
    if w < 0 and h < 0:
        w, h = iw, ih
    if w < 0:
        w = _rescale(h, iw, ih * factor_w) * factor_w
    if h < 0:
        h = _rescale(w, ih, iw * factor_h) * factor_h
    return w, h


RUNGS = (2, 240, 358, 360, 720, 1080, 1440, 2160)
EDGES = sorted({*range(1, 41), 199, 200, 201, 202, 239, 240, 241, *range(356, 364), 426, 427, 479, 480, 481,
                *range(638, 644), *range(717, 724), 853, 854, 855, 1079, 1080, 1081, 1279, 1280, 1281, 1439, 1440,
                1441, 1919, 1920, 1921, 2159, 2160, 2161, 2560, 3840, 4320})
"""Every width and height tried: tiny, odd and even, around each rung and the usual sizes of both orientations."""


@pytest.mark.parametrize("rung", RUNGS)
def test_a_rendition_is_its_rung_on_its_shorter_side_whatever_the_orientation(rung: int) -> None:
    """Every pair of EDGES as (width, height): landscape, square and portrait, odd sizes and sources below the rung."""
    scale = scale_filter(rung)
    for iw, ih in itertools.product(EDGES, EDGES):
        ow, oh = scaled(scale, iw, ih)
        short_in, long_in = min(iw, ih), max(iw, ih)
        independent, dependent = (oh, ow) if iw >= ih else (ow, oh)  # the side set, the side that follows
        # the shorter side is the rung; never up: a source smaller than it keeps its shorter side, made even
        wanted = rung if short_in >= rung else (short_in // 2 * 2 or short_in)
        assert independent == wanted, (iw, ih, rung, ow, oh)
        # the other side keeps the aspect ratio, rounded to even: at most one pixel off
        assert dependent % 2 == 0 and abs(dependent - independent * long_in / short_in) <= 1, (iw, ih, rung, ow, oh)
        assert ow <= iw + 1 and oh <= ih + 1, (iw, ih, rung, ow, oh)  # one pixel at most: an odd side made even
        if short_in >= 2:
            assert ow % 2 == 0 and oh % 2 == 0, (iw, ih, rung, ow, oh)  # H.264 in 4:2:0
        # landscape and square as before (the height capped); portrait is landscape turned a quarter
        if iw >= ih:
            assert (ow, oh) == scaled(height_cap_filter(rung), iw, ih), (iw, ih, rung)
        else:
            assert (ow, oh) == scaled(scale, ih, iw)[::-1], (iw, ih, rung)


@pytest.mark.parametrize(("source", "rung", "output"), [
    ((1920, 1080), 720, (1280, 720)), ((1280, 720), 360, (640, 360)), ((1280, 720), 1080, (1280, 720)),
    ((720, 720), 360, (360, 360)), ((641, 359), 360, (640, 358)), ((426, 240), 240, (426, 240)),
    ((360, 640), 360, (360, 640)), ((720, 1280), 360, (360, 640)), ((720, 1280), 720, (720, 1280)),
    ((1080, 1920), 1080, (1080, 1920)), ((1080, 1920), 720, (720, 1280)), ((1080, 1920), 1440, (1080, 1920)),
    ((2160, 3840), 2160, (2160, 3840)), ((480, 848), 360, (360, 636)), ((1081, 1921), 1080, (1080, 1920)),
    ((241, 427), 240, (240, 426)), ((201, 359), 200, (200, 358)), ((359, 641), 358, (358, 640)),
    ((361, 641), 358, (358, 636)), ((360, 641), 360, (360, 642)), ((641, 360), 360, (642, 360)),
])  # fmt: skip
def test_portrait_renditions_are_served_at_their_own_size(source: tuple[int, int], rung: int,
                                                         output: tuple[int, int]) -> None:
    assert scaled(scale_filter(rung), *source) == output


def test_the_poster_cap_stays_on_the_height_whatever_the_orientation() -> None:
    assert scaled(height_cap_filter(720), 1920, 1080) == (1280, 720)
    assert scaled(height_cap_filter(720), 1080, 1920) == (406, 720)
    assert scaled(height_cap_filter(720), 360, 640) == (360, 640)


FFMPEG_SIZES = [(1920, 1080), (1280, 720), (641, 359), (641, 360), (720, 720), (359, 359), (3, 3), (7, 5), (1, 1),
                (1080, 1920), (720, 1280), (360, 640), (360, 641), (1081, 1921), (480, 848), (241, 427), (201, 359),
                (5, 7), (3, 1)]


def test_scaled_is_what_the_real_ffmpeg_makes() -> None:
    """The model above against the ffmpeg the workers run (imageio-ffmpeg's): one frame of each size through every
    filter at once (one output each), the sizes read from its description of the outputs."""
    filters = [*(scale_filter(r) for r in (2, 240, 358, 360, 720, 1080)), height_cap_filter(720)]
    for iw, ih in FFMPEG_SIZES:
        args = [ffmpeg_exe(), "-hide_banner", "-nostdin", "-f", "lavfi", "-i", f"color=size={iw}x{ih}:duration=0.04"]
        for f in filters:
            args += ["-map", "0:v", "-vf", f, "-frames:v", "1", "-f", "null", "-"]
        run = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr[-2000:]
        # the outputs are described in the order their muxers start, not always in theirs
        found = re.findall(r"^Output #(\d+), null.*?^\s*Stream #\1:0: Video: [^\n]*?, (\d+)x(\d+)", run.stderr,
                           re.MULTILINE | re.DOTALL)
        made = [(int(w), int(h)) for _, w, h in sorted(found, key=lambda m: int(m[0]))]
        assert made == [scaled(f, iw, ih) for f in filters], (iw, ih, made)


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


# -------------------------------------------------------------------------------------------------- HLS


def test_hls_packaging_remuxes_the_rendition_to_fmp4_segments_of_the_setting() -> None:
    seconds = MediaSettings().media_hls_segment_seconds
    args = hls_args("/w/r.mp4", "/w/hls", segment_seconds=seconds)
    joined = " ".join(args)
    assert args[args.index("-i") + 1] == "/w/r.mp4" and "-c copy" in joined  # no second encode
    assert "-f hls -hls_segment_type fmp4" in joined and args[args.index("-hls_time") + 1] == f"{seconds:g}"
    assert args[args.index("-hls_playlist_type") + 1] == "vod"
    assert args[args.index("-hls_fmp4_init_filename") + 1] == HLS_INIT
    assert args[args.index("-hls_segment_filename") + 1] == "/w/hls/seg-%05d.m4s"
    assert args[-1] == f"/w/hls/{HLS_PLAYLIST}"


def test_files_are_stored_with_their_content_types() -> None:
    assert content_type(HLS_PLAYLIST) == "application/vnd.apple.mpegurl"
    assert content_type(HLS_INIT) == "video/mp4" and content_type("seg-00001.m4s") == "video/iso.segment"
    assert content_type(SPRITE) == "image/jpeg" and content_type("storyboard.vtt") == "text/vtt"
    assert content_type("x.bin") == "application/octet-stream"


def test_segments_must_be_a_whole_number_of_keyframe_intervals() -> None:
    assert MediaSettings(media_keyframe_seconds=2, media_hls_segment_seconds=6).media_hls_segment_seconds == 6
    assert MediaSettings(media_keyframe_seconds=0.5, media_hls_segment_seconds=2).media_keyframe_seconds == 0.5
    for keyframe, segment in ((2, 5), (2, 1), (3, 4)):
        with pytest.raises(ValidationError):
            MediaSettings(media_keyframe_seconds=keyframe, media_hls_segment_seconds=segment)


# ----------------------------------------------------------------------------------- poster and storyboard


def test_the_poster_time_stays_inside_the_video() -> None:
    wanted = MediaSettings().media_poster_seconds
    assert poster_time(wanted, 10 * wanted) == wanted
    assert poster_time(wanted, wanted) == round(wanted / 2, 3)  # a video no longer than the time: its middle
    assert poster_time(-1, 10) == 0 and poster_time(wanted, 0) == 0


def test_the_poster_is_one_frame_of_the_source_at_its_time_capped_in_height() -> None:
    cap = MediaSettings().media_poster_max_height
    args = poster_args("https://s3/x?sig", skip=10, container=Container.MP4, at=1.25, max_height=cap, output="p.jpg",
                       quality=5)
    assert args.index("-ss") < args.index("-i") and args[args.index("-ss") + 1] == "1.250"  # an input seek
    assert args[args.index("-i") + 1] == "subfile,,start,10,end,0,,:https://s3/x?sig"
    assert args[args.index("-vf") + 1] == height_cap_filter(cap) and args[args.index("-frames:v") + 1] == "1"
    assert height_cap_filter(720) == "scale=-2:'trunc(min(ih,720)/2)*2'"  # at most `cap` lines tall, portrait too
    assert args[-1] == "p.jpg" and "-format_whitelist" in args


@pytest.mark.parametrize("duration", [0.2, 1, 2, 2.04, 9.96, 10, 10.04, 59, 199.9, 200, 200.1, 399, 401, 3600, 86400])
def test_storyboard_tiles_are_keyframes_at_most_the_setting_and_cover_the_video(duration: float) -> None:
    s = MediaSettings()
    plan = storyboard_plan(duration, keyframe_seconds=s.media_keyframe_seconds, max_tiles=s.media_storyboard_max_tiles,
                           columns=s.media_storyboard_columns)
    steps = plan.interval / s.media_keyframe_seconds
    assert steps >= 1 and steps == int(steps)  # every tile falls on a keyframe
    assert 1 <= plan.tiles <= s.media_storyboard_max_tiles
    assert plan.tiles * plan.interval >= duration - 1e-9  # together they cover the video
    assert (plan.tiles - 1) * plan.interval < duration or plan.tiles == 1  # and no tile starts past its end
    # as fine as allowed: one keyframe interval, or a longer one only where that would make too many tiles
    assert plan.interval == s.media_keyframe_seconds or plan.tiles > s.media_storyboard_max_tiles / 2
    assert plan.columns == min(s.media_storyboard_columns, plan.tiles)
    assert plan.rows == math.ceil(plan.tiles / plan.columns) and plan.rows * plan.columns >= plan.tiles


def test_the_sprite_keeps_one_keyframe_per_interval_tiled_by_the_plan() -> None:
    plan = StoryboardPlan(interval=6.0, tiles=23, columns=10, rows=3)
    args = storyboard_args("/w/r.mp4", plan=plan, keyframe_seconds=2, tile_width=160, output="/w/sprite.jpg",
                           quality=5)
    assert args.index("-skip_frame") < args.index("-i") and args[args.index("-skip_frame") + 1] == "nokey"
    chain = args[args.index("-vf") + 1].split(",showinfo,")
    assert chain[0] == "select='isnan(prev_selected_t)+gte(t-prev_selected_t,5)'"  # 6 s, less half an interval
    assert chain[1] == "scale=160:-2,tile=10x3"
    assert args[args.index("-frames:v") + 1] == "1" and args[-1] == "/w/sprite.jpg"


def test_showinfo_lines_count_the_tiles_kept() -> None:
    lines = ["[Parsed_showinfo_1 @ 0x7f5cf80024c0] n:   0 pts:      0 pts_time:0       duration:    512",
             "[Parsed_showinfo_1 @ 0x7f5cf80024c0] n:  12 pts:  25600 pts_time:2       duration:    512",
             "[Parsed_showinfo_1 @ 0x7f5cf80024c0] config in time_base: 1/12800, frame_rate: 25/1",
             "[Parsed_showinfo_1 @ 0x7f5cf80024c0] color_range:unknown color_space:unknown",
             "frame=    1 fps=0.0 q=3.0 Lsize=N/A time=00:00:00.04"]
    assert [storyboard_tile(line) for line in lines] == [True, True, False, False, False]


CUE = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) --> (\d\d):(\d\d):(\d\d)\.(\d{3})$")


def cues(vtt: str) -> list[tuple[float, float, str]]:
    """The cues of a WebVTT text: (start, end, payload)."""
    blocks = vtt.strip().split("\n\n")
    assert blocks[0] == "WEBVTT"
    found = []
    for block in blocks[1:]:
        timing, payload = block.split("\n")
        m = CUE.match(timing)
        assert m, timing
        g = [int(x) for x in m.groups()]
        found.append((g[0] * 3600 + g[1] * 60 + g[2] + g[3] / 1000, g[4] * 3600 + g[5] * 60 + g[6] + g[7] / 1000,
                      payload))
    return found


@pytest.mark.parametrize("duration,made", [(10, 5), (9.96, 5), (3725.5, 94), (3725.5, 93), (0.4, 1)])
def test_the_storyboard_vtt_maps_each_interval_to_its_tile_and_covers_the_video(duration: float, made: int) -> None:
    plan = storyboard_plan(duration, keyframe_seconds=2, max_tiles=100, columns=10)
    text = storyboard_vtt(plan, tiles=made, tile_width=160, tile_height=90, duration=duration)
    found = cues(text)
    assert len(found) == made  # only tiles ffmpeg made (a last keyframe may be missing)
    assert found[0][0] == 0 and found[-1][1] == round(duration, 3)
    for i, (start, end, payload) in enumerate(found):
        assert start == round(i * plan.interval, 3) and end > start
        if i:
            assert start == found[i - 1][1]  # contiguous
        x, y = (i % plan.columns) * 160, (i // plan.columns) * 90
        assert payload == f"{SPRITE}#xywh={x},{y},160,90"


def test_hours_in_vtt_times() -> None:
    plan = StoryboardPlan(interval=40.0, tiles=100, columns=10, rows=10)
    assert "01:06:00.000 --> 01:06:40.000" in storyboard_vtt(plan, tiles=100, tile_width=160, tile_height=90,
                                                             duration=4000)


def jpeg(width: int, height: int, progressive: bool = False) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\0" + bytes(9)
    sof = b"\xff" + (b"\xc2" if progressive else b"\xc0") + struct.pack(">HBHHB", 11, 8, height, width, 1) + bytes(3)
    return b"\xff\xd8" + app0 + b"\xff\xff" + sof + b"\xff\xda" + bytes(20)


def test_jpeg_sizes_are_read_from_the_frame_header() -> None:
    assert jpeg_size(jpeg(1280, 720)) == (1280, 720)
    assert jpeg_size(jpeg(1600, 90, progressive=True)) == (1600, 90)
    for bad in (b"GIF89a", b"\xff\xd8\xff\xe0\x00\x04ab", b"\xff\xd8\x00\x00\x00\x00"):
        with pytest.raises(ValueError):
            jpeg_size(bad)


@pytest.mark.parametrize("ladder_nice", [0, 1, 10, 19])
@pytest.mark.parametrize("first_playable", [True, False])
def test_only_the_first_playable_renditions_ffmpeg_keeps_the_workers_priority(first_playable: bool,
                                                                               ladder_nice: int) -> None:
    got = ffmpeg_niceness(first_playable=first_playable, ladder_nice=ladder_nice)
    assert got == (0 if first_playable else ladder_nice)


@pytest.mark.parametrize("niceness", [0, MediaSettings().media_ladder_nice])
def test_a_jobs_process_runs_at_the_niceness_it_was_given(niceness: int) -> None:
    """The worker's child setup on a real process: its priority is the worker's plus `niceness`."""
    proc = subprocess.Popen(["sleep", "5"], preexec_fn=child_setup(niceness))
    try:
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == os.getpriority(os.PRIO_PROCESS, 0) + niceness
    finally:
        proc.kill()
        proc.wait()
