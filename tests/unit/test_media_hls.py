"""Measuring a packaged rendition (shared/media/hls.py): the media playlist, RFC 8216's peak segment bit rate, RFC
6381's CODECS from hand-built ISO BMFF boxes (avcC, esds), the picture size, the frame rate."""

from __future__ import annotations

import math
import struct

import pytest

from shared.media.hls import (
    MalformedMedia,
    measure_rendition,
    parse_media_playlist,
    peak_segment_bit_rate,
    tracks,
    walk,
)
from shared.media.playback import HlsRendition


def box(kind: bytes, *parts: bytes) -> bytes:
    body = b"".join(parts)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def full(kind: bytes, version: int, flags: int, *parts: bytes) -> bytes:
    return box(kind, bytes([version]) + flags.to_bytes(3, "big"), *parts)


def tkhd(track_id: int, width: int, height: int, version: int = 0) -> bytes:
    times = struct.pack(">QQ", 0, 0) if version else struct.pack(">II", 0, 0)
    duration = struct.pack(">Q", 0) if version else struct.pack(">I", 0)
    return full(b"tkhd", version, 3, times, struct.pack(">II", track_id, 0), duration, bytes(8 + 8), bytes(36),
                struct.pack(">II", width << 16, height << 16))


def mdia(handler: bytes, timescale: int, entry: bytes) -> bytes:
    mdhd = full(b"mdhd", 0, 0, struct.pack(">IIII", 0, 0, timescale, 0), bytes(4))
    hdlr = full(b"hdlr", 0, 0, bytes(4), handler, bytes(12), b"\0")
    stsd = full(b"stsd", 0, 0, struct.pack(">I", 1), entry)
    return box(b"mdia", mdhd, hdlr, box(b"minf", box(b"stbl", stsd)))


def avc1(profile: int, constraints: int, level: int, width: int, height: int) -> bytes:
    visual = bytes(6) + struct.pack(">H", 1) + bytes(16) + struct.pack(">HH", width, height) + bytes(50)
    avcc = box(b"avcC", bytes([1, profile, constraints, level, 0xFF, 0xE0]))
    return box(b"avc1", visual, avcc, box(b"pasp", struct.pack(">II", 1, 1)))


def descriptor(tag: int, body: bytes) -> bytes:
    return bytes([tag, 0x80, 0x80, 0x80, len(body)]) + body  # the 4-byte length form ffmpeg writes


def mp4a(audio_object_type: int, oti: int = 0x40, escape_low: int = 0) -> bytes:
    if audio_object_type >= 32:  # escaped: 31, then six bits
        extra = audio_object_type - 32
        asc = bytes([(31 << 3) | (extra >> 3), ((extra & 0x07) << 5) | escape_low])
    else:
        asc = bytes([(audio_object_type << 3) | 0x01, 0x90])
    config = descriptor(0x04, bytes([oti, 0x15]) + bytes(3) + struct.pack(">II", 0, 128000) + descriptor(0x05, asc))
    es = descriptor(0x03, struct.pack(">H", 1) + b"\0" + config + descriptor(0x06, b"\x02"))
    audio = bytes(6) + struct.pack(">H", 1) + bytes(8) + struct.pack(">HHHHI", 2, 16, 0, 0, 44100 << 16)
    return box(b"mp4a", audio, full(b"esds", 0, 0, es))


def init_segment(*, profile: int = 0x64, constraints: int = 0, level: int = 0x1F, width: int = 1280, height: int = 720,
                 audio: bytes | None = None, timescale: int = 12800, default_duration: int = 0) -> bytes:
    video = box(b"trak", tkhd(1, width, height), mdia(b"vide", timescale, avc1(profile, constraints, level, width,
                                                                                height)))
    traks = [video]
    if audio is not None:
        traks.append(box(b"trak", tkhd(2, 0, 0, version=1), mdia(b"soun", 44100, audio)))
    trex = full(b"trex", 0, 0, struct.pack(">IIIII", 1, 1, default_duration, 0, 0))
    return box(b"ftyp", b"iso5", bytes(4)) + box(b"moov", full(b"mvhd", 0, 0, bytes(96)), *traks,
                                                 box(b"mvex", trex))


def media_segment(durations: list[int], track_id: int = 1, *, per_sample: bool = True,
                  tfhd_default: int | None = None) -> bytes:
    """A styp, moof and mdat: the trun lists each sample's duration (per_sample), or only sizes, the durations then
    being tfhd's default (tfhd_default) or else trex's."""
    tfhd = full(b"tfhd", 0, 0x020000 | (0x08 if tfhd_default is not None else 0), struct.pack(">I", track_id),
                struct.pack(">I", tfhd_default) if tfhd_default is not None else b"")
    if per_sample:
        entries = b"".join(struct.pack(">II", d, 1000) for d in durations)
        trun = full(b"trun", 0, 0x000301, struct.pack(">Ii", len(durations), 0), entries)
    else:
        sizes = struct.pack(">I", 1000) * len(durations)
        trun = full(b"trun", 0, 0x000201, struct.pack(">Ii", len(durations), 0), sizes)
    moof = box(b"moof", full(b"mfhd", 0, 0, struct.pack(">I", 1)), box(b"traf", tfhd, trun))
    return box(b"styp", b"msdh", bytes(4)) + moof + box(b"mdat", bytes(64))


PLAYLIST = """#EXTM3U
#EXT-X-VERSION:7
#EXT-X-TARGETDURATION:4
#EXT-X-MEDIA-SEQUENCE:0
#EXT-X-PLAYLIST-TYPE:VOD
#EXT-X-INDEPENDENT-SEGMENTS
#EXT-X-MAP:URI="init.mp4"
#EXTINF:4.000000,
seg-00000.m4s
#EXTINF:4.000000,
seg-00001.m4s
#EXTINF:2.000000,
seg-00002.m4s
#EXT-X-ENDLIST
"""


def test_the_media_playlist_is_read_in_order() -> None:
    media = parse_media_playlist(PLAYLIST)
    assert media.target_duration == 4 and media.map_uri == "init.mp4"
    assert [(s.duration, s.uri) for s in media.segments] == [(4.0, "seg-00000.m4s"), (4.0, "seg-00001.m4s"),
                                                            (2.0, "seg-00002.m4s")]
    assert media.duration == 10.0
    for bad in ("", "#EXTINF:4,\nseg.m4s", "#EXTM3U\n#EXT-X-TARGETDURATION:four\n#EXTINF:4,\nseg.m4s",
                "#EXTM3U\n#EXT-X-TARGETDURATION:4\n#EXTINF:,\nseg.m4s", "#EXTM3U\n#EXTINF:4,\nseg.m4s",
                "#EXTM3U\n#EXT-X-TARGETDURATION:4\nseg.m4s", "#EXTM3U\n#EXT-X-TARGETDURATION:4\n"):
        with pytest.raises(MalformedMedia):
            parse_media_playlist(bad)


def brute_peak(durations: list[float], sizes: list[int], target: float) -> float:
    """RFC 8216 4.3.4.2 read literally: every contiguous set of segments, those lasting 0.5 to 1.5 target durations."""
    rates = [8 * sum(sizes[i:j]) / sum(durations[i:j]) for i in range(len(sizes)) for j in range(i + 1, len(sizes) + 1)
             if 0.5 * target <= sum(durations[i:j]) <= 1.5 * target]
    return max(rates)


@pytest.mark.parametrize("durations,sizes,target", [
    ([4, 4, 2], [124509, 114793, 60793], 4),
    ([4, 4, 4, 4, 0.4], [100, 100, 900, 100, 400], 4),  # a short last segment alone is no set: 400 B in 0.4 s is not
    ([2, 2, 2, 2], [10, 80, 10, 10], 4),  # pairs and triples of 2 s segments count, single ones (1.0 target) too
    ([6, 1, 1], [600, 500, 10], 6),
])
def test_the_bandwidth_is_the_peak_segment_bit_rate_over_sets_of_half_to_one_and_a_half_target_durations(
        durations: list[float], sizes: list[int], target: int) -> None:
    assert peak_segment_bit_rate(durations, sizes, target) == pytest.approx(brute_peak(durations, sizes, target))


def test_a_playlist_with_no_set_long_enough_falls_back_to_its_largest_segment_rate() -> None:
    assert peak_segment_bit_rate([0.4], [1000], 4) == pytest.approx(8 * 1000 / 0.4)


@pytest.mark.parametrize("profile,constraints,level,expected", [
    (0x64, 0x00, 0x1F, "avc1.64001f"),  # High 3.1
    (0x4D, 0x40, 0x1E, "avc1.4d401e"),  # Main 3.0
    (0x42, 0xC0, 0x0D, "avc1.42c00d"),  # Constrained Baseline 1.3
    (0x64, 0x00, 0x33, "avc1.640033"),  # High 5.1
])
@pytest.mark.parametrize("aot,audio_codec", [(2, "mp4a.40.2"), (5, "mp4a.40.5"), (29, "mp4a.40.29"),
                                             (42, "mp4a.40.42")])
def test_codecs_come_from_avcc_and_esds(profile: int, constraints: int, level: int, expected: str, aot: int,
                                        audio_codec: str) -> None:
    found = tracks(init_segment(profile=profile, constraints=constraints, level=level, audio=mp4a(aot)))
    assert [(t.handler, t.codec) for t in found] == [(b"vide", expected), (b"soun", audio_codec)]
    assert (found[0].width, found[0].height, found[0].timescale) == (1280, 720, 12800)


def test_mpeg_audio_that_is_not_aac_is_named_by_its_object_type_indication() -> None:
    assert tracks(init_segment(audio=mp4a(2, oti=0x6B)))[1].codec == "mp4a.6B"


KEY = "renditions/v/720p-1/index.m3u8"
SIZES = {"seg-00000.m4s": 124509, "seg-00001.m4s": 114793, "seg-00002.m4s": 60793}


def measured(first_segment: bytes | None = None, init: bytes | None = None) -> HlsRendition:
    return measure_rendition(playlist_key=KEY, playlist=PLAYLIST, sizes=SIZES,
                             init=init if init is not None else init_segment(audio=mp4a(2)),
                             first_segment=first_segment)


def test_a_rendition_is_measured_from_its_playlist_sizes_and_boxes() -> None:
    hls = measured(first_segment=media_segment([512] * 100))
    assert hls.playlist_key == KEY
    assert hls.bandwidth == math.ceil(brute_peak([4, 4, 2], list(SIZES.values()), 4))
    assert hls.average_bandwidth == math.ceil(8 * sum(SIZES.values()) / 10)
    assert hls.codecs == "avc1.64001f,mp4a.40.2"
    assert (hls.width, hls.height, hls.segments, hls.duration) == (1280, 720, 3, 10.0)
    assert hls.frame_rate == 25.0  # 12800 / 512


def test_the_frame_rate_comes_from_per_sample_tfhd_or_trex_durations_and_is_optional() -> None:
    ntsc = init_segment(timescale=30000, audio=mp4a(2))
    assert measured(media_segment([1001] * 3, per_sample=False, tfhd_default=1001), ntsc).frame_rate == \
        pytest.approx(29.97)
    assert measured(media_segment([0] * 3, per_sample=False), init_segment(default_duration=256)).frame_rate == 50.0
    assert measured(media_segment([512] * 9 + [1024])).frame_rate == 25.0  # the usual duration: a variable rate's
    assert measured().frame_rate is None  # no media segment given
    assert measured(media_segment([512] * 4, track_id=2)).frame_rate is None  # only another track's samples


def test_a_mute_rendition_has_only_its_video_codec() -> None:
    hls = measure_rendition(playlist_key="k", playlist=PLAYLIST, sizes=dict.fromkeys(
        ("seg-00000.m4s", "seg-00001.m4s", "seg-00002.m4s"), 1000), init=init_segment())
    assert hls.codecs == "avc1.64001f"


def test_what_cannot_be_measured_is_refused() -> None:
    with pytest.raises(MalformedMedia):  # a segment of unknown size
        measure_rendition(playlist_key="k", playlist=PLAYLIST, sizes={"seg-00000.m4s": 1}, init=init_segment())
    with pytest.raises(MalformedMedia):  # no video track
        measure_rendition(playlist_key="k", playlist=PLAYLIST, sizes=dict.fromkeys(
            ("seg-00000.m4s", "seg-00001.m4s", "seg-00002.m4s"), 1), init=box(b"moov"))
    with pytest.raises(MalformedMedia):  # an init segment whose boxes are shorter than their fields
        measure_rendition(playlist_key="k", playlist=PLAYLIST, sizes=SIZES,
                          init=box(b"moov", box(b"trak", box(b"tkhd", b"\0" * 8), box(b"mdia"))))
    with pytest.raises(MalformedMedia):  # a box shorter than its header
        list(walk(struct.pack(">I4s", 4, b"free")))


def test_the_walker_reads_large_sizes_and_stops_at_a_box_cut_short() -> None:
    large = struct.pack(">I4sQ", 1, b"free", 16 + 3) + b"abc"
    cut = box(b"mdat", bytes(100))[:50]
    assert [(b.type, bytes(b.payload)) for b in walk(large + box(b"skip", b"x") + cut)] == [
        (b"free", b"abc"), (b"skip", b"x")]
