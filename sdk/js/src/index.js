// @weir/upload: resumable, chunked uploads of a File or Blob to Weir, straight to storage in parts.
// No dependencies: the platform's fetch, Blob and AbortController (browsers, node >= 20).

const SDK = "/sdk/v1";
const DEFAULTS = {
  concurrency: 4,
  maxAttempts: 5, // per part, and per API call (network errors, 5xx)
  maxRateLimitWaits: 10, // 429s waited out per call before giving up
  maxUrlRefreshes: 3, // fresh part URLs per part after a 403 from storage
  backoffBaseMs: 500,
  backoffMaxMs: 30_000,
  retryAfterMaxMs: 120_000,
  urlBatch: 20, // part URLs asked for at once
  urlMarginMs: 30_000, // a part URL expiring sooner than this is renewed before use
};

/** The one error type: `code` is the problem's `code` (RFC 9457) or one of the SDK's own. */
export class WeirUploadError extends Error {
  constructor(message, { code = "error", status = 0, detail = message, problem = null, cause } = {}) {
    super(message, cause === undefined ? undefined : { cause });
    this.name = "WeirUploadError";
    this.code = code;
    this.status = status;
    this.detail = detail;
    this.problem = problem;
  }
}

// ------------------------------------------------------------------------------------------ pure logic

/** The part size: at least `partSizeMin` (and the caller's wish), large enough to fit in `partNumberMax` parts. */
export function choosePartSize(size, { partSizeMin, partNumberMax = 10_000, preferred = 0 }) {
  const fit = Math.ceil(size / partNumberMax);
  return Math.max(partSizeMin, preferred || 0, fit, 1);
}

/** The parts of `size` bytes: `[{partNumber, start, end}]` (end exclusive), one empty part for an empty file. */
export function planParts(size, partSize) {
  if (!(partSize > 0)) throw new RangeError("partSize must be positive");
  if (size === 0) return [{ partNumber: 1, start: 0, end: 0 }];
  const parts = [];
  for (let start = 0, n = 1; start < size; start += partSize, n++) {
    parts.push({ partNumber: n, start, end: Math.min(size, start + partSize) });
  }
  return parts;
}

/** Exponential backoff with full jitter: a delay in [0, min(max, base * 2^attempt)), attempt counted from 0. */
export function backoffDelay(attempt, { baseMs = DEFAULTS.backoffBaseMs, maxMs = DEFAULTS.backoffMaxMs,
  random = Math.random } = {}) {
  const cap = Math.min(maxMs, baseMs * 2 ** attempt);
  return Math.floor(random() * cap);
}

/** Retry-After (delta seconds or an HTTP date) in milliseconds from `now`; null when absent or unreadable. */
export function parseRetryAfter(value, now = Date.now()) {
  if (value == null) return null;
  const text = String(value).trim();
  if (text === "") return null;
  if (/^\d+$/.test(text)) return Number(text) * 1000;
  if (!/^[A-Za-z]{3},/.test(text)) return null; // "1.5", "-1", "10s": neither delta-seconds nor an HTTP date
  const at = Date.parse(text);
  if (Number.isNaN(at)) return null;
  return Math.max(0, at - now);
}

/**
 * Which planned parts storage already holds (from `GET .../upload/parts`): a stored part counts only when its
 * size is the planned one (a part cut at another size is sent again). Returns `{done: Map<n, etag>, missing}`.
 */
export function planResume(plan, listing) {
  const stored = new Map();
  for (const p of (listing && listing.parts) || []) stored.set(p.part_number, p);
  const done = new Map();
  const missing = [];
  for (const part of plan) {
    const s = stored.get(part.partNumber);
    if (s && s.etag && s.size === part.end - part.start) done.set(part.partNumber, s.etag);
    else missing.push(part);
  }
  return { done, missing };
}

/** Whether an HTTP status is worth another try (after a backoff). */
export function retryable(status) {
  return status === 408 || status === 429 || status >= 500;
}

// ------------------------------------------------------------------------------------------ helpers

function sleep(ms, signal) {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const t = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    const onAbort = () => {
      clearTimeout(t);
      reject(signal.reason);
    };
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

async function problemOf(response) {
  let body = null;
  try {
    const text = await response.text();
    body = text ? JSON.parse(text) : null;
  } catch {
    body = null;
  }
  const code = (body && typeof body.code === "string" && body.code) || `http_${response.status}`;
  const detail = (body && (body.detail || body.title)) || response.statusText || `HTTP ${response.status}`;
  return new WeirUploadError(`${code}: ${detail}`, { code, status: response.status, detail, problem: body });
}

// A part's PUT. In a browser (XMLHttpRequest present, no fetch of the caller's) it goes through XHR, whose upload
// events give bytes within the part (fetch reports no upload progress); elsewhere through fetch. Either way the
// answer is Response-like: ok, status, headers.get(), body.
function xhrPut(url, body, signal, onBytes) {
  return new Promise((resolve, reject) => {
    const xhr = new XMLHttpRequest();
    const onAbort = () => xhr.abort();
    xhr.open("PUT", url);
    xhr.upload.onprogress = (e) => onBytes(e.loaded);
    xhr.onload = () => {
      signal?.removeEventListener("abort", onAbort);
      resolve({ ok: xhr.status >= 200 && xhr.status < 300, status: xhr.status,
        headers: { get: (name) => xhr.getResponseHeader(name) }, body: null });
    };
    xhr.onerror = () => {
      signal?.removeEventListener("abort", onAbort);
      reject(new TypeError("network error"));
    };
    xhr.onabort = () => reject(signal?.reason ?? new DOMException("aborted", "AbortError"));
    if (signal?.aborted) return reject(signal.reason);
    signal?.addEventListener("abort", onAbort, { once: true });
    xhr.send(body);
  });
}

/**
 * The video an upload token was minted for, as the api shows it (`GET /sdk/v1/videos/{id}`: status, renditions with
 * presigned URLs): a page watches its upload encode. `auth`: `{apiUrl, uploadToken, videoId}` (an upload's
 * controller has `videoId` and `uploadToken`). Throws WeirUploadError with the problem's `code`.
 */
export async function getVideo(auth, { fetch: fetchImpl = globalThis.fetch.bind(globalThis), signal } = {}) {
  if (!auth || !auth.apiUrl || !auth.uploadToken || !auth.videoId) {
    throw new TypeError("getVideo(auth): auth.apiUrl, auth.uploadToken and auth.videoId are required");
  }
  const url = `${String(auth.apiUrl).replace(/\/+$/, "")}${SDK}/videos/${encodeURIComponent(auth.videoId)}`;
  let response;
  try {
    response = await fetchImpl(url, { headers: { Authorization: `Bearer ${auth.uploadToken}` }, signal });
  } catch (err) {
    throw new WeirUploadError(`network error: ${err?.message || err}`, { code: "network_error", cause: err });
  }
  if (!response.ok) throw await problemOf(response);
  return response.json();
}

// ------------------------------------------------------------------------------------------ playback

function withQuery(url, query) {
  const pairs = Object.entries(query).filter(([, v]) => v !== undefined && v !== null && v !== "");
  if (!pairs.length) return url;
  const text = pairs.map(([k, v]) => `${encodeURIComponent(k)}=${encodeURIComponent(String(v))}`).join("&");
  return `${url}${url.includes("?") ? "&" : "?"}${text}`;
}

function playbackBase(apiUrl, videoId) {
  if (!apiUrl || !videoId) throw new TypeError("apiUrl and videoId are required");
  return { api: String(apiUrl).replace(/\/+$/, ""), id: encodeURIComponent(videoId) };
}

/**
 * The URLs a player uses for a video (the api answers them without an API key): the HLS master playlist, the
 * thumbnail (`time` in seconds and `width` in pixels for another frame), the storyboard WebVTT, the highest MP4 and
 * the player page to embed. `token`: a playback token (a JWT signed by one of the app's playback keys) for a signed
 * video.
 */
export function playbackUrls(apiUrl, videoId, { token, time, width } = {}) {
  const { api, id } = playbackBase(apiUrl, videoId);
  return {
    hls: withQuery(`${api}/v1/playback/${id}/master.m3u8`, { token }),
    thumbnail: withQuery(`${api}/v1/videos/${id}/thumbnail.jpg`, { time, width, token }),
    storyboard: withQuery(`${api}/v1/videos/${id}/storyboard.vtt`, { token }),
    mp4: withQuery(`${api}/v1/playback/${id}/highest.mp4`, { token }),
    embed: withQuery(`${api}/embed/${id}`, { token }),
  };
}

/** A URL of the video's `playback` (as the api shows it) with a playback token added, for a signed video. */
export function withPlaybackToken(url, token) {
  if (!url) return url;
  return withQuery(url, { token });
}

function contentTypeOf(file, given) {
  const raw = (given || file.type || "application/octet-stream").split(";")[0].trim();
  return /^[\w.+-]+\/[\w.+-]+$/.test(raw) ? raw : "application/octet-stream";
}

function defaultResumeKey(file) {
  if (typeof file.name === "string" && file.name) {
    return `weir-upload:${file.name}:${file.size}:${file.lastModified ?? ""}:${file.type || ""}`;
  }
  return null; // a Blob has no identity: the caller names it with `resumeKey`
}

async function storageGet(storage, key) {
  if (!storage || !key) return null;
  try {
    const raw = await storage.getItem(key);
    return raw ? JSON.parse(raw) : null;
  } catch {
    return null;
  }
}

async function storageSet(storage, key, value) {
  if (!storage || !key) return;
  try {
    await storage.setItem(key, JSON.stringify(value));
  } catch {
    // storage full or unavailable: the upload goes on, only a reload could not resume it
  }
}

async function storageRemove(storage, key) {
  if (!storage || !key) return;
  try {
    await storage.removeItem(key);
  } catch {
    // nothing to do
  }
}

// ------------------------------------------------------------------------------------------ upload

/**
 * Upload `file` (a File or Blob) to Weir.
 * `auth`: `{apiUrl, publishableKey}` (the video is created, or the stored one resumed) or
 * `{apiUrl, uploadToken, videoId}` (a video created by the app's server).
 * Returns a controller: `{promise, pause(), resume(), abort(), on(event, fn), off(event, fn), paused, videoId}`.
 */
export function upload(file, auth, options = {}) {
  if (!file || typeof file.slice !== "function" || typeof file.size !== "number") {
    throw new TypeError("upload(file): a File or Blob");
  }
  if (!auth || !auth.apiUrl) throw new TypeError("upload(file, auth): auth.apiUrl is required");
  if (!auth.publishableKey && !(auth.uploadToken && auth.videoId)) {
    throw new TypeError("upload(file, auth): a publishableKey, or an uploadToken with its videoId");
  }
  const o = { ...DEFAULTS, ...options };
  const fetchImpl = o.fetch || globalThis.fetch.bind(globalThis);
  const useXhr = !o.fetch && typeof globalThis.XMLHttpRequest === "function";
  const random = o.random || Math.random;
  const apiUrl = String(auth.apiUrl).replace(/\/+$/, "");
  const resumeKey = o.resumeKey ?? (o.storage ? defaultResumeKey(file) : null);
  const storage = o.storage || null;

  const listeners = new Map();
  const emit = (event, data) => {
    for (const fn of listeners.get(event) || []) {
      try {
        fn(data);
      } catch {
        // a listener's error is not the upload's
      }
    }
  };

  const stopper = new AbortController(); // abort(): ends everything
  let pauser = new AbortController(); // pause(): ends the requests in flight, they are sent again on resume
  let paused = false;
  let resumed = null; // resolves when resume() is called
  let wake = () => {};
  let aborted = false;

  const state = { videoId: auth.videoId || null, uploadToken: auth.uploadToken || null };

  function guard() {
    if (aborted) throw new WeirUploadError("the upload was aborted", { code: "aborted" });
  }

  async function whilePaused() {
    while (paused && !aborted) await resumed;
    guard();
  }

  // one request to the api: 429 waited out for its Retry-After, network errors and 5xx retried with backoff
  async function api(method, path, { body, credential, headers = {} } = {}) {
    let failures = 0;
    let waits = 0;
    for (;;) {
      await whilePaused();
      let response;
      try {
        response = await fetchImpl(apiUrl + path, {
          method,
          headers: {
            Authorization: `Bearer ${credential || state.uploadToken}`,
            ...(body === undefined ? {} : { "Content-Type": "application/json" }),
            ...headers,
          },
          body: body === undefined ? undefined : JSON.stringify(body),
          signal: stopper.signal,
        });
      } catch (err) {
        guard();
        if (++failures >= o.maxAttempts) {
          throw new WeirUploadError(`network error: ${err?.message || err}`, { code: "network_error", cause: err });
        }
        emit("retry", { what: `${method} ${path}`, attempt: failures, error: err });
        await sleep(backoffDelay(failures - 1, { baseMs: o.backoffBaseMs, maxMs: o.backoffMaxMs, random }),
          stopper.signal).catch(guard);
        continue;
      }
      if (response.ok) {
        if (response.status === 204) return null;
        return response.json();
      }
      if (response.status === 429 && waits < o.maxRateLimitWaits) {
        waits++;
        const after = parseRetryAfter(response.headers.get("retry-after"));
        const ms = Math.min(o.retryAfterMaxMs, after ?? backoffDelay(waits, { baseMs: o.backoffBaseMs,
          maxMs: o.backoffMaxMs, random }));
        await response.body?.cancel().catch(() => {});
        emit("ratelimited", { what: `${method} ${path}`, waitMs: ms });
        await sleep(ms, stopper.signal).catch(guard);
        continue;
      }
      if (response.status >= 500 && ++failures < o.maxAttempts) {
        await response.body?.cancel().catch(() => {});
        emit("retry", { what: `${method} ${path}`, attempt: failures, status: response.status });
        await sleep(backoffDelay(failures - 1, { baseMs: o.backoffBaseMs, maxMs: o.backoffMaxMs, random }),
          stopper.signal).catch(guard);
        continue;
      }
      throw await problemOf(response);
    }
  }

  const videoPath = () => `${SDK}/videos/${encodeURIComponent(state.videoId)}`;

  async function createVideo() {
    const policy = o.playbackPolicy ? `?playback_policy=${encodeURIComponent(o.playbackPolicy)}` : "";
    // one key for this create and its retries: a retry after an answer lost on the way gets the video the first
    // attempt made, never a second one (an api before release 1.1.0 ignores the header)
    const video = await api("POST", `${SDK}/videos${policy}`, {
      credential: auth.publishableKey,
      body: { name: o.name || file.name || "upload", ...(o.metadata ? { metadata: o.metadata } : {}) },
      headers: { "Idempotency-Key": o.idempotencyKey || globalThis.crypto.randomUUID() },
    });
    // an api that does not know the policy (an older release) creates a public video: never go on as if signed
    if (o.playbackPolicy && video.playback?.policy !== o.playbackPolicy) {
      throw new WeirUploadError(`the api did not apply playback policy ${o.playbackPolicy}`,
        { code: "playback_policy_not_applied" });
    }
    state.videoId = video.id;
    state.uploadToken = video.upload_token;
    emit("created", { videoId: video.id, uploadToken: video.upload_token, video });
    return video;
  }

  async function run() {
    let fresh = false;
    let saved = null;
    if (!state.videoId) {
      saved = await storageGet(storage, resumeKey);
      if (saved && saved.videoId && saved.uploadToken) {
        state.videoId = saved.videoId;
        state.uploadToken = saved.uploadToken;
      } else {
        await createVideo();
        fresh = true;
      }
    }
    const contentType = contentTypeOf(file, o.contentType);
    let opened;
    try {
      opened = await api("POST", `${videoPath()}/upload`, { body: { content_type: contentType, size: file.size } });
    } catch (err) {
      // a stored upload that cannot go on (token expired, video gone or finished): start over with a new video
      if (saved && auth.publishableKey && err instanceof WeirUploadError && [401, 403, 404, 409].includes(err.status)) {
        await storageRemove(storage, resumeKey);
        saved = null;
        await createVideo();
        fresh = true;
        opened = await api("POST", `${videoPath()}/upload`, { body: { content_type: contentType, size: file.size } });
      } else {
        throw err;
      }
    }
    const partSize = choosePartSize(file.size, {
      partSizeMin: opened.part_size_min,
      partNumberMax: opened.part_number_max,
      preferred: saved?.partSize || o.partSize,
    });
    await storageSet(storage, resumeKey, { videoId: state.videoId, uploadToken: state.uploadToken, partSize,
      size: file.size });
    const plan = planParts(file.size, partSize);
    let done = new Map();
    let missing = plan;
    if (!fresh) {
      const listing = await api("GET", `${videoPath()}/upload/parts`);
      ({ done, missing } = planResume(plan, listing));
    }
    const total = file.size;
    let sent = plan.filter((p) => done.has(p.partNumber)).reduce((n, p) => n + (p.end - p.start), 0);
    emit("progress", { sent, total });
    if (missing.length < plan.length) emit("resumed", { stored: plan.length - missing.length, missing: missing.length });

    // part URLs, asked for in batches and renewed when expired (or refused by storage)
    const urls = new Map(); // partNumber -> {url, expiresAt}
    const pendingUrls = new Map(); // partNumber -> Promise
    const queue = [...missing];
    async function urlFor(partNumber, renew) {
      const now = Date.now();
      const cached = urls.get(partNumber);
      if (!renew && cached && (!cached.expiresAt || cached.expiresAt - now > o.urlMarginMs)) return cached.url;
      if (!renew && pendingUrls.has(partNumber)) {
        await pendingUrls.get(partNumber);
        return urlFor(partNumber, false);
      }
      const batch = [partNumber, ...queue.map((p) => p.partNumber).filter((n) => n !== partNumber &&
        !pendingUrls.has(n) && !urls.has(n))].slice(0, o.urlBatch);
      const request = api("POST", `${videoPath()}/upload/parts`, { body: { part_numbers: batch } }).then((answer) => {
        for (const p of answer.parts) {
          urls.set(p.part_number, { url: p.url, expiresAt: p.expires_at ? Date.parse(p.expires_at) : 0 });
        }
      });
      for (const n of batch) pendingUrls.set(n, request);
      try {
        await request;
      } finally {
        for (const n of batch) if (pendingUrls.get(n) === request) pendingUrls.delete(n);
      }
      const got = urls.get(partNumber);
      if (!got) throw new WeirUploadError(`no URL for part ${partNumber}`, { code: "no_part_url" });
      return got.url;
    }

    // bytes of parts in flight (XHR's upload events): progress moves within a part, and falls back if it fails
    const inflight = new Map();
    function report() {
      let moving = 0;
      for (const b of inflight.values()) moving += b;
      emit("progress", { sent: Math.min(total, sent + moving), total });
    }
    function moved(partNumber, bytes) {
      if (bytes) inflight.set(partNumber, bytes);
      else inflight.delete(partNumber);
      report();
    }

    async function sendPart(part) {
      let failures = 0;
      let refreshes = 0;
      let waits = 0;
      let renew = false;
      for (;;) {
        await whilePaused();
        const url = await urlFor(part.partNumber, renew);
        renew = false;
        const signal = pauser.signal;
        const both = AbortSignal.any ? AbortSignal.any([signal, stopper.signal]) : signal;
        let response;
        const body = file.slice(part.start, part.end);
        try {
          response = useXhr
            ? await xhrPut(url, body, both, (bytes) => moved(part.partNumber, bytes))
            : await fetchImpl(url, { method: "PUT", body, signal: both });
        } catch (err) {
          moved(part.partNumber, 0);
          guard();
          if (paused || signal.aborted) continue; // paused mid-flight: sent again on resume
          if (++failures >= o.maxAttempts) {
            throw new WeirUploadError(`part ${part.partNumber}: network error: ${err?.message || err}`,
              { code: "network_error", cause: err });
          }
          emit("retry", { part: part.partNumber, attempt: failures, error: err });
          await sleep(backoffDelay(failures - 1, { baseMs: o.backoffBaseMs, maxMs: o.backoffMaxMs, random }),
            stopper.signal).catch(guard);
          continue;
        }
        if (response.ok) {
          const etag = response.headers.get("etag");
          await response.body?.cancel().catch(() => {});
          if (!etag) {
            throw new WeirUploadError("storage answered without a readable ETag (is it exposed by the bucket's CORS?)",
              { code: "etag_unreadable", status: response.status });
          }
          return etag;
        }
        moved(part.partNumber, 0);
        await response.body?.cancel().catch(() => {});
        if (response.status === 403 && refreshes < o.maxUrlRefreshes) {
          refreshes++; // expired (or otherwise refused) presigned URL: ask for a fresh one
          renew = true;
          emit("retry", { part: part.partNumber, attempt: failures, status: 403, renewUrl: true });
          continue;
        }
        if (response.status === 429 || response.status === 503) {
          const after = parseRetryAfter(response.headers.get("retry-after"));
          if (after != null && waits < o.maxRateLimitWaits) {
            waits++;
            emit("ratelimited", { part: part.partNumber, waitMs: Math.min(o.retryAfterMaxMs, after) });
            await sleep(Math.min(o.retryAfterMaxMs, after), stopper.signal).catch(guard);
            continue;
          }
        }
        if (retryable(response.status) && ++failures < o.maxAttempts) {
          emit("retry", { part: part.partNumber, attempt: failures, status: response.status });
          await sleep(backoffDelay(failures - 1, { baseMs: o.backoffBaseMs, maxMs: o.backoffMaxMs, random }),
            stopper.signal).catch(guard);
          continue;
        }
        throw new WeirUploadError(`part ${part.partNumber}: storage answered ${response.status}`,
          { code: response.status === 403 ? "part_url_refused" : "storage_error", status: response.status });
      }
    }

    let failed = null;
    async function worker() {
      while (queue.length && !failed) {
        const part = queue.shift();
        try {
          const etag = await sendPart(part);
          done.set(part.partNumber, etag);
          inflight.delete(part.partNumber);
          sent += part.end - part.start;
          emit("part", { partNumber: part.partNumber, etag, size: part.end - part.start });
          report(); // with the bytes of the parts still in flight: a part done never moves progress back
        } catch (err) {
          failed = failed || err;
        }
      }
    }
    await Promise.all(Array.from({ length: Math.max(1, Math.min(o.concurrency, queue.length)) }, worker));
    if (failed) throw failed;
    guard();

    const parts = [...done.entries()].sort((a, b) => a[0] - b[0]).map(([n, etag]) => ({ part_number: n, etag }));
    const video = await api("POST", `${videoPath()}/upload/complete`, { body: { parts } });
    await storageRemove(storage, resumeKey);
    emit("complete", video);
    return video;
  }

  const promise = run().catch((err) => {
    if (aborted) throw new WeirUploadError("the upload was aborted", { code: "aborted", cause: err });
    if (err instanceof WeirUploadError) throw err;
    throw new WeirUploadError(String(err?.message || err), { code: "error", cause: err });
  });
  promise.catch(() => {}); // the caller's own handler decides; no unhandled rejection from the controller

  const controller = {
    promise,
    get videoId() {
      return state.videoId;
    },
    get uploadToken() {
      return state.uploadToken;
    },
    get paused() {
      return paused;
    },
    on(event, fn) {
      if (!listeners.has(event)) listeners.set(event, new Set());
      listeners.get(event).add(fn);
      return controller;
    },
    off(event, fn) {
      listeners.get(event)?.delete(fn);
      return controller;
    },
    pause() {
      if (paused || aborted) return;
      paused = true;
      resumed = new Promise((resolve) => {
        wake = resolve;
      });
      pauser.abort(new WeirUploadError("paused", { code: "paused" }));
      emit("pause", {});
    },
    resume() {
      if (!paused || aborted) return;
      paused = false;
      pauser = new AbortController();
      wake();
      emit("resume", {});
    },
    async abort() {
      if (aborted) return;
      aborted = true;
      stopper.abort(new WeirUploadError("the upload was aborted", { code: "aborted" }));
      wake();
      await storageRemove(storage, resumeKey);
      if (state.videoId) { // an upload not opened yet answers 409: harmless
        try {
          await fetchImpl(`${apiUrl}${videoPath()}/upload`, {
            method: "DELETE",
            headers: { Authorization: `Bearer ${state.uploadToken}` },
          });
        } catch {
          // storage drops an abandoned upload on its own (the sweep); nothing more to do here
        }
      }
      emit("abort", {});
    },
  };
  return controller;
}

export default upload;
