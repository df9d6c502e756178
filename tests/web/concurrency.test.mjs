// Several clients at once against `specmesh serve` on stories260K (8 sessions):
//   throughput  aggregate tokens/s of 4 concurrent `ar` clients against one, in this run (the
//               goal, at least 2x, is held in the long run: SPECMESH_SOAK_SECONDS >= 60);
//   soak        8 concurrent streaming clients for SPECMESH_SOAK_SECONDS (default 8; the
//               issue's figure is 60), mixed strategies, every fourth client leaving mid-stream
//               on every other request. Each completed reply must equal its single-client reply
//               at temperature 0, no request may hang, and the server's memory must come back
//               to its baseline once the clients are gone.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import fs from "node:fs";

import { startServer, stories, draft, metric } from "./harness.mjs";

const soakSeconds = Number(process.env.SPECMESH_SOAK_SECONDS || 8);
const throughputSeconds = Number(process.env.SPECMESH_THROUGHPUT_SECONDS || 4);
const warmupSeconds = Number(process.env.SPECMESH_WARMUP_SECONDS || 3);
// The warm-up goes on, a slice of warmupSeconds at a time, until a slice leaves the heap where
// the one before left it (within this much), or for at most maxWarmupSlices slices: on a slow
// kernel path (SPECMESH_ISA=scalar) 3 s of load did not reach the state the soak then kept.
const warmupSettled = 64 * 1024;
const maxWarmupSlices = 4;
const prompts = ["Once upon a time", "The little dog", "One day, a girl named Lily", "Tom and Sam went to the park"];
const maxTokens = 48;
let server;
let strategies;
const reference = new Map();  // "strategy|prompt" -> text of a single client

const rssKiB = () => Number(/VmRSS:\s+(\d+)/.exec(fs.readFileSync(`/proc/${server.pid}/status`, "utf8"))[1]);

// One streamed completion; `leaveAfter` > 0 aborts it after that many chunks. Resolves with
// the text and completion tokens, or { left: true }; rejects after 60 s (a hang).
async function stream(prompt, strategy, leaveAfter = 0) {
  const controller = new AbortController();
  const timer = setTimeout(() => controller.abort(new Error("request hung for 60 s")), 60000);
  try {
    const res = await fetch(server.base + "/v1/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ prompt, max_tokens: maxTokens, temperature: 0, stream: true, specmesh: { strategy } }),
      signal: controller.signal,
    });
    assert.equal(res.status, 200, await res.clone().text());
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "", text = "", chunks = 0, tokens = 0, done = false;
    while (!done) {
      const { value, done: end } = await reader.read();
      if (end) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const data = buffer.slice(6, cut);
        buffer = buffer.slice(cut + 2);
        if (data === "[DONE]") { done = true; break; }
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        text += chunk.choices[0]?.text ?? "";
        if (chunk.usage) tokens = chunk.usage.completion_tokens;
        if (leaveAfter > 0 && ++chunks >= leaveAfter) {
          controller.abort();
          return { left: true };
        }
      }
    }
    return { text, tokens };
  } finally {
    clearTimeout(timer);
  }
}

// Completion tokens per second of `clients` clients each sending `ar` requests back to back.
async function throughput(clients, seconds) {
  const end = Date.now() + seconds * 1000;
  let tokens = 0;
  const t0 = Date.now();
  await Promise.all(
    Array.from({ length: clients }, async (_, i) => {
      for (let k = 0; Date.now() < end; k++) {
        const r = await stream(prompts[(i + k) % prompts.length], "ar");
        assert.equal(r.text, reference.get("ar|" + prompts[(i + k) % prompts.length]));
        tokens += r.tokens;
      }
    }),
  );
  return tokens / ((Date.now() - t0) / 1000);
}

before(async () => {
  server = await startServer(["-m", stories, "-d", draft, "--strategy", "ar", "--parallel", "8", "-t", "1"],
                             { logName: "concurrency-server" });
  const models = await (await fetch(server.base + "/v1/models")).json();
  strategies = models.data[0].specmesh.strategies.filter((s) => ["ar", "spec", "pipeinfer"].includes(s));
  assert.ok(strategies.length >= 2, "fewer than two strategies to mix: " + strategies);
  for (const strategy of strategies)
    for (const prompt of prompts) reference.set(strategy + "|" + prompt, (await stream(prompt, strategy)).text);
  // Lossless: every strategy's single-client reply is ar's.
  for (const strategy of strategies)
    for (const prompt of prompts) assert.equal(reference.get(strategy + "|" + prompt), reference.get("ar|" + prompt), strategy);
});

after(async () => {
  if (server) await server.stop();
});

test("4 concurrent ar clients get more tokens/s than one (at least twice in the long run)", async () => {
  const one = await throughput(1, throughputSeconds);
  const four = await throughput(4, throughputSeconds);
  console.log(`throughput: 1 ar client ${one.toFixed(1)} tokens/s, 4 ar clients ${four.toFixed(1)} tokens/s ` +
              `(${(four / one).toFixed(2)}x)`);
  assert.ok(four > one, `4 clients ${four.toFixed(1)} tokens/s, no more than one client's ${one.toFixed(1)}`);
  // The goal (at least 2x) is a timing goal: held in the long run, the benchmark
  // (SPECMESH_SOAK_SECONDS >= 60), and only reported in the short one CTest runs on a shared machine.
  if (soakSeconds >= 60) assert.ok(four >= 2 * one, `4 clients ${four.toFixed(1)} tokens/s < 2 x ${one.toFixed(1)}`);
});

// 8 clients for `seconds`, each sending requests back to back: client i's k-th request uses
// prompt i + k and strategy i + k, and every fourth client leaves mid-stream on every other
// request. Counts what happened into `counts` and `byStrategy`.
async function soak(seconds, counts, byStrategy) {
  const end = Date.now() + seconds * 1000;
  await Promise.all(
    Array.from({ length: 8 }, async (_, worker) => {
      for (let k = 0; Date.now() < end; k++) {
        const prompt = prompts[(worker + k) % prompts.length];
        const strategy = strategies[(worker + k) % strategies.length];
        const leaves = worker % 4 === 3 && k % 2 === 0;
        const r = await stream(prompt, strategy, leaves ? 2 + (k % 5) : 0);
        if (r.left) { counts.left++; continue; }
        counts.completed++;
        byStrategy[strategy] = (byStrategy[strategy] || 0) + 1;
        if (r.text !== reference.get(strategy + "|" + prompt)) {
          counts.mismatched++;
          console.error(`mismatch (${strategy}, "${prompt}"): ${JSON.stringify(r.text)}`);
        }
      }
    }),
  );
}

// Waits until no generation runs (the ones whose clients left included); returns /metrics.
async function idle() {
  let m = "";
  const deadline = Date.now() + 10000;
  while (Date.now() < deadline) {
    m = await (await fetch(server.base + "/metrics")).text();
    if (metric(m, "specmesh_generations_in_flight") === 0) break;
    await new Promise((r) => setTimeout(r, 50));
  }
  return m;
}

test(`8 streaming clients for ${soakSeconds} s: mixed strategies, some leaving, replies exact, memory back`, async () => {
  // The baseline: the server's memory once the same load has run for a while, so that what is
  // allocated once and kept (every session's KV cells, the allocator's per-thread caches, the
  // HTTP threads' stacks, the stages' bounded sets of cancelled runs) is in it. What the soak
  // then allocates must be freed when it ends.
  const counts = { completed: 0, left: 0, mismatched: 0 };
  const byStrategy = {};
  let heap0 = null, slices = 0;
  while (slices < maxWarmupSlices) {
    ++slices;
    await soak(warmupSeconds, counts, byStrategy);
    const h = metric(await idle(), "specmesh_heap_allocated_bytes");
    const settled = heap0 !== null && h !== null && h <= heap0 + warmupSettled;
    heap0 = h;
    if (settled) break;
  }
  const baseline = rssKiB();
  const samples = [];
  const sampler = setInterval(() => samples.push(rssKiB()), 1000);
  await soak(soakSeconds, counts, byStrategy);
  clearInterval(sampler);
  const m = await idle();
  const heap = metric(m, "specmesh_heap_allocated_bytes");
  const after = rssKiB();
  const mib = (kib) => (kib / 1024).toFixed(1);
  console.log(`soak: ${slices * warmupSeconds} s warm-up + ${soakSeconds} s, ${counts.completed} replies completed ` +
              `(${JSON.stringify(byStrategy)}), ${counts.left} clients left mid-stream, ${counts.mismatched} mismatched; ` +
              `heap ${mib(heap0 / 1024)} MiB allocated after the warm-up, ${mib(heap / 1024)} MiB after the soak; ` +
              `server RSS ${mib(baseline)} MiB after the warm-up, at most ${mib(Math.max(baseline, ...samples))} MiB ` +
              `during the soak, ${mib(after)} MiB after it`);
  assert.equal(metric(m, "specmesh_generations_in_flight"), 0, "generations still running after their clients");
  assert.equal(counts.mismatched, 0);
  assert.ok(counts.completed > 0 && counts.left > 0);
  // ... and the memory is back. The allocator's count is the exact one: what the soak left
  // allocated (256 KiB allowed: an allocator may count the free objects its per-thread caches
  // hold as allocated). The resident set also holds the pages an allocator keeps after a free, and
  // their number varies from run to run by a megabyte or two (the allocator returns them over
  // seconds, and never those of a slab still partly in use); 4 MiB bounds what else could grow
  // (threads, their stacks, mappings).
  assert.ok(heap0 !== null && heap !== null, "/metrics has no specmesh_heap_allocated_bytes");
  assert.ok(heap <= heap0 + 256 * 1024, `heap ${heap0} bytes allocated after the warm-up, ${heap} after the soak`);
  assert.ok(after <= baseline + 4096, `RSS ${baseline} KiB after the warm-up, ${after} KiB after the soak`);
});
