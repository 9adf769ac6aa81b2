from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from shared.settings import ShedSettings


class ApiSettings(ShedSettings):
    http_port: int = Field(8080, description="port of the public HTTP API")
    part_url_ttl_seconds: int = Field(3600, description="lifetime of a presigned part URL")
    status_max_videos: int = Field(100, ge=1, description="most videos the api asks encode about in one "
                                   "encode.status.v2 request (a listing page up to this many asks in one); the same "
                                   "setting as encode's, which refuses more")
    auth_timeout_ms: int = Field(2000, description="how long the api waits for auth.check before answering 503")
    limits_refresh_seconds: float = Field(60, gt=0, description="how often the api asks auth for its request limits "
                                          "(auth.manage.limits.list), which /openapi.json shows")
    limits_retry_seconds: float = Field(2, gt=0, description="how soon the api asks auth for its limits again when "
                                        "auth did not answer (until then /openapi.json says they are not known yet)")
    demo_publishable_key: str = Field("", description="the demo app's publishable key, which the /demo page uploads "
                                      "with (a publishable key is meant for pages; `weir up` sets it); unset: the "
                                      "page asks for one")
    sdk_js_dir: Path = Field(Path(__file__).resolve().parents[2] / "sdk" / "js" / "src",
                             description="where @weir/upload's index.js is, which /demo loads")
    demo_webhook_file: Path | None = Field(None, description="where `weir up` keeps the demo app's endpoint for "
                                           "the demo page's receiver (POST /demo/receiver): a JSON file with its "
                                           "id and signing secret (mode 0600); unset: no receiver")
    demo_receiver_keep: int = Field(200, ge=1, description="deliveries the demo page's receiver keeps in memory "
                                    "(the newest; older ones are forgotten)")
    service_pages: str = Field("", description="the other services' HTTP addresses as name=url, comma-separated, "
                               "which the index page (/) links to (their /asyncapi pages); `weir up` sets it")
    idempotency_key_ttl_seconds: float = Field(86400, gt=0, description="how long a create's Idempotency-Key is "
                                               "kept: sent again within it, the create answers the video it made")
    # ---- imports from a URL (POST /v1/videos/{id}/import)
    import_allow_private: bool = Field(False, description="import from loopback, private and shared addresses too "
                                       "(development; SPEC 13's SSRF rules otherwise)")
    import_max_bytes: int = Field(50 * 1024**3, gt=0, description="largest file an import reads (said by the "
                                  "answer's Content-Length, or counted); larger fails the import, `too_large`")
    import_concurrency: int = Field(2, ge=0, description="imports one api instance runs at a time (0: this instance "
                                    "takes none, and only serves requests)")
    import_max_attempts: int = Field(5, ge=1, description="attempts of an import before it fails for good (a "
                                     "failure the URL itself causes, such as a 404, is not retried)")
    import_retry_base_seconds: float = Field(10, gt=0, description="wait after an import's first failed attempt; "
                                             "4x longer after each next one (±20 %)")
    import_lease_seconds: float = Field(60, gt=0, description="how long an instance holds an import without a word "
                                        "(renewed with every part): an instance that died past it loses the "
                                        "import to another")
    import_read_timeout_seconds: float = Field(30, gt=0, description="longest wait for the URL's next bytes "
                                               "(the connection and the answer's headers included)")
    import_attempt_timeout_seconds: float = Field(3600, gt=0, description="longest an import's attempt may take")
    import_part_bytes: int = Field(16 * 1024 * 1024, ge=5 * 1024 * 1024, description="size of the parts an "
                                   "import stores (S3's multipart: at least 5 MiB); one part of memory per import")
    import_parts_in_flight: int = Field(4, ge=1, description="parts an import stores at once while it reads the next "
                                        "(each a part of memory): storage takes them side by side")
    import_max_redirects: int = Field(5, ge=0, description="redirects an import follows (each URL judged anew)")
    import_poll_seconds: float = Field(1.0, gt=0, description="how often an api instance looks for imports due")
    # ---- playback (SPEC 14)
    playback_url_secret: SecretStr = Field(SecretStr(""), description="HMAC secret of the file URLs the playlists "
                                           "list (the same on every api instance); unset: derived from the internal "
                                           "token")
    playback_public_url_ttl_seconds: int = Field(21600, gt=0, description="lifetime of the file URLs listed for a "
                                                 "public video (and for the app's own secret key)")
    playback_storage_url_ttl_seconds: int = Field(60, gt=0, description="lifetime of the presigned storage URL a "
                                                  "file URL redirects to")
    playback_token_url_ttl_max_seconds: int = Field(86400, gt=0, description="the longest the file URLs listed "
                                                    "under a playback token last (else until its exp): a token "
                                                    "that expires years away still gives URLs that expire; a player "
                                                    "whose URLs expired loads the playlist again")
    playback_token_leeway_seconds: float = Field(5.0, ge=0, description="clock skew allowed on a playback token's "
                                                 "exp and nbf")
    playback_token_audience: str = Field("playback", min_length=1, description="the `aud` a playback token must "
                                         "name, when it has one")
    playback_key_cache_seconds: float = Field(0.25, ge=0, lt=1, description="how long an api instance keeps a "
                                              "playback key it read (a revoked key stops playback within this, "
                                              "well under a second)")
    playback_public_max_age_seconds: int = Field(60, ge=0, description="Cache-Control max-age of a public video's "
                                                 "playlists (a signed video's are no-store)")
    playback_file_max_bytes: int = Field(1024 * 1024, gt=0, description="largest stored playlist or storyboard "
                                         "the api reads to rewrite")
    captions_max_bytes: int = Field(1024 * 1024, gt=0, description="largest caption file (WebVTT or SubRip) a "
                                    "video's track takes (413 past it)")
    captions_max_tracks: int = Field(32, ge=1, description="most caption tracks a video has (one per language)")
    thumbnail_concurrency: int = Field(2, ge=1, description="on-demand thumbnails an api instance makes at once "
                                       "(ffmpeg processes)")
    thumbnail_timeout_seconds: float = Field(20.0, gt=0, description="the longest an on-demand thumbnail waits for "
                                             "a slot and ffmpeg together; then 503")
    thumbnail_min_width: int = Field(16, ge=1, description="narrowest thumbnail made on demand")
    thumbnail_max_width: int = Field(1920, ge=1, description="widest thumbnail made on demand (never wider than the "
                                     "best rendition)")
    thumbnail_time_step_seconds: float = Field(0.1, gt=0, description="on-demand thumbnail times are rounded down to "
                                               "this step (one cached image per step)")
    animation_default_seconds: float = Field(5.0, gt=0, description="an animated preview's length when `end` is not "
                                             "given")
    animation_max_seconds: float = Field(10.0, gt=0, description="longest animated preview made on demand")
    animation_default_width: int = Field(320, ge=16, description="an animated preview's width when not given")
    animation_max_width: int = Field(640, ge=16, description="widest animated preview made on demand")
    animation_default_fps: int = Field(10, ge=1, description="an animated preview's frames per second when not given")
    animation_max_fps: int = Field(30, ge=1, description="most frames per second of an animated preview")
    animation_max_bytes: int = Field(20 * 1024 * 1024, gt=0, description="largest animated preview ffmpeg may write")
    thumbnail_max_bytes: int = Field(5 * 1024 * 1024, gt=0, description="largest thumbnail ffmpeg may write")
