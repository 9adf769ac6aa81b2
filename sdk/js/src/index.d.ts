// Type declarations of @weir/upload.

/** `public`: anyone with the URLs plays the video; `signed`: only with a playback token. */
export type PlaybackPolicy = "public" | "signed";

/** A video's playback (SPEC 14): absolute URLs, each null until there is something there. A signed video's URLs
 * need `?token=<playback token>` (see `withPlaybackToken`). An api of release 1.0.0 shows none. */
export interface Playback {
  policy: PlaybackPolicy;
  /** The HLS master playlist. */
  hls: string | null;
  /** The poster; `?time=&width=` for another frame. */
  thumbnail: string | null;
  /** The storyboard WebVTT (cues point at tiles of one sprite: `#xywh=`). */
  storyboard: string | null;
  /** A player page for an `<iframe>` (null until `hls`; absent from an api before release 1.1.0). Options:
   * `autoplay=1`, `muted=1`, `loop=1`, `start=<seconds>`, `captions=<language>`, `poster=0`, `token=`. */
  embed?: string | null;
  /** A stable URL of the highest MP4 (`lowest.mp4` or `<p>p.mp4` beside it; `?download=1` to save it); null until
   * one is stored; absent from an api before release 1.1.0. */
  mp4?: string | null;
}

/** One caption track (WebVTT), added by the app's server (`PUT /v1/videos/{id}/captions/{language}`). */
export interface CaptionTrack {
  /** BCP 47, in canonical case: `en`, `pt-BR`. */
  language: string;
  /** What players show viewers. */
  name: string;
  /** For viewers who do not hear the sound (SDH). */
  closed_captions: boolean;
  size: number;
  cues: number;
  created_at: string;
  updated_at: string;
  /** The WebVTT file (a signed video's needs `?token=`, see `withPlaybackToken`). */
  url: string;
  [field: string]: unknown;
}

/** A video's status (SPEC 4). */
export type VideoStatus =
  "created" | "uploading" | "uploaded" | "processing" | "ready" | "failed" | "retired" | "deleted";

/** An output's state; one a newer api adds reads as `pending`. */
export type OutputState = "pending" | "encoding" | "done" | "failed" | "cancelled";

/** One MP4 rendition stored so far. */
export interface Rendition {
  /** Pixels. */
  height: number;
  /** A presigned GET URL of the MP4 (it expires). */
  url: string;
  /** Bytes. */
  size: number;
  [field: string]: unknown;
}

/** One output of the encoding (the worker and start may not be known yet). */
export interface Output {
  height: number;
  state: OutputState;
  worker?: string | null;
  /** RFC 3339. */
  started_at?: string | null;
  [field: string]: unknown;
}

/** A video as the api answers it: `VideoShown` of the api's OpenAPI document (`/openapi.json`). Members a newer api
 * adds are kept. */
export interface Video {
  id: string;
  status: VideoStatus;
  name: string;
  metadata: Record<string, unknown> | null;
  /** RFC 3339. */
  created_at: string;
  /** Null until the upload is complete. */
  file: { size: number; content_type: string; [field: string]: unknown } | null;
  /** By height, each as soon as it is stored. */
  renditions: Rendition[];
  /** Encode's work on it (times RFC 3339); null until encode told any. */
  processing: { deadline_at: string | null; busy_at: string | null; outputs: Output[]; [field: string]: unknown } | null;
  failure: { reason: string; message: string; [field: string]: unknown } | null;
  /** Absent from an api of release 1.0.0. */
  playback?: Playback;
  /** Its caption tracks (also offered in the master playlist); absent from an api of release 1.0.0. */
  captions?: CaptionTrack[];
  [field: string]: unknown;
}

/** The api's problem (RFC 9457) as the SDK read it, or the SDK's own: `network_error`, `aborted`, `storage_error`,
 * `part_url_refused`, `etag_unreadable`, `no_part_url`, `http_<status>` when the body had no `code`. */
export class WeirUploadError extends Error {
  readonly name: "WeirUploadError";
  readonly code: string;
  /** HTTP status of the answer, 0 when there was none. */
  readonly status: number;
  readonly detail: string;
  /** The problem body, when the api sent one. */
  readonly problem: Record<string, unknown> | null;
}

/** With a publishable key the SDK creates the video (or resumes the stored one). */
export interface PublishableKeyAuth {
  apiUrl: string;
  publishableKey: string;
}

/** With an upload token minted by the app's server for one video. */
export interface UploadTokenAuth {
  apiUrl: string;
  uploadToken: string;
  videoId: string;
}

/** localStorage, sessionStorage, or anything with the same three methods (sync or async). */
export interface ResumeStorage {
  getItem(key: string): string | null | Promise<string | null>;
  setItem(key: string, value: string): void | Promise<void>;
  removeItem(key: string): void | Promise<void>;
}

export interface UploadOptions {
  /** Parts sent at once (default 4). */
  concurrency?: number;
  /** Wished part size in bytes; never below the api's `part_size_min`. */
  partSize?: number;
  /** Tries per part and per api call for network errors and 5xx (default 5). */
  maxAttempts?: number;
  /** 429s waited out per request (default 10). */
  maxRateLimitWaits?: number;
  /** Fresh part URLs per part after storage refused one with 403 (default 3). */
  maxUrlRefreshes?: number;
  backoffBaseMs?: number;
  backoffMaxMs?: number;
  /** The longest Retry-After waited (default 120 000 ms). */
  retryAfterMaxMs?: number;
  /** Where the video id, upload token and part size are kept so a reloaded page resumes the upload. */
  storage?: ResumeStorage;
  /** The key in `storage` (default: from a File's name, size, lastModified and type; a Blob needs one). */
  resumeKey?: string;
  /** The video's name when the SDK creates it (default: the file's name). */
  name?: string;
  metadata?: Record<string, unknown>;
  /** The created video's playback policy (default `public`); the upload fails with `playback_policy_not_applied`
   * if the api did not apply it (an older release). */
  playbackPolicy?: PlaybackPolicy;
  /** The create's `Idempotency-Key` (default: a random UUID per upload): its retries after a lost answer get the
   * video the first attempt made. Give your own to make a create safe across page reloads too. */
  idempotencyKey?: string;
  /** Default: the file's type, else application/octet-stream. */
  contentType?: string;
  /** For tests: the fetch and random source used. */
  fetch?: typeof fetch;
  random?: () => number;
}

export interface Progress {
  sent: number;
  total: number;
}

export interface UploadEvents {
  progress: Progress;
  created: { videoId: string; uploadToken: string; video: Video };
  resumed: { stored: number; missing: number };
  part: { partNumber: number; etag: string; size: number };
  retry: { part?: number; what?: string; attempt: number; status?: number; error?: unknown; renewUrl?: boolean };
  ratelimited: { part?: number; what?: string; waitMs: number };
  pause: Record<string, never>;
  resume: Record<string, never>;
  abort: Record<string, never>;
  complete: Video;
}

export interface UploadController {
  /** Resolves with the video once the upload is complete; rejects with a WeirUploadError. */
  readonly promise: Promise<Video>;
  readonly videoId: string | null;
  readonly uploadToken: string | null;
  readonly paused: boolean;
  /** Stops sending (parts in flight are cut and sent again on resume). */
  pause(): void;
  resume(): void;
  /** Ends the upload and aborts it at the api; the promise rejects with code `aborted`. */
  abort(): Promise<void>;
  on<E extends keyof UploadEvents>(event: E, listener: (data: UploadEvents[E]) => void): UploadController;
  off<E extends keyof UploadEvents>(event: E, listener: (data: UploadEvents[E]) => void): UploadController;
}

export function upload(file: Blob, auth: PublishableKeyAuth | UploadTokenAuth, options?: UploadOptions): UploadController;
export default upload;

export interface PlannedPart {
  partNumber: number;
  start: number;
  /** exclusive */
  end: number;
}

export function choosePartSize(size: number, limits: { partSizeMin: number; partNumberMax?: number; preferred?: number }): number;
export function planParts(size: number, partSize: number): PlannedPart[];
export function backoffDelay(attempt: number, options?: { baseMs?: number; maxMs?: number; random?: () => number }): number;
export function parseRetryAfter(value: string | null | undefined, now?: number): number | null;
export function planResume(
  plan: PlannedPart[],
  listing: { parts: { part_number: number; etag: string; size: number }[] } | null,
): { done: Map<number, string>; missing: PlannedPart[] };
export function retryable(status: number): boolean;

/** The video an upload token was minted for (`GET /sdk/v1/videos/{id}`): its status and, once ready, renditions
 * `[{height, url, size}]` with presigned URLs. Throws WeirUploadError. */
export function getVideo(auth: UploadTokenAuth, options?: { fetch?: typeof fetch; signal?: AbortSignal }
): Promise<Video>;

/** The URLs a player uses for a video (no API key needed): the HLS master playlist, the thumbnail (another frame with
 * `time` seconds and/or `width` pixels), the storyboard, the highest MP4 and the player page to embed; `token` a
 * playback token for a signed video. */
export function playbackUrls(apiUrl: string, videoId: string, options?: { token?: string; time?: number; width?: number }
): { hls: string; thumbnail: string; storyboard: string; mp4: string; embed: string };

/** A URL of `Video.playback` with a playback token added (null stays null). */
export function withPlaybackToken<U extends string | null>(url: U, token: string): U;
