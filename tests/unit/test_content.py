"""The content check (SPEC section 4) and the probe's parsing, on hand-built bytes and recorded ffmpeg output.

No server, no ffmpeg: tests/integration/test_probe.py runs the same functions on media ffmpeg generates.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.media.content import (
    EBML_MAGIC,
    HEAD_READ,
    ID3_FOOTER_SIZE,
    ID3_HEADER_SIZE,
    MAX_SNIFF_READS,
    MIN_HEAD,
    TS_MIN_PACKETS,
    Container,
    SniffResult,
    recognise,
    skip_id3v2,
    sniff,
    sniff_object,
    syncsafe,
)
from shared.media.probe import (
    DEMUXER,
    PROBE_BYTES,
    VideoInfo,
    ffmpeg_input,
    ffmpeg_probe_args,
    ffmpeg_protocols,
    parse_ffmpeg_info,
)

# ---------------------------------------------------------------------------------------------------------------------
# byte builders


def id3_tag(body: int = 0, *, major: int = 4, revision: int = 0, flags: int = 0) -> bytes:
    """An ID3v2 tag with `body` bytes of frames (zeros), and the v2.4 footer when flags has 0x10."""
    header = b"ID3" + bytes([major, revision, flags]) + syncsafe(body)
    footer = b"3DI" + header[3:] if major == 4 and flags & 0x10 else b""
    return header + b"\x00" * body + footer


def box(kind: bytes, payload: bytes = b"") -> bytes:
    return (8 + len(payload)).to_bytes(4, "big") + kind + payload


def ftyp(major: bytes = b"isom", *compatible: bytes) -> bytes:
    return box(b"ftyp", major + b"\x00\x00\x02\x00" + b"".join(compatible or (b"isom", b"iso2", b"avc1", b"mp41")))


def padded(head: bytes, size: int = MIN_HEAD) -> bytes:
    """head followed by filler, so that a decision can be made on it (MIN_HEAD bytes, or more)."""
    return head + bytes(max(0, size - len(head)))


def ts_packets(count: int, *, packet: int = 188, sync_at: int = 0) -> bytes:
    one = bytearray(packet)
    one[sync_at] = 0x47
    one[sync_at + 1 : sync_at + 4] = b"\x40\x00\x10"  # PUSI, PID 0 (the PAT), payload only
    return bytes(one) * count


MP4 = padded(ftyp() + box(b"free") + box(b"mdat", b"\x00" * 64))
MOV = padded(ftyp(b"qt  ", b"qt  ") + box(b"wide") + box(b"mdat", b"\x00" * 64))
GP3 = padded(ftyp(b"3gp4", b"isom", b"3gp4"))
M4V = padded(ftyp(b"M4V ", b"M4V ", b"M4A ", b"mp42", b"isom"))
# the EBML header of a WebM as ffmpeg writes it: EBMLVersion 1, ReadVersion 1, MaxIDLength 4, MaxSizeLength 8, "webm"
WEBM = padded(EBML_MAGIC + bytes.fromhex("9f4286810142f7810142f2810442f381084282847765626d42878104428581021853806701"))
MKV = padded(
    EBML_MAGIC
    + bytes.fromhex("a34286810142f7810142f2810442f381084282")
    + b"\x88matroska"
    + bytes.fromhex("42878104428581021853806701")
)
AVI = padded(b"RIFF" + (1_000_000).to_bytes(4, "little") + b"AVI LIST" + bytes(8) + b"hdrlavih")
TS = padded(ts_packets(MIN_HEAD // 188 + 1))[:MIN_HEAD]
M2TS = padded(ts_packets(MIN_HEAD // 192 + 1, packet=192, sync_at=4))[:MIN_HEAD]
TS204 = padded(ts_packets(MIN_HEAD // 204 + 1, packet=204))[:MIN_HEAD]

WAV = padded(b"RIFF" + (36_000).to_bytes(4, "little") + b"WAVEfmt " + (16).to_bytes(4, "little"))
MP3_FRAMES = padded(b"\xff\xfb\x90\x64" + bytes(413) + b"\xff\xfb\x90\x64")
MP3 = id3_tag(1000, major=3) + MP3_FRAMES
TEXT = padded(b"I'm free to upload whatever I like.\n" * 200, 0)
RANDOM = random.Random(4).randbytes(MIN_HEAD)
MPEG_PS = padded(b"\x00\x00\x01\xba\x44\x00\x04\x00\x04\x01\x01\x89\xc3\xf8")
FLV = padded(b"FLV\x01\x05\x00\x00\x00\x09")
PNG = padded(b"\x89PNG\r\n\x1a\n\x00\x00\x00\x0dIHDR")

ACCEPTED = {
    "mp4": (MP4, Container.MP4),
    "mov": (MOV, Container.MP4),
    "3gp": (GP3, Container.MP4),
    "m4v": (M4V, Container.MP4),
    "webm": (WEBM, Container.MATROSKA),
    "mkv": (MKV, Container.MATROSKA),
    "avi": (AVI, Container.AVI),
    "ts": (TS, Container.MPEGTS),
    "m2ts": (M2TS, Container.MPEGTS),
    "ts204": (TS204, Container.MPEGTS),
}
REFUSED = {
    "wav": WAV,
    "mp3 frames": MP3_FRAMES,
    "mp3 with id3": MP3,
    "text": TEXT,
    "random": RANDOM,
    "mpeg-ps": MPEG_PS,
    "flv": FLV,
    "png": PNG,
    "empty": b"",
    "zeros": bytes(MIN_HEAD),
    "an id3 tag itself": padded(id3_tag(100)),
}


# ---------------------------------------------------------------------------------------------------------------------
# syncsafe and skip_id3v2


def test_syncsafe_encodes_seven_bits_a_byte() -> None:
    assert syncsafe(0) == b"\x00\x00\x00\x00"
    assert syncsafe(0x7F) == b"\x00\x00\x00\x7f"
    assert syncsafe(0x80) == b"\x00\x00\x01\x00"
    assert syncsafe(257) == b"\x00\x00\x02\x01"
    assert syncsafe((1 << 28) - 1) == b"\x7f\x7f\x7f\x7f"
    for bad in (-1, 1 << 28):
        with pytest.raises(ValueError):
            syncsafe(bad)


def test_no_tag_means_the_content_starts_at_zero() -> None:
    assert skip_id3v2(MP4) == 0
    assert skip_id3v2(b"x") == 0  # one byte that cannot begin a tag is enough to know


def test_one_tag_is_skipped_whole() -> None:
    assert skip_id3v2(id3_tag(100) + MP4) == ID3_HEADER_SIZE + 100


@pytest.mark.parametrize("major", [2, 3, 4])
def test_every_id3v2_version_is_a_tag(major: int) -> None:
    assert skip_id3v2(id3_tag(33, major=major) + MP4) == ID3_HEADER_SIZE + 33


def test_consecutive_tags_are_all_skipped_and_the_v24_footer_counts() -> None:
    tags = id3_tag(100) + id3_tag(50, flags=0x10) + id3_tag(7, major=3)
    assert skip_id3v2(tags + MP4) == len(tags) == 3 * ID3_HEADER_SIZE + 157 + ID3_FOOTER_SIZE


def test_the_footer_flag_means_nothing_before_v24() -> None:
    # bit 0x10 is undefined in v2.3: no footer is added to the tag's length
    assert skip_id3v2(id3_tag(20, major=3, flags=0x10) + MP4) == ID3_HEADER_SIZE + 20


def test_unknown_flag_bits_are_tolerated() -> None:
    assert skip_id3v2(id3_tag(20, flags=0x0F) + MP4) == ID3_HEADER_SIZE + 20


def test_many_empty_tags() -> None:
    assert skip_id3v2(id3_tag() * 500 + MP4) == 500 * ID3_HEADER_SIZE


def test_the_largest_syncsafe_size() -> None:
    header = b"ID3\x04\x00\x00\x7f\x7f\x7f\x7f"
    assert skip_id3v2(header) is None  # its body is not in the head
    assert skip_id3v2(header, eof=True) == len(header)


@pytest.mark.parametrize(
    "header",
    [
        pytest.param(b"ID3\x01\x00\x00\x00\x00\x00\x10", id="version 1"),
        pytest.param(b"ID3\x05\x00\x00\x00\x00\x00\x10", id="version 5"),
        pytest.param(b"ID3\xff\x00\x00\x00\x00\x00\x10", id="version ff"),
        pytest.param(b"ID3\x04\xff\x00\x00\x00\x00\x10", id="revision ff"),
        pytest.param(b"ID3\x04\x00\x00\x80\x00\x00\x10", id="size byte 1 not syncsafe"),
        pytest.param(b"ID3\x04\x00\x00\x00\x80\x00\x10", id="size byte 2 not syncsafe"),
        pytest.param(b"ID3\x04\x00\x00\x00\x00\x80\x10", id="size byte 3 not syncsafe"),
        pytest.param(b"ID3\x04\x00\x00\x00\x00\x00\x90", id="size byte 4 not syncsafe"),
        pytest.param(b"id3\x04\x00\x00\x00\x00\x00\x10", id="lower case"),
        pytest.param(b"3DI\x04\x00\x00\x00\x00\x00\x10", id="a footer first"),
    ],
)
def test_a_malformed_header_is_not_a_tag_but_the_content(header: bytes) -> None:
    head = padded(header)
    assert skip_id3v2(head) == 0
    assert sniff(head) == SniffResult(None, 0, None)


def test_a_malformed_second_header_ends_the_tags() -> None:
    first = id3_tag(10)
    assert skip_id3v2(first + b"ID3\x04\x00\x00\x00\x00\xff\x00" + MP4) == len(first)


@pytest.mark.parametrize("cut", range(ID3_HEADER_SIZE))
def test_a_header_cut_short_is_unknown_until_the_end_of_the_file(cut: int) -> None:
    head = id3_tag(40)[:cut]
    assert skip_id3v2(head) is None
    assert skip_id3v2(head, eof=True) == 0  # the whole file: a partial header is not a tag


@pytest.mark.parametrize("cut", range(ID3_HEADER_SIZE))
def test_a_second_header_cut_short_is_unknown(cut: int) -> None:
    first = id3_tag(40)
    assert skip_id3v2(first + id3_tag(40)[:cut]) is None
    assert skip_id3v2(first + id3_tag(40)[:cut], eof=True) == len(first)


def test_a_short_head_that_cannot_begin_a_tag_is_known() -> None:
    assert skip_id3v2(b"IDx") == 0
    assert skip_id3v2(b"ID3\x07") == 0
    assert skip_id3v2(b"ID3\x04\x00\x00\x00\x81") == 0


def test_a_tag_longer_than_the_head() -> None:
    head = id3_tag(10_000)[:500]
    assert skip_id3v2(head) is None
    assert skip_id3v2(head, eof=True) == len(head)


def test_an_empty_head_is_unknown_unless_it_is_the_whole_file() -> None:
    assert skip_id3v2(b"") is None
    assert skip_id3v2(b"", eof=True) == 0


def test_a_tag_ending_exactly_at_the_end_of_the_head_leaves_the_next_bytes_unknown() -> None:
    tag = id3_tag(30)
    assert skip_id3v2(tag) is None
    assert skip_id3v2(tag, eof=True) == len(tag)


# ---------------------------------------------------------------------------------------------------------------------
# recognise


@pytest.mark.parametrize(("head", "container"), ACCEPTED.values(), ids=ACCEPTED.keys())
def test_recognise_accepted_containers(head: bytes, container: Container) -> None:
    assert recognise(head) is container


@pytest.mark.parametrize("head", REFUSED.values(), ids=REFUSED.keys())
def test_recognise_refuses_everything_else(head: bytes) -> None:
    assert recognise(head) is None


def test_container_values_are_stable_names() -> None:
    assert [c.value for c in Container] == ["mp4", "matroska", "avi", "mpegts"]
    assert set(DEMUXER) == set(Container)


def test_ftyp_needs_to_be_the_first_box() -> None:
    assert recognise(b"\x00" + MP4) is None
    assert recognise(MP4[:12]) is Container.MP4  # a short file: ftyp's own header is enough


def test_riff_other_than_avi_is_refused() -> None:
    for form in (b"WAVE", b"AVIX", b"WEBP", b"avi "):
        assert recognise(b"RIFF\x00\x10\x00\x00" + form + bytes(100)) is None


def test_ebml_magic_alone_decides() -> None:
    assert recognise(EBML_MAGIC) is Container.MATROSKA
    assert recognise(EBML_MAGIC[:3] + b"\x00") is None


# QuickTime movies without ftyp: accepted when the top-level atoms lead to mdat or to a moov that starts with mvhd


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(box(b"moov", box(b"mvhd", bytes(100))), id="moov first"),
        pytest.param(box(b"moov", box(b"cmov", bytes(20))), id="compressed moov"),
        pytest.param(box(b"mdat", bytes(100)), id="mdat first"),
        pytest.param(box(b"wide") + box(b"mdat", bytes(100)), id="wide then mdat"),
        pytest.param(box(b"free", bytes(30)) + box(b"skip") + box(b"moov", box(b"mvhd", bytes(100))), id="free skip"),
        pytest.param(box(b"pnot", bytes(12)) + box(b"moov", box(b"mvhd")), id="preview atom"),
        pytest.param((1).to_bytes(4, "big") + b"mdat" + (1 << 33).to_bytes(8, "big"), id="64-bit mdat"),
        pytest.param(
            (1).to_bytes(4, "big") + b"wide" + (16).to_bytes(8, "big") + box(b"mdat", bytes(8)), id="64-bit wide"
        ),
    ],
)
def test_bare_quicktime_is_mp4(head: bytes) -> None:
    assert recognise(padded(head)) is Container.MP4


@pytest.mark.parametrize(
    "head",
    [
        pytest.param(b"I'm free to say what I like", id="text saying free at byte 4"),
        pytest.param(b"The moov is here", id="text saying moov"),
        pytest.param(box(b"moov", box(b"trak", bytes(100))), id="moov without its header first"),
        pytest.param(box(b"moov"), id="empty moov"),
        pytest.param((0).to_bytes(4, "big") + b"mdat", id="mdat to the end, so no moov"),
        pytest.param((4).to_bytes(4, "big") + b"free", id="size under a box header"),
        pytest.param((1).to_bytes(4, "big") + b"wide" + (8).to_bytes(8, "big"), id="64-bit size under its header"),
        pytest.param((1).to_bytes(4, "big") + b"mdat", id="64-bit size cut off"),
        pytest.param(box(b"wide") + box(b"junk"), id="unknown atom"),
        pytest.param(box(b"free", bytes(MIN_HEAD)) + box(b"mdat"), id="mdat beyond the head"),
        pytest.param(box(b"uuid", bytes(16)) + box(b"mdat"), id="not a quicktime top-level atom"),
    ],
)
def test_what_only_looks_like_bare_quicktime_is_refused(head: bytes) -> None:
    assert recognise(padded(head)) is None


# MPEG-TS


@pytest.mark.parametrize(("packet", "sync_at"), [(188, 0), (192, 4), (204, 0)])
def test_ts_needs_three_packets(packet: int, sync_at: int) -> None:
    enough = ts_packets(TS_MIN_PACKETS, packet=packet, sync_at=sync_at)
    # the third sync byte is the last byte needed
    assert recognise(enough[: (TS_MIN_PACKETS - 1) * packet + sync_at + 1]) is Container.MPEGTS
    assert recognise(enough[: (TS_MIN_PACKETS - 1) * packet + sync_at]) is None


def test_ts_with_one_bad_sync_byte_in_the_head_is_refused() -> None:
    for broken in (0, 188 * 5, 188 * 21):
        head = bytearray(TS)
        head[broken] = 0x00
        assert recognise(bytes(head)) is None


def test_only_the_first_min_head_bytes_are_looked_at() -> None:
    head = bytearray(ts_packets(MIN_HEAD // 188 + 10))
    head[MIN_HEAD + 188 - MIN_HEAD % 188] = 0x00  # the first packet past MIN_HEAD is broken
    assert recognise(bytes(head)) is Container.MPEGTS


def test_a_single_g_is_not_ts() -> None:
    assert recognise(b"G" + bytes(MIN_HEAD - 1)) is None


# ---------------------------------------------------------------------------------------------------------------------
# sniff: ID3 skipping, then recognise, or where to read next


@pytest.mark.parametrize(("head", "container"), ACCEPTED.values(), ids=ACCEPTED.keys())
def test_sniff_without_tags(head: bytes, container: Container) -> None:
    assert sniff(head) == SniffResult(container, 0, None)


@pytest.mark.parametrize(("head", "container"), ACCEPTED.values(), ids=ACCEPTED.keys())
def test_sniff_past_two_tags_one_with_a_footer(head: bytes, container: Container) -> None:
    tags = id3_tag(300) + id3_tag(120, flags=0x10)
    result = sniff(tags + head)
    assert result == SniffResult(container, len(tags), None)
    assert result.content_offset == len(tags) == 2 * ID3_HEADER_SIZE + 420 + ID3_FOOTER_SIZE
    assert result.decided


@pytest.mark.parametrize("head", REFUSED.values(), ids=REFUSED.keys())
def test_sniff_refuses_whole_files_that_are_not_video(head: bytes) -> None:
    result = sniff(head, eof=True)
    assert result.container is None
    assert result.decided


def test_an_mp3_behind_its_tag_is_refused_with_the_tag_counted() -> None:
    assert sniff(MP3) == SniffResult(None, ID3_HEADER_SIZE + 1000, None)


def test_a_short_head_that_is_not_the_whole_file_asks_for_more() -> None:
    assert sniff(MP4[:100]) == SniffResult(None, 0, 0)


def test_a_short_file_is_decided_on_what_there_is() -> None:
    tiny = ftyp() + box(b"mdat", b"x")
    assert sniff(tiny, eof=True) == SniffResult(Container.MP4, 0, None)
    assert sniff(id3_tag(5) + tiny, eof=True) == SniffResult(Container.MP4, ID3_HEADER_SIZE + 5, None)


def test_a_tag_longer_than_the_head_says_where_the_content_may_start() -> None:
    tag = id3_tag(HEAD_READ * 3)
    whole = tag + MP4
    first = sniff(whole[:HEAD_READ])
    assert first == SniffResult(None, len(tag), len(tag))
    assert first.need_offset is not None
    second = sniff(whole[first.need_offset : first.need_offset + HEAD_READ], offset=first.need_offset)
    assert second == SniffResult(Container.MP4, len(tag), None)


def test_after_a_long_tag_another_tag_may_follow() -> None:
    big, small = id3_tag(HEAD_READ * 2), id3_tag(77, flags=0x10)
    whole = big + small + MKV
    first = sniff(whole[:HEAD_READ])
    assert first.need_offset == len(big)
    second = sniff(whole[len(big) : len(big) + HEAD_READ], offset=len(big))
    assert second == SniffResult(Container.MATROSKA, len(big) + len(small), None)


def test_a_header_cut_at_the_end_of_the_head_is_read_again_from_its_start() -> None:
    first_tag = id3_tag(HEAD_READ - ID3_HEADER_SIZE - 4)  # leaves 4 bytes of the next header in the head
    whole = first_tag + id3_tag(10) + AVI
    result = sniff(whole[:HEAD_READ])
    assert result == SniffResult(None, len(first_tag), len(first_tag))


def test_content_starting_too_near_the_end_of_the_head_is_read_again() -> None:
    tag = id3_tag(HEAD_READ - ID3_HEADER_SIZE - 100)
    result = sniff((tag + TS)[:HEAD_READ])
    assert result == SniffResult(None, len(tag), len(tag))


def test_a_file_that_is_only_id3_is_refused() -> None:
    assert sniff(id3_tag(50), eof=True) == SniffResult(None, ID3_HEADER_SIZE + 50, None)
    # a tag that says it runs past the end of the file
    cut = id3_tag(5000)[:300]
    assert sniff(cut, eof=True) == SniffResult(None, 300, None)


def test_the_offset_of_a_later_read_is_added() -> None:
    assert sniff(id3_tag(10) + WEBM, offset=1000) == SniffResult(Container.MATROSKA, 1020, None)


# ---------------------------------------------------------------------------------------------------------------------
# sniff_object: the read loop over an injected ranged reader


class FakeObject:
    """A stored file read by range, remembering each read.

    strict: refuse ranges that start at or past the end, as S3 does (the caller that passes `size` must not ask);
    otherwise such a read returns nothing, like a reader whose caller does not know the size.
    """

    def __init__(self, data: bytes, *, strict: bool = True) -> None:
        self.data = data
        self.strict = strict
        self.reads: list[tuple[int, int]] = []

    async def read(self, offset: int, length: int) -> bytes:
        self.reads.append((offset, length))
        assert length > 0
        if self.strict and offset >= len(self.data):
            raise AssertionError("InvalidRange: read past the end of the object")
        return self.data[offset : offset + length]


async def test_an_ordinary_file_takes_one_read() -> None:
    obj = FakeObject(id3_tag(500) + MP4 + bytes(HEAD_READ))
    assert await sniff_object(obj.read) == SniffResult(Container.MP4, 510, None)
    assert obj.reads == [(0, HEAD_READ)]


async def test_a_small_file_takes_one_read_with_or_without_its_size() -> None:
    data = ftyp() + box(b"mdat", b"abc")
    for size in (None, len(data)):
        obj = FakeObject(data)
        assert await sniff_object(obj.read, size=size) == SniffResult(Container.MP4, 0, None)
        assert len(obj.reads) == 1


async def test_with_the_size_known_no_read_asks_for_more_than_is_there() -> None:
    data = id3_tag(300) + MP4
    obj = FakeObject(data)
    await sniff_object(obj.read, size=len(data))
    assert obj.reads == [(0, len(data))]


async def test_long_tags_take_one_more_read_each() -> None:
    tags = id3_tag(HEAD_READ * 2) + id3_tag(HEAD_READ + 5, flags=0x10) + id3_tag(3)
    obj = FakeObject(tags + AVI + bytes(HEAD_READ))
    assert await sniff_object(obj.read) == SniffResult(Container.AVI, len(tags), None)
    assert len(obj.reads) == 3


async def test_it_gives_up_after_max_reads() -> None:
    obj = FakeObject(id3_tag(HEAD_READ) * (MAX_SNIFF_READS + 1) + MP4)
    result = await sniff_object(obj.read)
    assert result.container is None
    assert not result.decided
    assert len(obj.reads) == MAX_SNIFF_READS


async def test_a_tag_claiming_more_than_the_file_holds_is_refused_without_reading_past_the_end() -> None:
    data = id3_tag(HEAD_READ * 4)[: HEAD_READ + 10]
    obj = FakeObject(data)
    result = await sniff_object(obj.read, size=len(data))
    assert result.container is None and result.decided
    assert len(obj.reads) == 1


async def test_an_empty_file_is_refused_without_a_read_when_its_size_is_known() -> None:
    obj = FakeObject(b"")
    assert await sniff_object(obj.read, size=0) == SniffResult(None, 0, None)
    assert obj.reads == []


async def test_read_size_must_cover_min_head() -> None:
    with pytest.raises(ValueError):
        await sniff_object(FakeObject(MP4).read, read_size=MIN_HEAD - 1)


# properties: the decision does not depend on how the file is read, and no input makes the check raise

_contents = st.sampled_from([*ACCEPTED.values(), *((head, None) for head in REFUSED.values())])
_tags = st.lists(
    st.tuples(st.integers(0, 3 * MIN_HEAD), st.sampled_from([2, 3, 4]), st.sampled_from([0, 0x10, 0x40])),
    max_size=4,
)


@settings(max_examples=150, deadline=None)
@given(content=_contents, tags=_tags, read_size=st.sampled_from([MIN_HEAD, MIN_HEAD + 7, 3 * MIN_HEAD, HEAD_READ]))
async def test_reading_in_ranges_decides_as_reading_the_whole_file(
    content: tuple[bytes, Container | None], tags: list[tuple[int, int, int]], read_size: int
) -> None:
    head, container = content
    prefix = b"".join(id3_tag(body, major=major, flags=flags) for body, major, flags in tags)
    data = prefix + head
    whole = sniff(data, eof=True)
    assert whole == SniffResult(container, len(prefix), None) or (container is None and whole.container is None)
    for size in (None, len(data)):
        obj = FakeObject(data, strict=size is not None)
        assert await sniff_object(obj.read, size=size, read_size=read_size, max_reads=1000) == whole


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=2 * MIN_HEAD), offset=st.integers(0, 1 << 40), eof=st.booleans())
def test_no_bytes_make_the_check_raise(data: bytes, offset: int, eof: bool) -> None:
    result = sniff(data, offset=offset, eof=eof)
    assert result.id3_bytes_skipped >= offset
    assert result.need_offset is None or result.need_offset >= offset
    if eof:
        assert result.decided
    skip_id3v2(data, eof=eof)
    recognise(data)


@settings(max_examples=100, deadline=None)
@given(body=st.binary(max_size=MIN_HEAD), tags=_tags)
def test_id3_tags_never_change_what_follows_them(body: bytes, tags: list[tuple[int, int, int]]) -> None:
    prefix = b"".join(id3_tag(size, major=major, flags=flags) for size, major, flags in tags)
    result = sniff(prefix + body, eof=True)
    assert result.container == sniff(body, eof=True).container or body.startswith(b"ID3")


# ---------------------------------------------------------------------------------------------------------------------
# parse_ffmpeg_info on recorded `ffmpeg -hide_banner -i` output (several ffmpeg generations)

# ffmpeg 4.4, an iPhone MOV held upright: streams indented like their metadata, both the rotate tag and side data
IPHONE_FFMPEG4 = """\
Guessed Channel Layout for Input Stream #0.1 : mono
Input #0, mov,mp4,m4a,3gp,3g2,mj2, from 'IMG_0042.MOV':
  Metadata:
    major_brand     : qt
    minor_version   : 0
    compatible_brands: qt
    creation_time   : 2021-06-01T18:22:10.000000Z
    com.apple.quicktime.make: Apple
    com.apple.quicktime.model: iPhone 12
    com.apple.quicktime.software: 14.6
  Duration: 00:00:12.48, start: 0.000000, bitrate: 8023 kb/s
    Stream #0:0(und): Video: hevc (Main) (hvc1 / 0x31637668), yuv420p(tv, bt709), 1920x1080, 7885 kb/s, \
29.98 fps, 29.97 tbr, 600 tbn, 600 tbc (default)
    Metadata:
      rotate          : 90
      creation_time   : 2021-06-01T18:22:10.000000Z
      handler_name    : Core Media Video
      encoder         : HEVC
    Side data:
      displaymatrix: rotation of -90.00 degrees
    Stream #0:1(und): Audio: aac (LC) (mp4a / 0x6134706D), 44100 Hz, mono, fltp, 94 kb/s (default)
    Metadata:
      creation_time   : 2021-06-01T18:22:10.000000Z
      handler_name    : Core Media Audio
    Stream #0:2(und): Data: none (mebx / 0x7862656D), 0 kb/s (default)
    Metadata:
      creation_time   : 2021-06-01T18:22:10.000000Z
      handler_name    : Core Media Metadata
At least one output file must be specified
"""

# ffmpeg 7.0, an Android MP4 in portrait: side data nested under the stream, "Display Matrix" spelled out
ANDROID_FFMPEG7 = """\
Input #0, mov,mp4,m4a,3gp,3g2,mj2, from 'https://s3.example/weir/videos/abc?X-Amz-Signature=0123':
  Metadata:
    major_brand     : isom
    minor_version   : 131072
    compatible_brands: isomiso2mp41
    creation_time   : 2024-02-11T09:15:31.000000Z
    com.android.version: 14
  Duration: 00:00:31.07, start: 0.000000, bitrate: 17241 kb/s
  Stream #0:0[0x1](eng): Video: h264 (High) (avc1 / 0x31637661), yuv420p(tv, bt709, progressive), 1920x1080, \
16998 kb/s, SAR 1:1 DAR 16:9, 30 fps, 30 tbr, 90k tbn (default)
      Metadata:
        creation_time   : 2024-02-11T09:15:31.000000Z
        handler_name    : VideoHandle
        vendor_id       : [0][0][0][0]
      Side data:
        Display Matrix: rotation of -90.00 degrees
  Stream #0:1[0x2](eng): Audio: aac (LC) (mp4a / 0x6134706D), 48000 Hz, stereo, fltp, 256 kb/s (default)
      Metadata:
        creation_time   : 2024-02-11T09:15:31.000000Z
        handler_name    : SoundHandle
        vendor_id       : [0][0][0][0]
At least one output file must be specified
"""

# ffmpeg 9.0 (this repository's imageio-ffmpeg), an MP4 written with -display_rotation 90
ROTATED_FFMPEG9 = """\
Input #0, mov,mp4,m4a,3gp,3g2,mj2, from 'rot.mp4':
  Metadata:
    major_brand     : isom
    minor_version   : 512
    compatible_brands: isomiso2avc1mp41
    encoder         : Lavf63.1.102
  Duration: 00:00:01.00, start: 0.000000, bitrate: 446 kb/s
  Stream #0:0[0x1](und): Video: h264 (High 4:4:4 Predictive) (avc1 / 0x31637661), yuv444p(progressive), 1280x720 \
[SAR 1:1 DAR 16:9], 358 kb/s, 25 fps, 25 tbr, 12800 tbn (default)
    Metadata:
      handler_name    : VideoHandler
      encoder         : Lavc63.1.102 libx264
    Side data:
      Display Matrix: rotation of 90.00 degrees
  Stream #0:1[0x2](und): Audio: aac (LC) (mp4a / 0x6134706D), 44100 Hz, mono, fltp, 70 kb/s (default)
    Metadata:
      handler_name    : SoundHandler
At least one output file must be specified
"""

# ffmpeg 9.0, an MKV with two video streams (and a rotation on the second that must not leak onto the first)
TWO_VIDEO_MKV = """\
Input #0, matroska,webm, from 'two.mkv':
  Metadata:
    ENCODER         : Lavf63.1.102
  Duration: 00:00:01.00, start: 0.000000, bitrate: 633 kb/s
  Stream #0:0: Video: h264 (High 4:4:4 Predictive), yuv444p(tv, progressive), 1280x720 [SAR 1:1 DAR 16:9], 25 fps, \
25 tbr, 1k tbn (default)
    Metadata:
      ENCODER         : Lavc63.1.102 libx264
      DURATION        : 00:00:01.000000000
  Stream #0:1: Video: h264 (High 4:4:4 Predictive), yuv444p(tv, progressive), 640x360 [SAR 1:1 DAR 16:9], 25 fps, \
25 tbr, 1k tbn
    Metadata:
      ENCODER         : Lavc63.1.102 libx264
      DURATION        : 00:00:01.000000000
    Side data:
      Display Matrix: rotation of -90.00 degrees
At least one output file must be specified
"""

# ffmpeg 6.1, a WebM from a browser's MediaRecorder: no duration in the header
WEBM_NO_DURATION = """\
Input #0, matroska,webm, from 'recording.webm':
  Metadata:
    encoder         : Chrome
  Duration: N/A, start: 0.000000, bitrate: N/A
  Stream #0:0(eng): Audio: opus, 48000 Hz, mono, fltp (default)
  Stream #0:1(eng): Video: vp8, yuv420p(progressive), 640x480, SAR 1:1 DAR 4:3, 30.30 fps, 30 tbr, 1k tbn (default)
At least one output file must be specified
"""

# ffmpeg 5.1, MPEG-TS: a program header between Duration and the streams
TS_FFMPEG5 = """\
Input #0, mpegts, from 'camera.ts':
  Duration: 00:01:04.32, start: 1.400000, bitrate: 6145 kb/s
  Program 1
    Metadata:
      service_name    : Service01
      service_provider: FFmpeg
  Stream #0:0[0x100]: Video: h264 (Main) ([27][0][0][0] / 0x001B), yuv420p(tv, bt709, progressive), 1920x1080 \
[SAR 1:1 DAR 16:9], 25 fps, 25 tbr, 90k tbn
  Stream #0:1[0x101](und): Audio: aac (LC) ([15][0][0][0] / 0x000F), 48000 Hz, stereo, fltp, 130 kb/s
At least one output file must be specified
"""

# ffmpeg 9.0, an MP3: audio only
MP3_ONLY = """\
Input #0, mp3, from 'a.mp3':
  Metadata:
    encoder         : Lavf63.1.102
  Duration: 00:00:01.00, start: 0.025057, bitrate: 68 kb/s
  Stream #0:0: Audio: mp3 (mp3float), 44100 Hz, mono, fltp, 64 kb/s, start 0.025057
At least one output file must be specified
"""

# ffmpeg 6.0, an MP3 with cover art: the picture is a "video" stream, but not the video
MP3_WITH_COVER = """\
Input #0, mp3, from 'song.mp3':
  Metadata:
    title           : A Song
    artist          : Someone
  Duration: 00:03:21.12, start: 0.025057, bitrate: 320 kb/s
  Stream #0:0: Audio: mp3, 44100 Hz, stereo, fltp, 320 kb/s
  Stream #0:1: Video: mjpeg (Baseline), yuvj420p(pc, bt470bg/unknown/unknown), 600x600 [SAR 1:1 DAR 1:1], 90k tbr, \
90k tbn (attached pic)
    Metadata:
      comment         : Cover (front)
At least one output file must be specified
"""

# ffmpeg 9.0 on a file it cannot open
NOT_MEDIA = """\
[in#0 @ 0x5600015170c0] moov atom not found
[in#0 @ 0x560001516d40] Error opening input: Invalid data found when processing input
Error opening input file id3_out.mp4.
Error opening input files: Invalid data found when processing input
"""

# ffmpeg 6.0, a stream whose size it could not find within the probe, then a usable one; an AVI with a rotate tag only
NO_SIZE_THEN_AVI = """\
[h264 @ 0x55d0] non-existing PPS 0 referenced
Input #0, avi, from 'clip.avi':
  Duration: 00:00:04.00, start: 0.000000, bitrate: 2400 kb/s
  Stream #0:0: Video: h264 (H264 / 0x34363248), none, 0x0, 25 fps, 25 tbr, 25 tbn
  Stream #0:1: Video: mpeg4 (Simple Profile) (FMP4 / 0x34504D46), yuv420p, 720x576 [SAR 16:15 DAR 4:3], 2200 kb/s, \
25 fps, 25 tbr, 25 tbn
    Metadata:
      rotate          : 180
At least one output file must be specified
"""


def _unwrap(text: str) -> str:
    return text.replace("\\\n", "")


@pytest.mark.parametrize(
    ("stderr", "expected"),
    [
        pytest.param(
            IPHONE_FFMPEG4, VideoInfo(1080, 1920, "hevc", 12.48, 90, 1920, 1080), id="iphone ffmpeg4 rotate tag"
        ),
        pytest.param(
            ANDROID_FFMPEG7, VideoInfo(1080, 1920, "h264", 31.07, 90, 1920, 1080), id="android ffmpeg7 display matrix"
        ),
        pytest.param(ROTATED_FFMPEG9, VideoInfo(720, 1280, "h264", 1.0, 270, 1280, 720), id="ffmpeg9 rotation"),
        pytest.param(TWO_VIDEO_MKV, VideoInfo(1280, 720, "h264", 1.0, 0, 1280, 720), id="mkv two video streams"),
        pytest.param(WEBM_NO_DURATION, VideoInfo(640, 480, "vp8", None, 0, 640, 480), id="webm audio first"),
        pytest.param(TS_FFMPEG5, VideoInfo(1920, 1080, "h264", 64.32, 0, 1920, 1080), id="ts with program"),
        pytest.param(NO_SIZE_THEN_AVI, VideoInfo(720, 576, "mpeg4", 4.0, 180, 720, 576), id="sizeless stream skipped"),
    ],
)
def test_parse_ffmpeg_info(stderr: str, expected: VideoInfo) -> None:
    assert parse_ffmpeg_info(_unwrap(stderr)) == expected


@pytest.mark.parametrize(
    "stderr",
    [
        pytest.param(MP3_ONLY, id="audio only"),
        pytest.param(MP3_WITH_COVER, id="cover art is not video"),
        pytest.param(NOT_MEDIA, id="ffmpeg could not open it"),
        pytest.param("", id="nothing"),
    ],
)
def test_parse_ffmpeg_info_without_video(stderr: str) -> None:
    assert parse_ffmpeg_info(_unwrap(stderr)) is None


def _with_rotation(line: str) -> str:
    return _unwrap(ROTATED_FFMPEG9).replace("Display Matrix: rotation of 90.00 degrees", line)


@pytest.mark.parametrize(
    ("line", "rotation", "height"),
    [
        ("Display Matrix: rotation of 90.00 degrees", 270, 1280),
        ("Display Matrix: rotation of -90.00 degrees", 90, 1280),
        ("displaymatrix: rotation of -270.00 degrees", 270, 1280),
        ("displaymatrix: rotation of 180.00 degrees", 180, 720),
        ("displaymatrix: rotation of -0.00 degrees", 0, 720),
        ("displaymatrix: rotation of 45.00 degrees", 315, 720),  # not a quarter turn: ffmpeg does not rotate it
        ("displaymatrix: rotation of -89.99 degrees", 90, 1280),
    ],
)
def test_rotation_turns_the_display_height(line: str, rotation: int, height: int) -> None:
    info = parse_ffmpeg_info(_with_rotation(line))
    assert info is not None
    assert (info.rotation, info.display_height, info.coded_height) == (rotation, height, 720)


def test_the_display_matrix_wins_over_a_stale_rotate_tag() -> None:
    stderr = _with_rotation("Display Matrix: rotation of -90.00 degrees").replace(
        "      handler_name    : VideoHandler", "      rotate          : 180\n      handler_name    : VideoHandler"
    )
    info = parse_ffmpeg_info(stderr)
    assert info is not None and info.rotation == 90


def test_a_codec_tag_in_hex_is_not_a_size() -> None:
    stderr = "  Stream #0:0: Video: h264 (avc1 / 0x31637661), none, 0x0\n  Stream #0:1: Video: rawvideo (0x3 / 0x3)\n"
    assert parse_ffmpeg_info(stderr) is None


def test_streams_of_a_second_input_are_not_read() -> None:
    assert parse_ffmpeg_info("  Stream #1:0: Video: h264, yuv420p, 1920x1080, 25 fps\n") is None


# ---------------------------------------------------------------------------------------------------------------------
# how probe calls ffmpeg (pure parts)


def test_a_local_path_is_always_a_file() -> None:
    assert ffmpeg_input("/tmp/a:b.mp4") == "file:/tmp/a:b.mp4"
    assert ffmpeg_protocols("/tmp/a.mp4") == "file"


def test_a_url_is_read_over_http_only() -> None:
    url = "https://s3.example/b/k?X-Amz-Signature=abc&X-Amz-Expires=300"
    assert ffmpeg_input(url) == url
    assert ffmpeg_protocols(url) == "https,http,tls,tcp"


def test_skipped_id3_bytes_are_read_through_subfile() -> None:
    url = "https://s3.example/b/k?sig=1"
    assert ffmpeg_input(url, skip=420) == f"subfile,,start,420,end,0,,:{url}"
    assert ffmpeg_protocols(url, skip=420) == "https,http,tls,tcp,subfile"
    assert ffmpeg_input("/x.mp4", skip=10) == "subfile,,start,10,end,0,,:file:/x.mp4"


def test_probe_args_bound_the_read_and_force_the_sniffed_demuxer() -> None:
    args = ffmpeg_probe_args("/x.ts", container=Container.MPEGTS)
    assert args[-2:] == ["-i", "file:/x.ts"]
    assert args[args.index("-probesize") + 1] == str(PROBE_BYTES)
    assert args[args.index("-f") + 1] == "mpegts"
    assert "-f" not in ffmpeg_probe_args("/x.ts")
    # whatever the bytes, only the four accepted demuxers may open the input
    assert args[args.index("-format_whitelist") + 1] == "mov,matroska,avi,mpegts"
    for container in Container:
        assert ffmpeg_probe_args("/x", container=container)[-3] == DEMUXER[container]
