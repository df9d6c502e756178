// The official `openai` npm client against `specmesh serve` on stories260K: completions and
// chat completions, streamed and whole, give at temperature 0 the tokens `specmesh generate`
// gives; its typed errors come from the server's statuses.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import OpenAI from "openai";

import { startServer, generate, stories, draft } from "./harness.mjs";

const prompt = "Once upon a time";
const n = 48;
let server;
let client;
let want;

before(async () => {
  server = await startServer(["-m", stories, "-d", draft, "--strategy", "ar", "--api-key", "test-key"], { logName: "openai-server" });
  client = new OpenAI({ baseURL: server.base + "/v1", apiKey: "test-key", maxRetries: 0 });
  want = generate(prompt, n);
});

after(async () => {
  if (server) assert.equal(await server.stop(), 0, "specmesh serve did not stop cleanly on SIGTERM");
});

test("models lists the served model", async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), ["stories260K"]);
});

test("a completion equals specmesh generate, ids included", async () => {
  const r = await client.completions.create({ model: "stories260K", prompt, max_tokens: n, temperature: 0 });
  assert.equal(r.choices[0].text, want.text);
  assert.deepEqual(r.specmesh.ids, want.ids);
  assert.equal(r.usage.prompt_tokens, want.prompt_ids.length);
  assert.equal(r.usage.completion_tokens, want.ids.length);
});

test("a streamed completion equals specmesh generate", async () => {
  const stream = await client.completions.create({ model: "stories260K", prompt, max_tokens: n, temperature: 0, stream: true });
  let text = "";
  let chunks = 0;
  let last;
  for await (const chunk of stream) {
    text += chunk.choices[0]?.text ?? "";
    chunks++;
    last = chunk;
  }
  assert.equal(text, want.text);
  assert.ok(chunks >= want.ids.length / 2, `${chunks} chunks for ${want.ids.length} tokens: not streamed token by token`);
  assert.equal(last.usage.completion_tokens, want.ids.length);
  assert.equal(last.specmesh.strategy, "ar");
});

test("a chat completion, whole and streamed, equals specmesh generate", async () => {
  // stories260K has no chat template: its messages are continued as a story, so one user
  // message is the prompt as generate takes it.
  const messages = [{ role: "user", content: prompt }];
  const whole = await client.chat.completions.create({ model: "stories260K", messages, max_tokens: n, temperature: 0 });
  assert.equal(whole.choices[0].message.role, "assistant");
  assert.equal(whole.choices[0].message.content, want.text);
  assert.deepEqual(whole.specmesh.ids, want.ids);

  const stream = await client.chat.completions.create({
    model: "stories260K", messages, max_tokens: n, temperature: 0, stream: true, stream_options: { include_usage: true },
  });
  let text = "";
  let usage;
  for await (const chunk of stream) {
    text += chunk.choices[0]?.delta?.content ?? "";
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(text, want.text);
  assert.equal(usage.completion_tokens, want.ids.length);
});

test("the per-request strategy spec is lossless", async () => {
  const r = await client.completions.create({
    model: "stories260K", prompt, max_tokens: n, temperature: 0, specmesh: { strategy: "spec", params: { n_draft: 4 } },
  });
  assert.deepEqual(r.specmesh.ids, want.ids);
  assert.equal(r.specmesh.strategy, "spec");
  assert.ok(r.specmesh.acceptance > 0, "spec drafted nothing that was accepted");
});

test("seeded sampling repeats", async () => {
  const ask = () => client.completions.create({ prompt, max_tokens: 24, temperature: 0.9, top_p: 0.9, top_k: 40, min_p: 0.02, seed: 7 });
  const [a, b] = [await ask(), await ask()];
  assert.deepEqual(a.specmesh.ids, b.specmesh.ids);
});

test("errors arrive as the client's typed errors", async () => {
  await assert.rejects(client.completions.create({ prompt, n: 2 }), (e) => e instanceof OpenAI.BadRequestError && e.param === "n");
  await assert.rejects(client.completions.create({ model: "gpt-4", prompt }), OpenAI.NotFoundError);
  const stranger = new OpenAI({ baseURL: server.base + "/v1", apiKey: "wrong", maxRetries: 0 });
  await assert.rejects(stranger.completions.create({ prompt }), OpenAI.AuthenticationError);
  await assert.rejects(
    client.completions.create({ prompt: "Once upon a time ".repeat(2000) }),
    (e) => e instanceof OpenAI.APIError && e.status === 413 && e.code === "context_length_exceeded",
  );
});
