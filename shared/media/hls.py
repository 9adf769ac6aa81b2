"""What the master playlist says of one packaged rendition, measured on the files written (pure: bytes in, numbers out).

`measure_rendition` reads the media playlist (EXTINF durations, URIs), the segments' sizes, the init segment's boxes
(CODECS, the picture size) and, if given, the first media segment (the frame rate). BANDWIDTH is the peak segment
bit rate as RFC 8216 (4.3.4.2) defines it; CODECS is RFC 6381's, from the avcC and esds boxes. A minimal ISO BMFF
box walker is enough: the files are ffmpeg's own fMP4, read from the worker's disk.
"""

from __future__ import annotations

import math
import statistics
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from shared.media.playback import HlsRendition

CONTAINERS = frozenset({b"moov", b"trak", b"mdia", b"minf", b"stbl", b"mvex", b"moof", b"traf", b"edts", b"dinf"})
MP4A_AAC = 0x40  # ISO/IEC 14496-3 audio (AAC and its kin): its codecs string names the audio object type


class MalformedMedia(ValueError):
    """A playlist or an MP4 box this module cannot read."""


# ------------------------------------------------------------------------------------------ media playlist


@dataclass(frozen=True, slots=True)
class Segment:
    duration: float
    uri: str


@dataclass(frozen=True, slots=True)
class MediaPlaylist:
    target_duration: int
    map_uri: str | None  # the init segment (EXT-X-MAP)
    segments: tuple[Segment, ...]

    @property
    def duration(self) -> float:
        return sum(s.duration for s in self.segments)


def _attribute(attributes: str, name: str) -> str | None:
    """One attribute of an attribute list (`URI="init.mp4",BYTERANGE=...`), quotes removed."""
    for part in attributes.split(","):
        key, sep, value = part.partition("=")
        if sep and key.strip() == name:
            return value.strip().strip('"')
    return None


def parse_media_playlist(text: str) -> MediaPlaylist:
    """A media playlist's target duration, init segment and segments (duration, URI), in order."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines or lines[0] != "#EXTM3U":
        raise MalformedMedia("not an M3U8 playlist")
    target: int | None = None
    map_uri: str | None = None
    pending: float | None = None
    segments: list[Segment] = []
    for line in lines[1:]:
        try:
            if line.startswith("#EXT-X-TARGETDURATION:"):
                target = int(line.split(":", 1)[1])
            elif line.startswith("#EXTINF:"):
                pending = float(line.split(":", 1)[1].split(",", 1)[0])
        except ValueError:
            raise MalformedMedia(f"unreadable {line!r}") from None
        if line.startswith("#EXT-X-MAP:"):
            map_uri = _attribute(line.split(":", 1)[1], "URI")
        elif not line.startswith("#"):
            if pending is None:
                raise MalformedMedia(f"segment {line!r} without #EXTINF")
            segments.append(Segment(pending, line))
            pending = None
    if target is None:
        raise MalformedMedia("no #EXT-X-TARGETDURATION")
    if not segments:
        raise MalformedMedia("no segments")
    return MediaPlaylist(target, map_uri, tuple(segments))


def peak_segment_bit_rate(durations: list[float], sizes: list[int], target_duration: float) -> float:
    """RFC 8216 4.3.4.2: the largest bit rate of any contiguous set of segments whose total duration is between 0.5
    and 1.5 times the target duration (the set's bytes over its seconds). A playlist with no such set (one segment
    far shorter than the target) falls back to its largest single-segment rate."""
    low, high = 0.5 * target_duration, 1.5 * target_duration
    peak = 0.0
    for i in range(len(durations)):
        seconds = 0.0
        size = 0
        for j in range(i, len(durations)):
            seconds += durations[j]
            size += sizes[j]
            if seconds > high:
                break
            if seconds >= low and seconds > 0:
                peak = max(peak, 8 * size / seconds)
    if peak == 0.0:
        peak = max((8 * s / d for s, d in zip(sizes, durations, strict=True) if d > 0), default=0.0)
    return peak


# ------------------------------------------------------------------------------------------------ ISO BMFF


@dataclass(frozen=True, slots=True)
class Box:
    type: bytes
    payload: memoryview  # the box's content after its header

    def children(self) -> Iterator[Box]:
        return walk(self.payload)

    def child(self, kind: bytes) -> Box | None:
        return next((b for b in self.children() if b.type == kind), None)


def walk(data: bytes | memoryview) -> Iterator[Box]:
    """The boxes one after another in `data`; a box cut short (a file read only in part) ends the walk."""
    view = memoryview(data)
    pos = 0
    while pos + 8 <= len(view):
        size, kind = struct.unpack_from(">I4s", view, pos)
        header = 8
        if size == 1:
            if pos + 16 > len(view):
                return
            (size,) = struct.unpack_from(">Q", view, pos + 8)
            header = 16
        elif size == 0:
            size = len(view) - pos
        if size < header:
            raise MalformedMedia(f"box {kind!r} of size {size}")
        if pos + size > len(view):
            return
        yield Box(bytes(kind), view[pos + header : pos + size])
        pos += size


def find(boxes: Iterator[Box], *path: bytes) -> Iterator[Box]:
    """Every box at `path` (container types, then the wanted one) among `boxes`."""
    for box in boxes:
        if box.type != path[0]:
            continue
        if len(path) == 1:
            yield box
        else:
            yield from find(box.children(), *path[1:])


def _full_box_version(box: Box) -> int:
    return box.payload[0]


@dataclass(frozen=True, slots=True)
class Track:
    track_id: int
    handler: bytes  # b"vide", b"soun"
    timescale: int
    codec: str | None  # RFC 6381
    width: int = 0  # tkhd's presentation size (video)
    height: int = 0


def _tkhd(box: Box) -> tuple[int, int, int]:
    """track id, width, height (the latter two 16.16 fixed point in the box)."""
    p = box.payload
    if _full_box_version(box) == 1:
        track_id = struct.unpack_from(">I", p, 4 + 16)[0]
        rest = 4 + 16 + 4 + 4 + 8
    else:
        track_id = struct.unpack_from(">I", p, 4 + 8)[0]
        rest = 4 + 8 + 4 + 4 + 4
    rest += 8 + 2 + 2 + 2 + 2 + 36  # reserved, layer, alternate group, volume, reserved, matrix
    width, height = struct.unpack_from(">II", p, rest)
    return track_id, width >> 16, height >> 16


def _mdhd_timescale(box: Box) -> int:
    offset = 4 + (16 if _full_box_version(box) == 1 else 8)
    return int(struct.unpack_from(">I", box.payload, offset)[0])


def _descriptor(data: memoryview, pos: int) -> tuple[int, int, int]:
    """An MPEG-4 descriptor at `pos`: (tag, start of its content, end of its content)."""
    tag = data[pos]
    pos += 1
    length = 0
    for _ in range(4):
        byte = data[pos]
        pos += 1
        length = (length << 7) | (byte & 0x7F)
        if not byte & 0x80:
            break
    return tag, pos, pos + length


def mp4a_codec(esds: Box) -> str:
    """`mp4a.40.<audio object type>` from an esds box (ES_Descriptor > DecoderConfigDescriptor > AudioSpecificConfig);
    `mp4a.<OTI>` for a stream that is not MPEG-4 audio."""
    data = esds.payload
    tag, pos, end = _descriptor(data, 4)  # after the full box's version and flags
    if tag != 0x03:
        raise MalformedMedia("esds without an ES_Descriptor")
    flags = data[pos + 2]
    pos += 3
    if flags & 0x80:  # streamDependenceFlag
        pos += 2
    if flags & 0x40:  # URL_Flag
        pos += 1 + data[pos]
    if flags & 0x20:  # OCRstreamFlag
        pos += 2
    while pos < end:
        tag, start, stop = _descriptor(data, pos)
        if tag == 0x04:  # DecoderConfigDescriptor
            oti = data[start]
            if oti != MP4A_AAC:
                return f"mp4a.{oti:X}"
            inner = start + 13
            while inner < stop:
                dtag, dstart, dstop = _descriptor(data, inner)
                if dtag == 0x05 and dstop > dstart:  # DecoderSpecificInfo: the AudioSpecificConfig
                    aot = data[dstart] >> 3
                    if aot == 31 and dstop - dstart >= 2:  # the escape: 32 plus the next six bits
                        aot = 32 + (((data[dstart] & 0x07) << 3) | (data[dstart + 1] >> 5))
                    return f"mp4a.{MP4A_AAC:x}.{aot}"
                inner = dstop
            raise MalformedMedia("MPEG-4 audio without an AudioSpecificConfig")
        pos = stop
    raise MalformedMedia("esds without a DecoderConfigDescriptor")


VISUAL_ENTRY_HEADER = 78  # SampleEntry (8) + VisualSampleEntry fields (70), before its child boxes
AUDIO_ENTRY_HEADER = 28  # SampleEntry (8) + AudioSampleEntry fields (20); QuickTime versions 1 and 2 add more
AUDIO_QT_EXTRA = {0: 0, 1: 16, 2: 36}


def sample_entry_codec(entry: Box) -> str | None:
    """RFC 6381 codecs of one stsd sample entry: `avc1.PPCCLL` (profile, constraint flags, level from avcC) or
    `mp4a.40.N`; None for a kind this module does not know."""
    kind = entry.type.decode("latin-1")
    if entry.type in (b"avc1", b"avc3"):
        avcc = next((b for b in walk(entry.payload[VISUAL_ENTRY_HEADER:]) if b.type == b"avcC"), None)
        if avcc is None or len(avcc.payload) < 4:
            raise MalformedMedia(f"{kind} without avcC")
        profile, constraints, level = avcc.payload[1], avcc.payload[2], avcc.payload[3]
        return f"{kind}.{profile:02x}{constraints:02x}{level:02x}"
    if entry.type == b"mp4a":
        version = struct.unpack_from(">H", entry.payload, 8)[0]
        start = AUDIO_ENTRY_HEADER + AUDIO_QT_EXTRA.get(version, 0)
        esds = next((b for b in walk(entry.payload[start:]) if b.type == b"esds"), None)
        if esds is None:
            raise MalformedMedia("mp4a without esds")
        return mp4a_codec(esds)
    return None


def tracks(init: bytes) -> list[Track]:
    """The tracks of an init segment (or any MP4 with a moov), in file order."""
    found: list[Track] = []
    for trak in find(walk(init), b"moov", b"trak"):
        tkhd = trak.child(b"tkhd")
        mdia = trak.child(b"mdia")
        if tkhd is None or mdia is None:
            raise MalformedMedia("trak without tkhd or mdia")
        hdlr, mdhd = mdia.child(b"hdlr"), mdia.child(b"mdhd")
        if hdlr is None or mdhd is None:
            raise MalformedMedia("mdia without hdlr or mdhd")
        handler = bytes(hdlr.payload[8:12])
        track_id, width, height = _tkhd(tkhd)
        stsd = next(find(mdia.children(), b"minf", b"stbl", b"stsd"), None)
        codec = None
        if stsd is not None:
            entry = next(walk(stsd.payload[8:]), None)  # after version, flags and the entry count
            codec = sample_entry_codec(entry) if entry is not None else None
        found.append(Track(track_id, handler, _mdhd_timescale(mdhd), codec, width, height))
    return found


def sample_durations(segment: bytes, track_id: int, default: int | None = None) -> list[int]:
    """The sample durations of one track in a media segment's first moof (tfhd defaults, trun entries)."""
    for traf in find(walk(segment), b"moof", b"traf"):
        tfhd = traf.child(b"tfhd")
        if tfhd is None:
            continue
        p = tfhd.payload
        flags = int.from_bytes(p[1:4], "big")
        if struct.unpack_from(">I", p, 4)[0] != track_id:
            continue
        pos = 8 + (8 if flags & 0x01 else 0) + (4 if flags & 0x02 else 0)
        track_default = struct.unpack_from(">I", p, pos)[0] if flags & 0x08 else default
        durations: list[int] = []
        for trun in (b for b in traf.children() if b.type == b"trun"):
            q = trun.payload
            tflags = int.from_bytes(q[1:4], "big")
            count = struct.unpack_from(">I", q, 4)[0]
            pos = 8 + (4 if tflags & 0x01 else 0) + (4 if tflags & 0x04 else 0)
            per_sample = sum(4 for bit in (0x100, 0x200, 0x400, 0x800) if tflags & bit)
            for i in range(count):
                if tflags & 0x100:
                    durations.append(struct.unpack_from(">I", q, pos + i * per_sample)[0])
                elif track_default is not None:
                    durations.append(track_default)
        return durations
    return []


def _trex_default_duration(init: bytes, track_id: int) -> int | None:
    for trex in find(walk(init), b"moov", b"mvex", b"trex"):
        if struct.unpack_from(">I", trex.payload, 4)[0] == track_id:
            return int(struct.unpack_from(">I", trex.payload, 12)[0])
    return None


def frame_rate(init: bytes, segment: bytes, video: Track) -> float | None:
    """Frames per second of the video track, from a media segment's sample durations (their median: a variable
    rate shows its usual value); None when the segment says nothing of it."""
    durations = [d for d in sample_durations(segment, video.track_id, _trex_default_duration(init, video.track_id))
                 if d > 0]
    if not durations or video.timescale <= 0:
        return None
    return round(video.timescale / statistics.median(durations), 3)


# ---------------------------------------------------------------------------------------------- measuring


def measure_rendition(*, playlist_key: str, playlist: str, sizes: Mapping[str, int], init: bytes,
                      first_segment: bytes | None = None) -> HlsRendition:
    """An HlsRendition of a packaged rendition: `playlist` is its media playlist's text, `sizes` the size of each
    segment by its URI, `init` the init segment's bytes, `first_segment` (optional) the first media segment's first
    bytes (its moof), for the frame rate."""
    media = parse_media_playlist(playlist)
    try:
        segment_sizes = [sizes[s.uri] for s in media.segments]
    except KeyError as exc:
        raise MalformedMedia(f"no size for segment {exc.args[0]!r}") from None
    durations = [s.duration for s in media.segments]
    try:
        all_tracks = tracks(init)
        video = next((t for t in all_tracks if t.handler == b"vide"), None)
        if video is None or video.codec is None:
            raise MalformedMedia("no H.264 video track in the init segment")
        fps = frame_rate(init, first_segment, video) if first_segment else None
    except (struct.error, IndexError) as exc:  # a box shorter than its fields
        raise MalformedMedia(f"a box cut short: {exc}") from None
    audio = [t for t in all_tracks if t.handler == b"soun"]
    for t in audio:
        if t.codec is None:
            raise MalformedMedia("an audio track of a codec this module does not know")
    codecs = ",".join([video.codec, *(t.codec for t in audio if t.codec is not None)])
    total = media.duration
    if total <= 0:
        raise MalformedMedia("a playlist of no duration")
    return HlsRendition(
        playlist_key=playlist_key,
        bandwidth=max(1, math.ceil(peak_segment_bit_rate(durations, segment_sizes, media.target_duration))),
        average_bandwidth=max(1, math.ceil(8 * sum(segment_sizes) / total)),
        codecs=codecs, width=video.width, height=video.height, frame_rate=fps,
        segments=len(media.segments), duration=round(total, 6),
    )
