// The SDK's logic without a network: planning, backoff, Retry-After, resume planning; and the controller against
// a fake api and storage (retries, 429, expired URLs, pause/resume, abort).
import assert from "node:assert/strict";
import { describe, test } from "node:test";

import {
  WeirUploadError, backoffDelay, choosePartSize, parseRetryAfter, planParts, planResume, playbackUrls, retryable,
  upload, withPlaybackToken,
} from "../src/index.js";

const MiB = 1024 * 1024;

describe("part planning", () => {
  test("parts of partSize, the last one shorter", () => {
    const plan = planParts(12 * MiB + 1, 5 * MiB);
    assert.deepEqual(plan.map((p) => [p.partNumber, p.start, p.end]),
      [[1, 0, 5 * MiB], [2, 5 * MiB, 10 * MiB], [3, 10 * MiB, 12 * MiB + 1]]);
  });
  test("an exact multiple has no empty tail; an empty file is one empty part", () => {
    assert.equal(planParts(10 * MiB, 5 * MiB).length, 2);
    assert.deepEqual(planParts(0, 5 * MiB), [{ partNumber: 1, start: 0, end: 0 }]);
    assert.throws(() => planParts(10, 0), RangeError);
  });
  test("part size: at least the minimum, the caller's wish above it, large enough for part_number_max", () => {
    assert.equal(choosePartSize(12 * MiB, { partSizeMin: 5 * MiB }), 5 * MiB);
    assert.equal(choosePartSize(12 * MiB, { partSizeMin: 5 * MiB, preferred: 1 * MiB }), 5 * MiB);
    assert.equal(choosePartSize(12 * MiB, { partSizeMin: 5 * MiB, preferred: 8 * MiB }), 8 * MiB);
    const huge = 100_000 * MiB;
    const size = choosePartSize(huge, { partSizeMin: 5 * MiB, partNumberMax: 10_000 });
    assert.equal(size, 10 * MiB);
    assert.ok(planParts(huge, size).length <= 10_000);
  });
});

describe("backoff", () => {
  test("exponential caps with full jitter, bounded by the maximum", () => {
    const top = () => 0.999999;
    const caps = [0, 1, 2, 3, 4, 5, 6, 7].map((a) => backoffDelay(a, { baseMs: 100, maxMs: 5000, random: top }));
    assert.deepEqual(caps, [99, 199, 399, 799, 1599, 3199, 4999, 4999]);
    assert.equal(backoffDelay(3, { baseMs: 100, maxMs: 5000, random: () => 0 }), 0);
    assert.equal(backoffDelay(3, { baseMs: 100, maxMs: 5000, random: () => 0.5 }), 400);
  });
  test("what is retried", () => {
    assert.deepEqual([408, 429, 500, 502, 503].map(retryable), [true, true, true, true, true]);
    assert.deepEqual([400, 401, 403, 404, 409, 413, 422].map(retryable), Array(7).fill(false));
  });
});

describe("Retry-After", () => {
  const now = Date.parse("2026-01-01T00:00:00Z");
  test("delta seconds and HTTP dates", () => {
    assert.equal(parseRetryAfter("7", now), 7000);
    assert.equal(parseRetryAfter(" 0 ", now), 0);
    assert.equal(parseRetryAfter("Thu, 01 Jan 2026 00:00:30 GMT", now), 30_000);
    assert.equal(parseRetryAfter("Wed, 31 Dec 2025 23:59:00 GMT", now), 0); // in the past: now
  });
  test("absent or unreadable", () => {
    for (const v of [null, undefined, "", "soon", "1.5", "-3", "10s"]) assert.equal(parseRetryAfter(v, now), null, v);
  });
});

describe("resume planning", () => {
  test("stored parts of the planned size are done, the rest missing", () => {
    const plan = planParts(12 * MiB, 5 * MiB);
    const { done, missing } = planResume(plan, { parts: [
      { part_number: 1, etag: '"a"', size: 5 * MiB },
      { part_number: 3, etag: '"c"', size: 1 * MiB }, // cut at another size: sent again
      { part_number: 9, etag: '"z"', size: 5 * MiB }, // not in the plan: ignored
    ] });
    assert.deepEqual([...done], [[1, '"a"']]);
    assert.deepEqual(missing.map((p) => p.partNumber), [2, 3]);
  });
  test("an empty listing leaves everything missing", () => {
    const plan = planParts(12 * MiB, 5 * MiB);
    assert.equal(planResume(plan, { parts: [] }).missing.length, 3);
    assert.equal(planResume(plan, null).missing.length, 3);
  });
});

// ------------------------------------------------------------------------------ a fake api and storage

function fakeStack(opts = {}) {
  const { partSizeMin = 4, failPuts = {}, expiredOnce = new Set(), rateLimitFirst = false } = opts;
  const stored = new Map(); // part number -> {etag, size}
  const calls = [];
  const urls = [];
  let rateLimited = !rateLimitFirst;
  let urlVersion = 0;
  const json = (status, body, headers = {}) => new Response(body == null ? null : JSON.stringify(body),
    { status, headers: { "content-type": "application/json", ...headers } });
  async function fetch(url, init = {}) {
    const method = init.method || "GET";
    const u = new URL(url);
    calls.push(`${method} ${u.pathname}`);
    urls.push(String(url));
    if (u.host === "s3.test") {
      const n = Number(u.searchParams.get("partNumber"));
      if (expiredOnce.has(n) && u.searchParams.get("v") === "1") return new Response("expired", { status: 403 });
      if (failPuts[n] > 0) {
        failPuts[n]--;
        throw new TypeError("fetch failed");
      }
      const body = new Uint8Array(await new Response(init.body).arrayBuffer());
      stored.set(n, { etag: `"e${n}"`, size: body.length });
      return new Response(null, { status: 200, headers: { etag: `"e${n}"` } });
    }
    if (method === "POST" && u.pathname === "/sdk/v1/videos") {
      // an api that shows playback applies the policy asked in the query; an older one shows none
      const policy = u.searchParams.get("playback_policy") || "public";
      const playback = opts.olderApi ? {} : { playback: { policy, hls: null, thumbnail: null, storyboard: null } };
      return json(201, { id: "v1", status: "created", name: "n", upload_token: "wut_1", ...playback });
    }
    if (!rateLimited) {
      rateLimited = true;
      return json(429, { code: "rate_limited", detail: "slow down" }, { "retry-after": "0" });
    }
    if (u.pathname === "/sdk/v1/videos/v1/upload" && method === "POST") {
      return json(200, { upload_id: "u", part_size_min: partSizeMin, part_number_max: 10000 });
    }
    if (u.pathname === "/sdk/v1/videos/v1/upload/parts" && method === "POST") {
      urlVersion++;
      const { part_numbers } = JSON.parse(init.body);
      return json(200, { parts: part_numbers.map((n) => ({ part_number: n,
        url: `http://s3.test/obj?partNumber=${n}&v=${urlVersion}`, expires_at: new Date(Date.now() + 3600e3).toISOString() })) });
    }
    if (u.pathname === "/sdk/v1/videos/v1/upload/parts" && method === "GET") {
      return json(200, { parts: [...stored].map(([n, p]) => ({ part_number: n, ...p })) });
    }
    if (u.pathname === "/sdk/v1/videos/v1/upload/complete") {
      const { parts } = JSON.parse(init.body);
      for (const p of parts) assert.equal(stored.get(p.part_number)?.etag, p.etag);
      return json(200, { id: "v1", status: "uploaded", name: "n", parts: parts.length });
    }
    if (u.pathname === "/sdk/v1/videos/v1/upload" && method === "DELETE") return new Response(null, { status: 204 });
    return json(404, { code: "not_found", detail: "no" });
  }
  return { fetch, stored, calls, urls };
}

const AUTH = { apiUrl: "http://api.test", publishableKey: "wpk_x" };
const FAST = { backoffBaseMs: 1, backoffMaxMs: 2 };

describe("the controller against a fake stack", () => {
  test("uploads every part, retrying network errors, renewing an expired URL, waiting out a 429", async () => {
    const stack = fakeStack({ failPuts: { 2: 2 }, expiredOnce: new Set([3]), rateLimitFirst: true });
    const progress = [];
    const retries = [];
    const up = upload(new Blob(["0123456789ab"]), AUTH, { ...FAST, fetch: stack.fetch, concurrency: 2 });
    up.on("progress", (p) => progress.push(p)).on("retry", (r) => retries.push(r));
    const video = await up.promise;
    assert.deepEqual(video, { id: "v1", status: "uploaded", name: "n", parts: 3 });
    assert.deepEqual([...stack.stored.keys()].sort(), [1, 2, 3]);
    assert.deepEqual(progress.at(0), { sent: 0, total: 12 });
    assert.deepEqual(progress.at(-1), { sent: 12, total: 12 });
    assert.equal(retries.filter((r) => r.part === 2 && r.error).length, 2);
    assert.equal(retries.filter((r) => r.part === 3 && r.renewUrl).length, 1);
    assert.ok(stack.calls.filter((c) => c === "POST /sdk/v1/videos/v1/upload").length === 2); // 429, then answered
  });

  test("a part that keeps failing ends the upload with network_error after maxAttempts", async () => {
    const stack = fakeStack({ failPuts: { 1: 100 } });
    const up = upload(new Blob(["0123"]), AUTH, { ...FAST, fetch: stack.fetch, maxAttempts: 3 });
    await assert.rejects(up.promise, (e) => e instanceof WeirUploadError && e.code === "network_error");
    assert.equal(stack.calls.filter((c) => c.startsWith("PUT")).length, 3);
  });

  test("a problem reaches the caller with its code", async () => {
    const up = upload(new Blob(["x"]), AUTH, { fetch: async () => new Response(JSON.stringify(
      { type: "t", title: "Unauthorized", status: 401, detail: "bad key", code: "unauthenticated" }), { status: 401 }) });
    await assert.rejects(up.promise, (e) => e instanceof WeirUploadError && e.code === "unauthenticated" &&
      e.status === 401 && e.detail === "bad key");
  });

  test("resume with a stored video sends only the missing parts", async () => {
    const stack = fakeStack({ failPuts: { 2: 1 } });
    const memory = new Map();
    const storage = { getItem: (k) => memory.get(k) ?? null, setItem: (k, v) => memory.set(k, v),
      removeItem: (k) => memory.delete(k) };
    const blob = new Blob(["0123456789ab"]);
    const options = { ...FAST, fetch: stack.fetch, storage, resumeKey: "k" };
    const first = upload(blob, AUTH, { ...options, maxAttempts: 1, concurrency: 1 });
    await assert.rejects(first.promise, (e) => e.code === "network_error");
    assert.deepEqual([...stack.stored.keys()], [1]);
    assert.equal(JSON.parse(memory.get("k")).videoId, "v1");
    stack.calls.length = 0;
    const second = upload(blob, AUTH, options);
    let resumed = null;
    second.on("resumed", (r) => { resumed = r; });
    assert.equal((await second.promise).parts, 3);
    assert.deepEqual(resumed, { stored: 1, missing: 2 });
    assert.ok(!stack.calls.includes("POST /sdk/v1/videos"), "the stored video is resumed, not a new one");
    assert.deepEqual(stack.calls.filter((c) => c.startsWith("PUT")).length, 2);
    assert.ok(!memory.has("k"), "a completed upload leaves nothing stored");
  });

  test("pause stops sending, resume goes on, abort calls the abort route", async () => {
    const stack = fakeStack();
    let release;
    const gate = new Promise((r) => { release = r; });
    let puts = 0;
    const gated = async (url, init) => {
      if (init?.method === "PUT" && ++puts === 2) await gate; // the second part waits until told
      return stack.fetch(url, init);
    };
    const up = upload(new Blob(["0123456789ab"]), AUTH, { ...FAST, fetch: gated, concurrency: 1 });
    up.on("part", ({ partNumber }) => { if (partNumber === 1) up.pause(); });
    await new Promise((r) => setTimeout(r, 50));
    assert.equal(up.paused, true);
    assert.deepEqual([...stack.stored.keys()], [1]);
    up.resume();
    release();
    assert.equal((await up.promise).status, "uploaded");

    const stack2 = fakeStack();
    const up2 = upload(new Blob(["0123456789ab"]), AUTH, { ...FAST, fetch: stack2.fetch, concurrency: 1 });
    up2.on("part", () => up2.pause());
    await new Promise((r) => setTimeout(r, 50));
    await up2.abort();
    await assert.rejects(up2.promise, (e) => e instanceof WeirUploadError && e.code === "aborted");
    assert.ok(stack2.calls.includes("DELETE /sdk/v1/videos/v1/upload"));
  });
});

describe("playback", () => {
  test("the player's URLs, a token and another frame added as query parameters", () => {
    assert.deepEqual(playbackUrls("http://api.test/", "v 1"), {
      hls: "http://api.test/v1/playback/v%201/master.m3u8",
      thumbnail: "http://api.test/v1/videos/v%201/thumbnail.jpg",
      storyboard: "http://api.test/v1/videos/v%201/storyboard.vtt",
      mp4: "http://api.test/v1/playback/v%201/highest.mp4",
      embed: "http://api.test/embed/v%201",
    });
    const signed = playbackUrls("http://api.test", "v1", { token: "a.b+c", time: 1.5, width: 320 });
    assert.equal(signed.hls, "http://api.test/v1/playback/v1/master.m3u8?token=a.b%2Bc");
    assert.equal(signed.thumbnail, "http://api.test/v1/videos/v1/thumbnail.jpg?time=1.5&width=320&token=a.b%2Bc");
    assert.equal(signed.embed, "http://api.test/embed/v1?token=a.b%2Bc");
    assert.equal(withPlaybackToken("http://api.test/x.m3u8", "t"), "http://api.test/x.m3u8?token=t");
    assert.equal(withPlaybackToken("http://api.test/x.jpg?time=1", "t"), "http://api.test/x.jpg?time=1&token=t");
    assert.equal(withPlaybackToken(null, "t"), null);
    assert.throws(() => playbackUrls("", "v1"), TypeError);
  });

  test("a signed video is asked for at create, and an api that did not apply it stops the upload", async () => {
    const stack = fakeStack();
    const up = upload(new Blob(["0123"]), AUTH, { ...FAST, fetch: stack.fetch, playbackPolicy: "signed" });
    let created = null;
    up.on("created", (c) => { created = c; });
    await up.promise;
    assert.ok(stack.urls.some((u) => u.endsWith("/sdk/v1/videos?playback_policy=signed")), stack.urls.join(","));
    assert.equal(created.video.playback.policy, "signed");

    const older = fakeStack({ olderApi: true });
    const refused = upload(new Blob(["0123"]), AUTH, { ...FAST, fetch: older.fetch, playbackPolicy: "signed" });
    await assert.rejects(refused.promise, (e) => e instanceof WeirUploadError && e.code === "playback_policy_not_applied");
    assert.ok(!older.calls.some((c) => c.startsWith("PUT")), "nothing sent to a video that is not what was asked");
  });
});
