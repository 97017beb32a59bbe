// client_test.mjs - the official `openai` npm client against a running
// `ember serve` (EMBER_URL, e.g. http://127.0.0.1:8080/v1): chat without
// streaming, chat streaming with usage, completions, and an error case.
// Exits non-zero with a message on the first mismatch.
import OpenAI from "openai";
import assert from "node:assert/strict";

const baseURL = process.env.EMBER_URL;
if (!baseURL) {
  console.error("EMBER_URL is not set");
  process.exit(2);
}
const client = new OpenAI({ baseURL, apiKey: process.env.EMBER_API_KEY || "none", maxRetries: 0 });
const model = (await client.models.list()).data[0].id;
const messages = [
  { role: "system", content: "You are a test." },
  { role: "user", content: "Say something short." },
];

// 1. chat, not streaming
const chat = await client.chat.completions.create({ model, messages, max_tokens: 8, temperature: 0 });
assert.equal(chat.object, "chat.completion");
assert.equal(chat.choices[0].message.role, "assistant");
assert.equal(typeof chat.choices[0].message.content, "string");
assert.ok(["stop", "length"].includes(chat.choices[0].finish_reason));
assert.ok(chat.usage.prompt_tokens > 0);
assert.equal(typeof chat.usage.prompt_tokens_details.cached_tokens, "number");

// 2. chat, streaming with usage: same greedy text, the cache serves N-1
const stream = await client.chat.completions.create({
  model, messages, max_tokens: 8, temperature: 0, stream: true, stream_options: { include_usage: true },
});
let text = "", finish = null, usage = null, chunks = 0;
for await (const chunk of stream) {
  chunks++;
  assert.equal(chunk.object, "chat.completion.chunk");
  if (chunk.choices.length > 0) {
    text += chunk.choices[0].delta.content ?? "";
    finish = chunk.choices[0].finish_reason ?? finish;
  }
  if (chunk.usage) usage = chunk.usage;
}
assert.ok(chunks >= 3);
assert.equal(text, chat.choices[0].message.content);
assert.equal(finish, chat.choices[0].finish_reason);
assert.equal(usage.completion_tokens, chat.usage.completion_tokens);
assert.equal(usage.prompt_tokens_details.cached_tokens, chat.usage.prompt_tokens - 1);

// 3. completions
const cmpl = await client.completions.create({ model, prompt: "Once upon a time", max_tokens: 5, temperature: 0 });
assert.equal(cmpl.object, "text_completion");
assert.equal(typeof cmpl.choices[0].text, "string");
assert.ok(cmpl.usage.completion_tokens >= 1);

// 4. an error: empty messages -> 400 with the OpenAI error shape
try {
  await client.chat.completions.create({ model, messages: [] });
  assert.fail("empty messages were accepted");
} catch (err) {
  assert.ok(err instanceof OpenAI.BadRequestError, `expected BadRequestError, got ${err}`);
  assert.equal(err.status, 400);
  assert.equal(err.code, "empty_array");
  assert.equal(err.param, "messages");
}
console.log("openai client test: ok (chat, stream with usage, completions, error)");
