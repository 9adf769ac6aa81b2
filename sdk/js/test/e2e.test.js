// The SDK against the real stack (api, auth, PostgreSQL, S3, NATS): run by tests/integration/test_js_sdk.py, which
// sets WEIR_SDK_API_URL and WEIR_SDK_PUBLISHABLE_KEY; skipped without them.
import assert from "node:assert/strict";
import { describe, test } from "node:test";

import { WeirUploadError, getVideo, playbackUrls, upload } from "../src/index.js";

const apiUrl = process.env.WEIR_SDK_API_URL;
const publishableKey = process.env.WEIR_SDK_PUBLISHABLE_KEY;
const skip = !(apiUrl && publishableKey) && "WEIR_SDK_API_URL and WEIR_SDK_PUBLISHABLE_KEY are not set";
const MiB = 1024 * 1024;

function blobOf(size) {
  const bytes = new Uint8Array(size);
  for (let i = 0; i < size; i += 65536) crypto.getRandomValues(bytes.subarray(i, Math.min(size, i + 65536)));
  bytes.set([0, 0, 0, 0x20, ...new TextEncoder().encode("ftypisom")]); // an MP4's first box: the api sniffs it
  return new Blob([bytes], { type: "video/mp4" });
}

/** fetch, counting the PUTs to storage; after `cutAfter` successful PUTs every further one fails as offline. */
function countingFetch({ cutAfter = Infinity } = {}) {
  const seen = { puts: [], calls: [] };
  const f = async (url, init = {}) => {
    const method = init.method || "GET";
    const u = new URL(url);
    seen.calls.push(`${method} ${u.pathname}`);
    if (method === "PUT") {
      if (seen.puts.length >= cutAfter) throw new TypeError("fetch failed (network cut)");
      const r = await fetch(url, init);
      if (r.ok) seen.puts.push(Number(u.searchParams.get("partNumber")));
      return r;
    }
    return fetch(url, init);
  };
  return { f, seen };
}

async function listing(videoId, token) {
  return fetch(`${apiUrl}/sdk/v1/videos/${videoId}/upload/parts`, { headers: { Authorization: `Bearer ${token}` } });
}

describe("against the real stack", { skip }, () => {
  test("a 12 MiB Blob completes in 3 parts with progress", async () => {
    const { f, seen } = countingFetch();
    const progress = [];
    const up = upload(blobOf(12 * MiB), { apiUrl, publishableKey }, { fetch: f, name: "sdk e2e" });
    up.on("progress", (p) => progress.push(p));
    const video = await up.promise;
    assert.equal(video.id, up.videoId);
    assert.equal(video.status, "uploaded");
    assert.deepEqual(seen.puts.sort(), [1, 2, 3]);
    assert.deepEqual(progress.at(0), { sent: 0, total: 12 * MiB });
    assert.deepEqual(progress.at(-1), { sent: 12 * MiB, total: 12 * MiB });
    assert.equal(progress.length, 4);
    assert.equal((await listing(video.id, up.uploadToken)).status, 409); // nothing open any more
    const shown = await getVideo({ apiUrl, videoId: up.videoId, uploadToken: up.uploadToken });
    assert.equal(shown.id, video.id);
    assert.equal(shown.status, "uploaded"); // this stack has no encode: it stays so
    assert.deepEqual(shown.file, { size: 12 * MiB, content_type: "video/mp4" });
  });

  test("getVideo: the token's own video only, and a problem's code on refusal", async () => {
    const a = upload(blobOf(5 * MiB), { apiUrl, publishableKey }, { name: "sdk getVideo a" });
    const b = upload(blobOf(5 * MiB), { apiUrl, publishableKey }, { name: "sdk getVideo b" });
    await Promise.all([a.promise, b.promise]);
    await assert.rejects(getVideo({ apiUrl, videoId: b.videoId, uploadToken: a.uploadToken }),
      (err) => err instanceof WeirUploadError && err.status === 403 && err.code === "forbidden");
    await assert.rejects(getVideo({ apiUrl, videoId: a.videoId, uploadToken: "wut_forged" }),
      (err) => err instanceof WeirUploadError && err.status === 401 && err.code === "invalid_credential");
  });

  test("interrupted after one part, started again with the same video and token: only the missing parts", async () => {
    const blob = blobOf(12 * MiB);
    const cut = countingFetch({ cutAfter: 1 });
    let created = null;
    const first = upload(blob, { apiUrl, publishableKey }, { fetch: cut.f, concurrency: 1, maxAttempts: 2,
      backoffBaseMs: 10 });
    first.on("created", (c) => { created = c; });
    await assert.rejects(first.promise, (e) => e instanceof WeirUploadError && e.code === "network_error");
    assert.deepEqual(cut.seen.puts, [1]);
    assert.ok(created && created.videoId && created.uploadToken);
    const stored = await (await listing(created.videoId, created.uploadToken)).json();
    assert.deepEqual(stored.parts.map((p) => [p.part_number, p.size]), [[1, 5 * MiB]]);

    // "the page reloads": a new upload of the same file with the video and token the caller kept
    const again = countingFetch();
    const second = upload(blob, { apiUrl, videoId: created.videoId, uploadToken: created.uploadToken },
      { fetch: again.f });
    let resumed = null;
    const progress = [];
    second.on("resumed", (r) => { resumed = r; }).on("progress", (p) => progress.push(p));
    const video = await second.promise;
    assert.equal(video.id, created.videoId);
    assert.equal(video.status, "uploaded");
    assert.deepEqual(resumed, { stored: 1, missing: 2 });
    assert.deepEqual(again.seen.puts.sort(), [2, 3]);
    assert.ok(!again.seen.calls.includes("POST /sdk/v1/videos"));
    assert.deepEqual(progress.at(0), { sent: 5 * MiB, total: 12 * MiB });
    assert.deepEqual(progress.at(-1), { sent: 12 * MiB, total: 12 * MiB });
  });

  test("with a storage hook a second upload() of the same file resumes the stored video", async () => {
    const blob = blobOf(11 * MiB);
    const memory = new Map();
    const storage = { getItem: (k) => memory.get(k) ?? null, setItem: (k, v) => memory.set(k, v),
      removeItem: (k) => memory.delete(k) };
    const cut = countingFetch({ cutAfter: 1 });
    const first = upload(blob, { apiUrl, publishableKey }, { fetch: cut.f, storage, resumeKey: "clip",
      concurrency: 1, maxAttempts: 1 });
    await assert.rejects(first.promise, (e) => e.code === "network_error");
    const kept = JSON.parse(memory.get("clip"));
    assert.equal(kept.videoId, first.videoId);
    const again = countingFetch();
    const second = upload(blob, { apiUrl, publishableKey }, { fetch: again.f, storage, resumeKey: "clip" });
    const video = await second.promise;
    assert.equal(video.id, first.videoId);
    assert.deepEqual(again.seen.puts.sort(), [2, 3]);
    assert.ok(!memory.has("clip"));
  });

  test("abort ends the upload at the api", async () => {
    const up = upload(blobOf(11 * MiB), { apiUrl, publishableKey }, { concurrency: 1 });
    let aborting = null;
    up.on("part", () => { aborting ??= up.abort(); });
    await assert.rejects(up.promise, (e) => e instanceof WeirUploadError && e.code === "aborted");
    await aborting; // abort() resolves once the api has been told (the upload's promise rejects at once)
    const r = await listing(up.videoId, up.uploadToken);
    assert.equal(r.status, 409, await r.text());
  });

  test("a signed video: playback before encoding, and playbackUrls reach the api's player routes", async () => {
    let created = null;
    const up = upload(blobOf(64 * 1024), { apiUrl, publishableKey }, { name: "sdk signed", playbackPolicy: "signed" });
    up.on("created", (c) => { created = c; });
    const video = await up.promise;
    // each URL null till there
    const nothingYet = { policy: "signed", hls: null, thumbnail: null, storyboard: null, embed: null, mp4: null };
    assert.deepEqual(created.video.playback, nothingYet); // the create's answer
    const shown = await getVideo({ apiUrl, videoId: video.id, uploadToken: up.uploadToken });
    assert.equal(shown.status, "uploaded"); // this stack has no encode: the URLs stay null
    assert.deepEqual(shown.playback, nothingYet);
    // the URLs the api will show once encoded are the SDK's: the same members, each served by the api's player
    // route for this video (another path or video would be a 404), which asks a signed video for its token
    const urls = playbackUrls(apiUrl, video.id);
    assert.deepEqual(Object.keys(urls).sort(), Object.keys(nothingYet).filter((k) => k !== "policy").sort());
    const page = { headers: { Origin: "https://player.example" } };
    // the player page is the same for every video (it asks the routes below for what it plays)
    const embed = await fetch(urls.embed);
    assert.equal(embed.status, 200);
    assert.ok(embed.headers.get("content-type").startsWith("text/html"));
    delete urls.embed;
    for (const [what, url] of Object.entries(urls)) {
      const r = await fetch(url, page);
      assert.equal(r.status, 401, `${what} ${url}`);
      assert.equal((await r.json()).code, "playback_token_required");
      assert.equal(r.headers.get("access-control-allow-origin"), "*"); // a player on any page reads it
    }
    for (const [what, url] of Object.entries(playbackUrls(apiUrl, video.id, { token: "not.a.jwt" }))) {
      if (what === "embed") continue;
      const r = await fetch(url, page);
      assert.equal(r.status, 403, `${what} ${url}`); // the token reached the api, as ?token=
      assert.equal((await r.json()).code, "playback_token_invalid");
    }
  });

  test("a create whose answer was lost is retried with its key: one video, the one the api made", async () => {
    let lost = null;
    const creates = [];
    const f = async (url, init = {}) => {
      const u = new URL(url);
      if ((init.method || "GET") === "POST" && u.pathname === "/sdk/v1/videos") {
        creates.push(init.headers["Idempotency-Key"]);
        const r = await fetch(url, init);
        if (lost === null) { // the api made the video; its answer never reaches the page
          lost = (await r.json()).id;
          throw new TypeError("fetch failed (connection reset)");
        }
        return r;
      }
      return fetch(url, init);
    };
    const up = upload(blobOf(64 * 1024), { apiUrl, publishableKey }, { fetch: f, name: "sdk lost answer",
      backoffBaseMs: 1 });
    const video = await up.promise;
    assert.equal(creates.length, 2);
    assert.ok(creates[0] && creates[0] === creates[1], creates); // one key for the create and its retry
    assert.equal(video.id, lost); // the video the lost answer named, not a second one
  });

  test("a bad publishable key is refused with the problem's code", async () => {
    const up = upload(new Blob(["x"]), { apiUrl, publishableKey: "wpk_" + "0".repeat(32) });
    await assert.rejects(up.promise, (e) => e instanceof WeirUploadError && e.status === 401 &&
      typeof e.code === "string" && e.code !== "http_401");
  });
});
