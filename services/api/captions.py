"""Caption tracks' decisions as plain functions: language tags, reading a WebVTT or SubRip file (a SubRip one is
turned into WebVTT), the track list's rules, and the HLS lines that offer the tracks to players.

No I/O. A track is stored as WebVTT (what HLS players and `<track>` read) under the video's prefix, and listed on the
video row (`videos.captions`, a JSON array in upload order), so that the master playlist and `GET /v1/videos/{id}`
need no other read.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from shared.media.playback import video_prefix

GROUP: Final = "subs"  # the one SUBTITLES group of a master playlist
# what an SDH track (closed captions: speech and the sounds) tells players, as Apple's HLS authoring spec names it
CLOSED_CAPTIONS_CHARACTERISTICS: Final = ("public.accessibility.transcribes-spoken-dialog,"
                                          "public.accessibility.describes-music-and-sound")
NAME_MAX: Final = 100
MEDIA_TYPES: Final = frozenset({"text/vtt", "text/plain", "application/x-subrip", "text/srt", "application/srt"})

# BCP 47 (RFC 5646) as players and HLS's LANGUAGE use it: a language, optional script, region and variants
_TAG = re.compile(r"^(?P<language>[A-Za-z]{2,3})(?:-(?P<script>[A-Za-z]{4}))?(?:-(?P<region>[A-Za-z]{2}|[0-9]{3}))?"
                  r"(?P<variants>(?:-(?:[A-Za-z0-9]{5,8}|[0-9][A-Za-z0-9]{3}))*)$")
_VTT_TIME = r"(?:(\d{2,}):)?([0-5]\d):([0-5]\d)\.(\d{3})"
_VTT_TIMING = re.compile(rf"^{_VTT_TIME}[ \t]+-->[ \t]+{_VTT_TIME}(?:[ \t]+.*)?$")
_SRT_TIME = r"(\d{1,3}):([0-5]?\d):([0-5]?\d)[,.](\d{1,3})"
_SRT_TIMING = re.compile(rf"^{_SRT_TIME}[ \t]*-->[ \t]*{_SRT_TIME}(?:[ \t]+.*)?$")
_HEADER = re.compile(r"^WEBVTT(?:[ \t].*)?$")


def language_tag(raw: str) -> str | None:
    """The tag in its canonical case (`en`, `pt-BR`, `zh-Hant-TW`, `es-419`), or None when it is no BCP 47 tag of the
    kind HLS and browsers take."""
    m = _TAG.match(raw) if len(raw) <= 35 else None
    if m is None:
        return None
    parts = [m["language"].lower()]
    if m["script"]:
        parts.append(m["script"].title())
    if m["region"]:
        parts.append(m["region"].upper())
    parts += [v.lower() for v in m["variants"].split("-") if v]
    return "-".join(parts)


def name_problem(name: str) -> str | None:
    """Why a track's name cannot be shown to viewers (and quoted in a playlist), or None."""
    if not name.strip():
        return "name must not be blank"
    if len(name) > NAME_MAX:
        return f"name is at most {NAME_MAX} characters"
    if '"' in name or any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in name):
        return "name must not contain a double quote or a control character"
    return None


class CaptionsRefused(ValueError):
    """The file is not captions this api reads; the message says where and why (the route answers 400)."""


@dataclass(frozen=True)
class CaptionFile:
    text: str  # WebVTT
    cues: int
    source_format: str  # "webvtt" | "srt"
    last_end: float  # the last cue's end, seconds


def _seconds(groups: Sequence[str | None]) -> float:
    hours, minutes, secs, millis = groups
    return int(hours or 0) * 3600 + int(minutes or 0) * 60 + int(secs or 0) + int((millis or "0").ljust(3, "0")) / 1000


def _timing(line: str, pattern: re.Pattern[str], number: int) -> tuple[float, float] | None:
    m = pattern.match(line)
    if m is None:
        return None
    start, end = _seconds(m.groups()[:4]), _seconds(m.groups()[4:8])
    if end <= start:
        raise CaptionsRefused(f"line {number}: a cue must end after it starts")
    return start, end


def _decoded(body: bytes) -> str:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CaptionsRefused(f"the file is not UTF-8 (byte {exc.start})") from None
    if "\x00" in text:
        raise CaptionsRefused("the file contains a NUL character")
    return text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")


def _blocks(lines: list[str], first: int) -> list[tuple[int, list[str]]]:
    """The blank-line separated blocks from `lines[first:]`, each with its first line's number (1-based)."""
    blocks: list[tuple[int, list[str]]] = []
    current: list[str] = []
    start = 0
    for i in range(first, len(lines)):
        if lines[i].strip() == "":
            if current:
                blocks.append((start, current))
                current = []
            continue
        if not current:
            start = i + 1
        current.append(lines[i])
    if current:
        blocks.append((start, current))
    return blocks


def _webvtt(text: str) -> CaptionFile:
    lines = text.split("\n")
    header_end = next((i for i, line in enumerate(lines) if line.strip() == ""), len(lines))
    cues, last_end = 0, 0.0
    for number, block in _blocks(lines, header_end):
        head = block[0]
        if head.startswith("NOTE") and (len(head) == 4 or head[4] in " \t"):
            continue
        if head in ("STYLE", "REGION") or head.startswith(("STYLE ", "REGION ")):
            if cues:
                raise CaptionsRefused(f"line {number}: {head.split()[0]} blocks go before the first cue")
            continue
        if not any("-->" in line for line in block[:2]):
            raise CaptionsRefused(f"line {number}: neither a cue (its timing hh:mm:ss.ttt --> hh:mm:ss.ttt, perhaps "
                                  "after an identifier) nor a NOTE, STYLE or REGION block")
        at = 0 if "-->" in head else 1  # an optional cue identifier first
        timing = _timing(block[at].strip(), _VTT_TIMING, number + at)
        if timing is None:
            raise CaptionsRefused(f"line {number + at}: not a cue timing (hh:mm:ss.ttt --> hh:mm:ss.ttt)")
        if any("-->" in payload for payload in block[at + 1:]):
            raise CaptionsRefused(f"line {number + at + 1}: a cue's text must not contain -->")
        cues += 1
        last_end = max(last_end, timing[1])
    return CaptionFile(text if text.endswith("\n") else text + "\n", cues, "webvtt", last_end)


def _vtt_stamp(seconds: float) -> str:
    millis = round(seconds * 1000)
    hours, rest = divmod(millis, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    return f"{hours:02d}:{minutes:02d}:{rest // 1000:02d}.{rest % 1000:03d}"


def _srt(text: str) -> CaptionFile:
    lines = text.split("\n")
    out = ["WEBVTT", ""]
    cues, last_end = 0, 0.0
    for number, block in _blocks(lines, 0):
        if not any("-->" in line for line in block[:2]):
            raise CaptionsRefused(f"line {number}: not a cue (its number, then hh:mm:ss,ttt --> hh:mm:ss,ttt)")
        at = 0 if "-->" in block[0] else 1  # the cue's number first
        timing = _timing(block[at].strip(), _SRT_TIMING, number + at)
        if timing is None:
            raise CaptionsRefused(f"line {number + at}: not a SubRip timing (hh:mm:ss,ttt --> hh:mm:ss,ttt)")
        payload = block[at + 1:]
        if any("-->" in p for p in payload):
            raise CaptionsRefused(f"line {number + at + 1}: a cue's text must not contain -->")
        if at:
            out.append(block[0].strip())
        out.append(f"{_vtt_stamp(timing[0])} --> {_vtt_stamp(timing[1])}")
        out += payload
        out.append("")
        cues += 1
        last_end = max(last_end, timing[1])
    return CaptionFile("\n".join(out), cues, "srt", last_end)


def _looks_srt(text: str) -> bool:
    """A SubRip file begins with a cue: its number and timing line, or the timing line alone."""
    head = [line.strip() for line in text.split("\n") if line.strip()][:2]
    if not head:
        return False
    return bool(_SRT_TIMING.match(head[0]) or (head[0].isdigit() and len(head) > 1 and _SRT_TIMING.match(head[1])))


def read_captions(body: bytes) -> CaptionFile:
    """The file as WebVTT: a WebVTT file checked (its header, each block, each cue's timing), or a SubRip (.srt) file
    turned into one. Raises CaptionsRefused saying why, naming the line."""
    if not body.strip():
        raise CaptionsRefused("the file is empty")
    text = _decoded(body)
    first = text.split("\n", 1)[0]
    if first.startswith("WEBVTT"):
        if not _HEADER.match(first):
            raise CaptionsRefused("line 1: WEBVTT must be followed by a space, a tab or the end of the line")
        read = _webvtt(text)
    elif _looks_srt(text):
        read = _srt(text)
    else:
        raise CaptionsRefused("the file is neither WebVTT (its first line is WEBVTT) nor SubRip (.srt)")
    if read.cues == 0:
        raise CaptionsRefused("the file has no cues")
    return read


# --------------------------------------------------------------------------------------------- the track list


@dataclass(frozen=True)
class Track:
    language: str
    name: str
    closed_captions: bool
    key: str  # where the WebVTT is stored
    size: int
    cues: int
    created_at: str  # ISO 8601, as the row keeps it
    updated_at: str

    @property
    def version(self) -> str:
        """Changes with the file: players' URLs carry it, so a replaced track is fetched anew."""
        return self.key.rsplit("-", 1)[-1].removesuffix(".vtt")

    def stored(self) -> dict[str, Any]:
        return {"language": self.language, "name": self.name, "closed_captions": self.closed_captions,
                "key": self.key, "size": self.size, "cues": self.cues, "created_at": self.created_at,
                "updated_at": self.updated_at}


def tracks_of(stored: Any) -> list[Track]:
    """The video row's tracks; an entry this release cannot read (a newer one's) is left out."""
    found = []
    for item in stored if isinstance(stored, list) else ():
        if not isinstance(item, Mapping):
            continue
        try:
            found.append(Track(str(item["language"]), str(item["name"]), bool(item["closed_captions"]),
                               str(item["key"]), int(item["size"]), int(item["cues"]), str(item["created_at"]),
                               str(item.get("updated_at") or item["created_at"])))
        except (KeyError, TypeError, ValueError):
            continue
    return found


def caption_key(video_id: str, language: str, text: str) -> str:
    """Where a track's file is stored: its content's digest in the name, so a replaced file is a new object."""
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return f"{video_prefix(video_id)}captions/{language}-{digest}.vtt"


def placed(stored: Any, track: Track, *, most: int) -> tuple[list[Any], Track | None] | str:
    """The video's track list with `track` added, or put in place of the one of its language (which keeps its
    `created_at`), and the one it replaced; or why not (the route answers 409): a name another language's track has
    (a playlist's names are unique in their group), or more tracks than `most`."""
    tracks = tracks_of(stored)
    replaced = next((t for t in tracks if t.language == track.language), None)
    if any(t.name == track.name and t.language != track.language for t in tracks):
        return f"another caption track of this video is named {track.name!r}"
    if replaced is None and len(tracks) >= most:
        return f"the video has {len(tracks)} caption tracks, the most it may have"
    if replaced is not None:
        track = Track(track.language, track.name, track.closed_captions, track.key, track.size, track.cues,
                      replaced.created_at, track.updated_at)
    kept: list[Any] = [track.stored() if t.language == track.language else t.stored() for t in tracks]
    if replaced is None:
        kept.append(track.stored())
    # entries this release could not read stay as they were
    unread: list[Any] = [item for item in (stored if isinstance(stored, list) else ())
              if isinstance(item, Mapping) and not tracks_of([item])]
    return kept + unread, replaced


def removed(stored: Any, language: str) -> tuple[list[Any], Track] | None:
    """The list without `language`'s track, and that track; None when it has none."""
    gone = next((t for t in tracks_of(stored) if t.language == language), None)
    if gone is None:
        return None
    return [item for item in stored if not (isinstance(item, Mapping) and item.get("language") == language)], gone


# --------------------------------------------------------------------------------------------- playlists


def media_lines(tracks: Sequence[tuple[Track, str]]) -> list[str]:
    """The master playlist's EXT-X-MEDIA lines of (track, its subtitle playlist's URI), in the list's order. None is
    DEFAULT (a player shows none until asked); each AUTOSELECT, so a player may pick one by the viewer's language."""
    lines = []
    for track, uri in tracks:
        attributes = [f"TYPE=SUBTITLES,GROUP-ID=\"{GROUP}\"", f'LANGUAGE="{track.language}"', f'NAME="{track.name}"',
                      "DEFAULT=NO", "AUTOSELECT=YES", "FORCED=NO"]
        if track.closed_captions:
            attributes.append(f'CHARACTERISTICS="{CLOSED_CAPTIONS_CHARACTERISTICS}"')
        attributes.append(f'URI="{uri}"')
        lines.append("#EXT-X-MEDIA:" + ",".join(attributes))
    return lines


def subtitle_playlist(vtt_uri: str, duration: float) -> str:
    """A track's media playlist: the whole WebVTT file as one segment lasting the video."""
    length = max(duration, 0.001)
    return "\n".join([
        "#EXTM3U", "#EXT-X-VERSION:7", f"#EXT-X-TARGETDURATION:{math.ceil(length)}", "#EXT-X-MEDIA-SEQUENCE:0",
        "#EXT-X-PLAYLIST-TYPE:VOD", f"#EXTINF:{length:.3f},", vtt_uri, "#EXT-X-ENDLIST",
    ]) + "\n"
