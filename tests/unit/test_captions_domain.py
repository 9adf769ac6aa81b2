"""Caption tracks' rules (services/api/captions.py): language tags, reading WebVTT and SubRip, the track list, and
the HLS lines; the master playlist's SUBTITLES (services/api/playback.py). Pure functions, no servers."""

from __future__ import annotations

import itertools
from typing import Any

import m3u8
import pytest

from services.api import captions, playback
from shared.media.playback import HlsRendition

# ----------------------------------------------------------------------------------------------- language tags


@pytest.mark.parametrize(("raw", "tag"), [
    ("en", "en"), ("EN", "en"), ("fil", "fil"), ("pt-br", "pt-BR"), ("PT-BR", "pt-BR"), ("es-419", "es-419"),
    ("zh-hant", "zh-Hant"), ("ZH-HANT-TW", "zh-Hant-TW"), ("sl-rozaj", "sl-rozaj"), ("de-CH-1901", "de-CH-1901"),
    ("sr-Latn-RS", "sr-Latn-RS"),
])
def test_a_language_tag_is_read_in_its_canonical_case(raw: str, tag: str) -> None:
    assert captions.language_tag(raw) == tag
    assert captions.language_tag(tag) == tag  # canonical stays canonical


@pytest.mark.parametrize("raw", ["", "e", "english", "en_US", "en-", "-en", "en--us", "en-u", "en-USA-", "1en",
                                 "en US", "en/us", "en.vtt", "x" * 36, "en-" + "a" * 40, "ü", "en-Ünï"])
def test_anything_else_is_no_language_tag(raw: str) -> None:
    assert captions.language_tag(raw) is None


@pytest.mark.parametrize(("name", "fine"), [
    ("English", True), ("Português (SDH)", True), ("日本語", True), ("x" * captions.NAME_MAX, True),
    ("x" * (captions.NAME_MAX + 1), False), ("", False), ("   ", False), ('say "hi"', False), ("a\nb", False),
    ("a\tb", False), ("a\x7fb", False), ("a\x85b", False),
])
def test_a_name_players_show_and_a_playlist_quotes(name: str, fine: bool) -> None:
    assert (captions.name_problem(name) is None) is fine


# ----------------------------------------------------------------------------------------------- reading files


def test_webvtt_is_kept_as_written_with_its_notes_styles_regions_identifiers_and_settings() -> None:
    text = ("WEBVTT Kind: captions\nLanguage: en\n\nSTYLE\n::cue { color: lime }\n\nREGION\nid:r1 width:40%\n\n"
            "NOTE a note\nover two lines\n\n1\n00:00:00.000 --> 00:00:01.000 region:r1 align:left\n<v Ann>Hi\n\n"
            "00:01.500 --> 00:02.000\nno identifier, no hours\n\n100:00:00.000 --> 100:00:01.000\nlong\n")
    read = captions.read_captions(text.encode())
    assert (read.text, read.cues, read.source_format, read.last_end) == (text, 3, "webvtt", 360001.0)


@pytest.mark.parametrize(("raw", "text"), [
    (b"\xef\xbb\xbfWEBVTT\n\n00:01.000 --> 00:02.000\nx", "WEBVTT\n\n00:01.000 --> 00:02.000\nx\n"),  # BOM, no EOL
    (b"WEBVTT\r\n\r\n00:01.000 --> 00:02.000\r\nx\r\n", "WEBVTT\n\n00:01.000 --> 00:02.000\nx\n"),  # CRLF
    (b"WEBVTT\r\r00:01.000 --> 00:02.000\rx\r", "WEBVTT\n\n00:01.000 --> 00:02.000\nx\n"),  # CR
    (b"WEBVTT\t-\n\n\n\n00:01.000\t-->\t00:02.000\nx\n", "WEBVTT\t-\n\n\n\n00:01.000\t-->\t00:02.000\nx\n"),
])
def test_webvtt_line_ends_and_byte_order_mark_are_normalised(raw: bytes, text: str) -> None:
    assert captions.read_captions(raw).text == text


def test_subrip_becomes_webvtt_numbers_kept_commas_made_points() -> None:
    srt = ("\ufeff1\r\n00:00:01,000 --> 00:00:02,500\r\nHello\r\n<i>there</i>\r\n\r\n\r\n"
           "2\r\n1:02:03,4 --> 1:02:04,45 X1:10 X2:20 Y1:30 Y2:40\r\nBye\r\n")
    read = captions.read_captions(srt.encode())
    assert read.text == ("WEBVTT\n\n1\n00:00:01.000 --> 00:00:02.500\nHello\n<i>there</i>\n\n"
                         "2\n01:02:03.400 --> 01:02:04.450\nBye\n")
    assert (read.cues, read.source_format, read.last_end) == (2, "srt", 3724.45)
    # a SubRip file without cue numbers
    assert captions.read_captions(b"00:00:01,000 --> 00:00:02,000\nHi\n").text == (
        "WEBVTT\n\n00:00:01.000 --> 00:00:02.000\nHi\n")


@pytest.mark.parametrize(("raw", "says"), [
    (b"", "empty"), (b" \n\n", "empty"), (b"\xff\xfeW\x00", "not UTF-8"), (b"WEBVTT\n\n00:01.000 --> 00:02.000\n\x00",
                                                                           "NUL"),
    (b"WEBVTTX\n\n00:01.000 --> 00:02.000\nx\n", "line 1"), (b"webvtt\n\n00:01.000 --> 00:02.000\nx\n", "neither"),
    (b"WEBVTT\n", "no cues"), (b"WEBVTT\n\nNOTE only a note\n", "no cues"),
    (b"WEBVTT\n\n00:02.000 --> 00:01.000\nx\n", "line 3: a cue must end after it starts"),
    (b"WEBVTT\n\n00:01.000 --> 00:01.000\nx\n", "line 3: a cue must end after it starts"),
    (b"WEBVTT\n\n00:01.000 -> 00:02.000\nx\n", "line 3: neither a cue"),
    (b"WEBVTT\n\nid\n00:01 --> 00:02\nx\n", "line 4: not a cue timing"),
    (b"WEBVTT\n\n00:61.000 --> 01:02.000\nx\n", "line 3: not a cue timing"),
    (b"WEBVTT\n\n00:01,000 --> 00:02,000\nx\n", "line 3: not a cue timing"),
    (b"WEBVTT\n\n00:01.000 --> 00:02.000\nx --> y\n", "line 4: a cue's text must not contain -->"),
    (b"WEBVTT\n\n00:01.000 --> 00:02.000\nx\n\nSTYLE\n::cue {}\n", "line 6: STYLE blocks go before the first cue"),
    (b"hello\n", "neither WebVTT"), (b"1\nhello\n", "neither WebVTT"),
    (b"1\n00:00:01,000 --> 00:00:02,000\nx\n\n2\nno timing\n", "line 5: not a cue"),
    (b"1\n00:00:02,000 --> 00:00:01,000\nx\n", "line 2: a cue must end after it starts"),
    (b"1\n00:00:01,000 --> 00:00:02,000\nx\n\n2\n00:00:03 --> 00:00:04\ny\n", "line 6: not a SubRip timing"),
])
def test_a_file_refused_says_why_and_where(raw: bytes, says: str) -> None:
    with pytest.raises(captions.CaptionsRefused, match=says):
        captions.read_captions(raw)


# ----------------------------------------------------------------------------------------------- the track list


def track(language: str, name: str | None = None, *, key: str | None = None, at: str = "2026-12-07T10:00:00+00:00",
          closed: bool = False) -> captions.Track:
    return captions.Track(language, name or language, closed, key or f"v/captions/{language}-0123456789abcdef.vtt",
                          10, 1, at, at)


def test_a_track_is_added_in_order_or_replaces_its_languages_keeping_when_it_was_first_uploaded() -> None:
    stored: Any = []
    for language in ("en", "fr", "de"):
        outcome = captions.placed(stored, track(language), most=3)
        assert not isinstance(outcome, str) and outcome[1] is None
        stored = outcome[0]
    assert [t.language for t in captions.tracks_of(stored)] == ["en", "fr", "de"]
    again = track("fr", "Français", key="v/captions/fr-fedcba9876543210.vtt", at="2026-12-08T00:00:00+00:00")
    outcome = captions.placed(stored, again, most=3)  # at the most: a replacement still fits
    assert not isinstance(outcome, str)
    stored, replaced = outcome
    assert replaced == track("fr")
    (fr,) = (t for t in captions.tracks_of(stored) if t.language == "fr")
    assert (fr.name, fr.key, fr.created_at, fr.updated_at) == (
        "Français", again.key, "2026-12-07T10:00:00+00:00", "2026-12-08T00:00:00+00:00")
    assert [t.language for t in captions.tracks_of(stored)] == ["en", "fr", "de"]  # its place kept
    assert fr.version == "fedcba9876543210"


def test_a_fourth_language_past_the_most_and_a_name_taken_are_refused() -> None:
    stored = [track(lang).stored() for lang in ("en", "fr", "de")]
    assert "3 caption tracks" in str(captions.placed(stored, track("it"), most=3))
    assert not isinstance(captions.placed(stored, track("it"), most=4), str)
    assert "named 'fr'" in str(captions.placed(stored, track("it", "fr"), most=4))
    assert not isinstance(captions.placed(stored, track("fr", "fr"), most=3), str)  # its own name


def test_entries_a_newer_release_wrote_are_kept_and_not_shown() -> None:
    newer = {"language": "es", "kind": "chapters"}  # lacks what this release needs: not shown, left as it is
    stored = [track("en").stored(), newer, "not even an object"]
    assert [t.language for t in captions.tracks_of(stored)] == ["en"]
    outcome = captions.placed(stored, track("fr"), most=2)  # the unread entries do not count
    assert not isinstance(outcome, str)
    assert outcome[0][-1] == newer and [t.language for t in captions.tracks_of(outcome[0])] == ["en", "fr"]
    assert captions.tracks_of(None) == [] and captions.tracks_of({"en": 1}) == []


def test_a_track_is_removed_by_its_language() -> None:
    stored = [track("en").stored(), track("fr").stored()]
    outcome = captions.removed(stored, "en")
    assert outcome is not None
    rest, gone = outcome
    assert gone == track("en") and [t.language for t in captions.tracks_of(rest)] == ["fr"]
    assert captions.removed(stored, "de") is None and captions.removed([], "en") is None


def test_a_files_key_is_under_the_videos_prefix_and_changes_with_its_text() -> None:
    a, b = (captions.caption_key("0190-v", "en", text) for text in ("WEBVTT\n\na", "WEBVTT\n\nb"))
    assert a != b and a.endswith(".vtt") and "/captions/en-" in a
    assert a == captions.caption_key("0190-v", "en", "WEBVTT\n\na")
    from shared.media.playback import video_prefix
    assert a.startswith(video_prefix("0190-v"))


# ----------------------------------------------------------------------------------------------- playlists

HLS = HlsRendition(playlist_key="k/index.m3u8", bandwidth=500_000, average_bandwidth=400_000, width=640, height=360,
                   codecs="avc1.64001e,mp4a.40.2", frame_rate=25.0, duration=12.0, segments=3)


@pytest.mark.parametrize("count", [0, 1, 3])
def test_the_master_playlist_offers_every_track_to_every_rendition(count: int) -> None:
    tracks = [(track(lang, f"Name {lang}", closed=i == 1), f"captions/{lang}.m3u8?v=1&sig=x")
              for i, lang in enumerate(["en", "pt-BR", "es-419"][:count])]
    text = playback.master_playlist([("360/index.m3u8", HLS), ("720/index.m3u8", HLS)], captions.media_lines(tracks),
                                    captions.GROUP)
    master = m3u8.loads(text)
    assert [(m.type, m.group_id, m.language, m.name, m.default, m.autoselect, m.forced, m.uri) for m in master.media] \
        == [("SUBTITLES", "subs", t.language, t.name, "NO", "YES", "NO", uri) for t, uri in tracks]
    assert [m.characteristics for m in master.media] == [
        captions.CLOSED_CAPTIONS_CHARACTERISTICS if t.closed_captions else None for t, _ in tracks]
    assert [p.stream_info.subtitles for p in master.playlists] == [captions.GROUP if count else None] * 2
    assert len(master.playlists) == 2


@pytest.mark.parametrize(("duration", "target"), [(12.0, 12), (12.3, 13), (0.5, 1), (0.0, 1), (3600.25, 3601)])
def test_a_tracks_playlist_is_its_file_as_one_segment_lasting_the_video(duration: float, target: int) -> None:
    playlist = m3u8.loads(captions.subtitle_playlist("en.vtt?v=1", duration))
    assert playlist.is_endlist and playlist.playlist_type == "vod" and playlist.target_duration == target
    assert [(s.uri, s.duration) for s in playlist.segments] == [("en.vtt?v=1", pytest.approx(max(duration, 0.001)))]
    assert playlist.media_sequence == 0


def test_every_pair_of_languages_gets_distinct_canonical_tags() -> None:
    raws = ["en", "EN", "en-us", "en-US", "pt", "pt-br", "es-419", "zh-hant-tw"]
    tags = {raw: captions.language_tag(raw) for raw in raws}
    for a, b in itertools.combinations(raws, 2):
        assert (tags[a] == tags[b]) is (a.lower() == b.lower())
