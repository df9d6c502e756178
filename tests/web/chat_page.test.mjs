// The chat page of `specmesh serve` in headless Chromium (Debian's), against the real server:
// type and send, watch the reply stream in, see its tokens/s, acceptance and strategy, stop a
// long reply with the Stop button (its generation ends on the server), keep the history over a
// reload. Leaves chat-page.png in the test's output directory.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import fs from "node:fs";
import path from "node:path";
import { chromium } from "playwright-core";

import { startServer, writeTopology, outputDir, metric } from "./harness.mjs";

const chromiumPath = process.env.SPECMESH_CHROMIUM || "/usr/bin/chromium";
let server;
let browser;
let page;

before(async () => {
  assert.ok(fs.existsSync(chromiumPath), `${chromiumPath} missing: scripts/deps.sh installs Debian's chromium`);
  // 3 ms per layer: about 65 tokens/s, slow enough to see a reply stream and stop it.
  server = await startServer([writeTopology("page", { layerMs: 3 })], { logName: "page-server" });
  browser = await chromium.launch({
    executablePath: chromiumPath,
    headless: true,
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync"],
  });
  page = await browser.newPage({ viewport: { width: 1000, height: 760 } });
  page.on("pageerror", (e) => console.error("page error:", e));
  await page.goto(server.base + "/");
  await page.waitForSelector("#health.ready");
});

after(async () => {
  if (browser) await browser.close();
  if (server) await server.stop();
});

// The text and stats of the newest assistant message, once it has stopped streaming.
async function lastReply() {
  await page.waitForFunction(
    () => {
      const el = [...document.querySelectorAll(".msg.assistant")].pop();
      return el && !el.classList.contains("streaming") && el.querySelector(".stats");
    },
    null,
    { timeout: 30000 },
  );
  return page.evaluate(() => {
    const all = document.querySelectorAll(".msg.assistant");
    const el = all[all.length - 1];
    return { text: el.querySelector(".bubble").textContent, stats: el.querySelector(".stats").textContent, count: all.length };
  });
}

test("a reply streams in and shows its speed, acceptance and strategy", async () => {
  await page.fill("#max-tokens", "40");
  await page.fill("#temperature", "0");
  await page.fill("#input", "Once upon a time");
  await page.press("#input", "Enter");
  // Streaming: the reply has text while it is still being written.
  await page.waitForFunction(() => {
    const el = document.querySelector(".msg.assistant.streaming .bubble");
    return el && el.textContent.length > 0;
  });
  const reply = await lastReply();
  assert.ok(reply.text.length > 20, reply.text);
  assert.match(reply.stats, /ar/);
  assert.match(reply.stats, /[\d.]+ tok\/s/);
  assert.match(reply.stats, /acceptance n\/a/);
});

test("a reply with the spec strategy shows its acceptance", async () => {
  await page.selectOption("#strategy", "spec");
  await page.fill("#input", "The little dog");
  await page.click("#send");
  const reply = await lastReply();
  assert.equal(reply.count, 2);
  assert.match(reply.stats, /spec/);
  assert.match(reply.stats, /acceptance \d+%/);
  await page.selectOption("#strategy", "");
});

test("Stop ends a long reply, on the page and on the server", async () => {
  await page.fill("#max-tokens", "2000");
  await page.fill("#input", "Tell me a long story");
  await page.click("#send");
  await page.waitForFunction(() => {
    const el = document.querySelector(".msg.assistant.streaming .bubble");
    return el && el.textContent.length > 40;
  });
  assert.equal(await page.isEnabled("#stop"), true);
  assert.equal(await page.isEnabled("#send"), false);
  await page.click("#stop");
  const reply = await lastReply();
  assert.match(reply.stats, /stopped/);
  assert.equal(await page.isEnabled("#send"), true);
  // The server saw the client go and cancelled the generation well before its 2000 tokens.
  let text = "";
  const deadline = Date.now() + 5000;
  while (Date.now() < deadline) {
    text = await (await fetch(server.base + "/metrics")).text();
    if (metric(text, 'specmesh_generations_total{strategy="ar",outcome="cancelled"}') === 1) break;
    await new Promise((r) => setTimeout(r, 50));
  }
  assert.equal(metric(text, 'specmesh_generations_total{strategy="ar",outcome="cancelled"}'), 1, text);
  assert.equal(metric(text, "specmesh_generations_in_flight"), 0, text);
  // Screenshot with the finished replies and the stopped one.
  const shot = path.join(outputDir, "chat-page.png");
  await page.screenshot({ path: shot, fullPage: false });
  console.log("screenshot: " + shot);
});

test("the history survives a reload, and New chat clears it", async () => {
  const before = await page.locator(".msg").count();
  assert.equal(before, 6);
  await page.reload();
  await page.waitForSelector("#health.ready");
  assert.equal(await page.locator(".msg").count(), before);
  await page.click("#reset");
  assert.equal(await page.locator(".msg").count(), 0);
});
