"""What an uploaded file is, from its first bytes (SPEC section 4, "Content check"). Pure: no I/O, no clock.

A file may begin with any number of ID3v2 tags (some tools tag videos as if they were MP3s); they are skipped, and the
container is recognised on the bytes where the content starts. An ID3 tag can be larger than any sensible first read
(cover art), so `sniff` says where the caller must read next, and `sniff_object` runs that loop over an injected
ranged reader (an S3 ranged GET in the api, a byte string in the tests).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum


class Container(StrEnum):
    """The containers Weir accepts; the value names it in events and rows."""

    MP4 = "mp4"  # ISO BMFF: MP4, MOV, 3GP, M4V
    MATROSKA = "matroska"  # MKV and WebM
    AVI = "avi"
    MPEGTS = "mpegts"  # 188-byte TS, 192-byte M2TS (Blu-ray/AVCHD), 204-byte TS


MIN_HEAD = 4096  # bytes from the content start that `recognise` decides on (fewer only when the file is shorter)
HEAD_READ = 64 * 1024  # what a caller reads per round: the file's start, then the range past long ID3 tags
MAX_SNIFF_READS = 8  # ranged reads before giving up on a chain of huge ID3 tags (each tag is at most 256 MiB)

ID3_HEADER_SIZE = 10
ID3_FOOTER_SIZE = 10
_ID3_FOOTER_FLAG = 0x10  # ID3v2.4 only: a 10-byte footer follows the tag body

EBML_MAGIC = b"\x1a\x45\xdf\xa3"
TS_SYNC = 0x47
TS_MIN_PACKETS = 3
# (packet size, offset of the sync byte in a packet): plain TS, M2TS with its 4-byte timecode, TS with 16 bytes of RS
_TS_LAYOUTS = ((188, 0), (192, 4), (204, 0))

# QuickTime files written before `ftyp` existed (and some cameras since) start straight with these top-level atoms.
_QT_SKIPPABLE = frozenset({b"wide", b"free", b"skip", b"pnot", b"PICT"})
_QT_MOOV_FIRST_CHILD = frozenset({b"mvhd", b"cmov"})  # the movie header, or a compressed movie


@dataclass(frozen=True, slots=True)
class SniffResult:
    """What `sniff` could tell from the bytes it was given.

    container: the recognised container, or None (unsupported, or undecided while need_offset is set).
    id3_bytes_skipped: bytes of ID3v2 tags before the content (as far as known), i.e. the content's offset in the file.
    need_offset: None when decided; otherwise read from this file offset (HEAD_READ bytes) and call `sniff` again
        with offset=need_offset.
    """

    container: Container | None
    id3_bytes_skipped: int
    need_offset: int | None = None

    @property
    def content_offset(self) -> int:
        """Where the content starts in the file: every byte before it is an ID3v2 tag."""
        return self.id3_bytes_skipped

    @property
    def decided(self) -> bool:
        return self.need_offset is None


def syncsafe(value: int) -> bytes:
    """The 4-byte ID3v2 syncsafe encoding of value (7 bits a byte), as written in tag headers."""
    if not 0 <= value < 1 << 28:
        raise ValueError(f"syncsafe integers hold 28 bits, not {value}")
    return bytes((value >> shift) & 0x7F for shift in (21, 14, 7, 0))


def _id3_header_byte_ok(index: int, byte: int) -> bool:
    if index < 3:
        return byte == b"ID3"[index]
    if index == 3:
        return 2 <= byte <= 4  # ID3v2.2, 2.3, 2.4
    if index == 4:
        return byte != 0xFF  # revision
    if index == 5:
        return True  # flags: unknown bits are tolerated, as ffmpeg does
    return byte < 0x80  # syncsafe size: a byte with its top bit set means this is not an ID3 header


def _id3_tag_length(head: bytes, pos: int) -> int | None:
    """Length of the ID3v2 tag at pos (header, body, footer); 0 if there is none; None if head ends too soon to tell."""
    header = head[pos : pos + ID3_HEADER_SIZE]
    for index, byte in enumerate(header):
        if not _id3_header_byte_ok(index, byte):
            return 0
    if len(header) < ID3_HEADER_SIZE:
        return None
    size = (header[6] << 21) | (header[7] << 14) | (header[8] << 7) | header[9]
    footer = ID3_FOOTER_SIZE if header[3] == 4 and header[5] & _ID3_FOOTER_FLAG else 0
    return ID3_HEADER_SIZE + size + footer


def _walk_id3(head: bytes) -> tuple[int, bool]:
    """(offset after the consecutive ID3v2 tags at the start of head, whether head shows that no other tag follows)."""
    pos = 0
    while True:
        length = _id3_tag_length(head, pos)
        if length is None:
            return pos, False
        if length == 0:
            return pos, True
        pos += length


def skip_id3v2(head: bytes, *, eof: bool = False) -> int | None:
    """Offset after any consecutive ID3v2 tags at the start of head; None if head is too short to know.

    eof: head holds the whole file, so a header or tag cut short by its end is not waited for.
    """
    pos, known = _walk_id3(head)
    if known:
        return pos
    if eof:
        return min(pos, len(head))
    return None


def _is_mpegts(head: bytes) -> bool:
    for packet, sync_at in _TS_LAYOUTS:
        positions = range(sync_at, len(head), packet)
        if len(positions) >= TS_MIN_PACKETS and all(head[p] == TS_SYNC for p in positions):
            return True
    return False


def _is_bare_quicktime(head: bytes) -> bool:
    """A QuickTime movie without `ftyp`: its top-level atoms, walked within head, reach `mdat` or a real `moov`.

    Walking the atom sizes (rather than matching four letters at byte 4) is what keeps a text file that says "free"
    at byte 4 from passing: its "size" is some huge number that leads nowhere inside the head.
    """
    pos = 0
    while pos + 8 <= len(head):
        size = int.from_bytes(head[pos : pos + 4], "big")
        kind = head[pos + 4 : pos + 8]
        header = 8
        if size == 1:  # 64-bit size follows the type
            if pos + 16 > len(head):
                return False
            size = int.from_bytes(head[pos + 8 : pos + 16], "big")
            header = 16
        if size < header:  # 0 ("to the end of the file") cannot precede the moov a movie needs
            return False
        if kind == b"mdat":
            return True
        if kind == b"moov":
            return head[pos + header + 4 : pos + header + 8] in _QT_MOOV_FIRST_CHILD
        if kind not in _QT_SKIPPABLE:
            return False
        pos += size
    return False


def recognise(content_head: bytes) -> Container | None:
    """The container whose first bytes these are (ID3 tags already skipped), or None if it is none Weir accepts.

    Pass at least MIN_HEAD bytes from the content start (fewer only when the file is shorter); only the first MIN_HEAD
    are looked at, so the answer does not depend on how much the caller read.
    """
    head = content_head[:MIN_HEAD]
    if head[4:8] == b"ftyp":
        return Container.MP4
    if head[:4] == EBML_MAGIC:
        return Container.MATROSKA
    if head[:4] == b"RIFF" and head[8:12] == b"AVI ":
        return Container.AVI
    if _is_mpegts(head):
        return Container.MPEGTS
    if _is_bare_quicktime(head):
        return Container.MP4
    return None


def sniff(head: bytes, *, offset: int = 0, eof: bool = False) -> SniffResult:
    """Skip the ID3v2 tags in head and recognise the content after them, or say where to read next.

    head: the file's bytes from `offset`, which is 0 or the need_offset of a previous result (a point where tags
        may continue or the content starts).
    eof: head runs to the end of the file (the read returned fewer bytes than asked).
    """
    pos, known = _walk_id3(head)
    if not known and not eof:
        return SniffResult(None, offset + pos, offset + pos)
    pos = min(pos, len(head))
    content = head[pos:]
    if len(content) < MIN_HEAD and not eof:
        return SniffResult(None, offset + pos, offset + pos)
    return SniffResult(recognise(content), offset + pos, None)


RangeReader = Callable[[int, int], Awaitable[bytes]]
"""(offset, length) -> the file's bytes there; fewer than length only at the end of the file."""


async def sniff_object(
    read_range: RangeReader,
    *,
    size: int | None = None,
    read_size: int = HEAD_READ,
    max_reads: int = MAX_SNIFF_READS,
) -> SniffResult:
    """Run `sniff` over ranged reads until it decides; still undecided after max_reads means unsupported.

    size: the file's size when known (S3 HEAD): no read then starts at or past the end (S3 answers those 416), and
        none asks for more than is there. The result's container is None both for "not a video Weir accepts" and for
        "gave up"; either way the upload is refused. A typical file takes one read.
    """
    if read_size < MIN_HEAD:
        raise ValueError(f"read_size must be at least MIN_HEAD ({MIN_HEAD})")
    offset = 0
    result = SniffResult(None, 0, 0)
    for _ in range(max_reads):
        if size is not None:
            length = max(0, min(read_size, size - offset))
            data = await read_range(offset, length) if length else b""
            eof = offset + len(data) >= size
        else:
            data = await read_range(offset, read_size)
            eof = len(data) < read_size
        result = sniff(data, offset=offset, eof=eof)
        if result.need_offset is None:
            return result
        offset = result.need_offset
    return result
