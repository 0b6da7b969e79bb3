// Conformance checks of the official Node `openai` SDK against an OpenAI-compatible API.
//
// Configuration (environment):
//   DACP_BASE_URL      e.g. http://127.0.0.1:8000/v1
//   DACP_API_KEY       bearer key (a placeholder is sent when unset)
//   DACP_CHAT_MODEL    model for chat and legacy completions
//   DACP_EMBED_MODEL   model for embeddings
//   DACP_EMBED_DIM     embedding length (integer)
//   DACP_REFUSED       JSON array of {"endpoint": "chat"|"completions"|"embeddings",
//                      "body": {...}, "param": "name"}: each body is merged into a minimal
//                      valid request and must be refused with HTTP 400 naming `param`
//   DACP_ONLY          optional comma-separated check names to run
//
// Each check prints one JSON line {"check", "ok", "detail"} on stdout; the exit status is 0
// iff every check that ran passed. Diagnostics go to stderr.

import Ajv from "ajv";
import OpenAI from "openai";

const env = process.env;
const CHAT_MODEL = env.DACP_CHAT_MODEL ?? "";
const EMBED_MODEL = env.DACP_EMBED_MODEL ?? "";

const WEATHER_TOOLS = [
  {
    type: "function",
    function: {
      name: "get_weather",
      description: "Get the current weather in a city.",
      parameters: {
        type: "object",
        properties: { city: { type: "string", description: "The city name." } },
        required: ["city"],
      },
    },
  },
];
const WEATHER_QUESTION = { role: "user", content: "What is the weather in Paris?" };

const PERSON_SCHEMA = {
  type: "object",
  properties: { name: { type: "string" }, age: { type: "integer" } },
  required: ["name", "age"],
  additionalProperties: false,
};

const PAUSE_BETWEEN_CHECKS_MS = 100;

/** A failed expectation: its message becomes the check's `detail`. */
class CheckFailed extends Error {}

function expect(condition, message) {
  if (!condition) throw new CheckFailed(message);
}

/** A short, single-line rendering of a value for details. */
function show(value, limit = 240) {
  let text;
  try {
    text = typeof value === "string" ? JSON.stringify(value) : JSON.stringify(value) ?? String(value);
  } catch {
    text = String(value);
  }
  return text.length > limit ? `${text.slice(0, limit)}...` : text;
}

function isPlainObject(value) {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

function parseJson(text, what) {
  expect(typeof text === "string", `${what} is not a string: ${show(text)}`);
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new CheckFailed(`${what} is not JSON (${err.message}): ${show(text)}`);
  }
}

function makeClient() {
  return new OpenAI({
    baseURL: env.DACP_BASE_URL,
    apiKey: env.DACP_API_KEY || "no-key",
    maxRetries: 0,
    timeout: 120000,
  });
}

// --- the checks ------------------------------------------------------------------------

function checkToolCallShape(choice, where) {
  const message = choice?.message;
  const calls = message?.tool_calls;
  expect(
    Array.isArray(calls) && calls.length > 0,
    `${where}: no tool_calls (finish_reason=${show(choice?.finish_reason)}, content=${show(message?.content)})`,
  );
  expect(
    choice.finish_reason === "tool_calls",
    `${where}: finish_reason ${show(choice.finish_reason)}, expected "tool_calls"`,
  );
  const call = calls[0];
  expect(call.type === "function", `${where}: tool_calls[0].type ${show(call.type)}`);
  expect(
    call.function?.name === "get_weather",
    `${where}: tool_calls[0].function.name ${show(call.function?.name)}`,
  );
  const args = parseJson(call.function.arguments, `${where}: tool_calls[0].function.arguments`);
  expect(isPlainObject(args), `${where}: arguments are not a JSON object: ${show(args)}`);
  expect(typeof call.id === "string" && call.id.length > 0, `${where}: tool call id ${show(call.id)}`);
  return { message, call, args };
}

async function toolRoundTrip(client) {
  const first = await client.chat.completions.create({
    model: CHAT_MODEL,
    messages: [WEATHER_QUESTION],
    tools: WEATHER_TOOLS,
    tool_choice: "required",
    max_tokens: 200,
    temperature: 0,
  });
  const { message, call, args } = checkToolCallShape(first.choices?.[0], "first turn");
  const second = await client.chat.completions.create({
    model: CHAT_MODEL,
    messages: [
      WEATHER_QUESTION,
      message,
      { role: "tool", tool_call_id: call.id, content: "Sunny, 21 C" },
    ],
    tools: WEATHER_TOOLS,
    tool_choice: "none",
    max_tokens: 40,
    temperature: 0,
  });
  const choice = second.choices?.[0];
  expect(choice?.message?.role === "assistant", `second turn: role ${show(choice?.message?.role)}`);
  expect(
    typeof choice.message.content === "string",
    `second turn: content ${show(choice.message.content)} is not a string`,
  );
  expect(
    choice.finish_reason === "stop" || choice.finish_reason === "length",
    `second turn: finish_reason ${show(choice.finish_reason)}`,
  );
  expect(
    !(choice.message.tool_calls?.length > 0),
    `second turn: tool_choice "none" still produced tool_calls ${show(choice.message.tool_calls)}`,
  );
  return `get_weather(${show(args, 80)}) id=${call.id}; answer ${show(choice.message.content, 80)} (${choice.finish_reason})`;
}

async function jsonSchema(client) {
  const response = await client.chat.completions.create({
    model: CHAT_MODEL,
    messages: [{ role: "user", content: "Describe a person as JSON." }],
    response_format: {
      type: "json_schema",
      json_schema: { name: "person", strict: true, schema: PERSON_SCHEMA },
    },
    max_tokens: 100,
    temperature: 0,
  });
  const choice = response.choices?.[0];
  const value = parseJson(
    choice?.message?.content,
    `content (finish_reason=${show(choice?.finish_reason)})`,
  );
  const validate = new Ajv({ strict: true, allErrors: true }).compile(PERSON_SCHEMA);
  expect(
    validate(value),
    `content ${show(value)} does not match the schema: ${show(validate.errors)}`,
  );
  return show(value, 120);
}

async function jsonObject(client) {
  const response = await client.chat.completions.create({
    model: CHAT_MODEL,
    messages: [{ role: "user", content: "Give me a JSON object with a key named color." }],
    response_format: { type: "json_object" },
    max_tokens: 60,
    temperature: 0,
  });
  const choice = response.choices?.[0];
  const value = parseJson(
    choice?.message?.content,
    `content (finish_reason=${show(choice?.finish_reason)})`,
  );
  expect(isPlainObject(value), `content is JSON but not an object: ${show(value)}`);
  return show(value, 120);
}

function checkLogprobEntry(entry, where) {
  expect(isPlainObject(entry), `${where} is not an object: ${show(entry)}`);
  expect(typeof entry.token === "string", `${where}.token ${show(entry.token)}`);
  expect(
    typeof entry.logprob === "number" && Number.isFinite(entry.logprob) && entry.logprob <= 0,
    `${where}.logprob ${show(entry.logprob)} is not a number <= 0`,
  );
  expect(
    entry.bytes === null ||
      (Array.isArray(entry.bytes) && entry.bytes.every((b) => Number.isInteger(b))),
    `${where}.bytes ${show(entry.bytes)} is neither an array of integers nor null`,
  );
}

function checkLogprobContent(content, where, topN) {
  expect(Array.isArray(content) && content.length > 0, `${where} is ${show(content)}`);
  content.forEach((entry, i) => {
    checkLogprobEntry(entry, `${where}[${i}]`);
    const top = entry.top_logprobs;
    expect(
      Array.isArray(top) && top.length <= topN,
      `${where}[${i}].top_logprobs ${show(top)} is not an array of at most ${topN}`,
    );
    top.forEach((alt, j) => checkLogprobEntry(alt, `${where}[${i}].top_logprobs[${j}]`));
  });
}

async function logprobs(client) {
  const request = {
    model: CHAT_MODEL,
    messages: [{ role: "user", content: "Say hello." }],
    logprobs: true,
    top_logprobs: 2,
    max_tokens: 5,
    temperature: 0,
  };
  const response = await client.chat.completions.create(request);
  const content = response.choices?.[0]?.logprobs?.content;
  checkLogprobContent(content, "choices[0].logprobs.content", 2);

  const stream = await client.chat.completions.create({ ...request, stream: true });
  let chunks = 0;
  let withLogprobs = 0;
  let streamedTokens = 0;
  for await (const chunk of stream) {
    chunks += 1;
    const streamed = chunk.choices?.[0]?.logprobs?.content;
    if (Array.isArray(streamed) && streamed.length > 0) {
      checkLogprobContent(streamed, `stream chunk ${chunks} choices[0].logprobs.content`, 2);
      withLogprobs += 1;
      streamedTokens += streamed.length;
    }
  }
  expect(withLogprobs >= 1, `streamed: none of ${chunks} chunks carried logprobs.content`);
  return `${content.length} tokens; streamed ${streamedTokens} tokens in ${withLogprobs}/${chunks} chunks`;
}

async function streamToolCalls(client) {
  const stream = client.chat.completions.stream({
    model: CHAT_MODEL,
    messages: [WEATHER_QUESTION],
    tools: WEATHER_TOOLS,
    tool_choice: "required",
    max_tokens: 200,
    temperature: 0,
  });
  stream.on("error", () => {}); // surfaced by the iteration / finalChatCompletion below
  let chunks = 0;
  let toolChunks = 0;
  for await (const chunk of stream) {
    chunks += 1;
    if (chunk.choices?.[0]?.delta?.tool_calls != null) toolChunks += 1;
  }
  const final = await stream.finalChatCompletion();
  const choice = final.choices?.[0];
  expect(
    toolChunks >= 1,
    `none of ${chunks} chunks carried delta.tool_calls (final finish_reason=${show(choice?.finish_reason)}, content=${show(choice?.message?.content)})`,
  );
  const { args } = checkToolCallShape(choice, "finalChatCompletion");
  return `${toolChunks}/${chunks} chunks with delta.tool_calls; get_weather(${show(args, 80)})`;
}

/** Little-endian float32 values from a base64 string. */
function decodeBase64Floats(text) {
  const bytes = Buffer.from(text, "base64");
  expect(bytes.length % 4 === 0, `base64 embedding has ${bytes.length} bytes, not a multiple of 4`);
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const out = new Array(bytes.length / 4);
  for (let i = 0; i < out.length; i += 1) out[i] = view.getFloat32(i * 4, true);
  return out;
}

function maxAbsDiff(a, b) {
  let worst = 0;
  for (let i = 0; i < a.length; i += 1) worst = Math.max(worst, Math.abs(a[i] - b[i]));
  return worst;
}

function sameVector(a, b, tolerance = 0) {
  return a.length === b.length && maxAbsDiff(a, b) <= tolerance;
}

async function embeddings(client) {
  const dim = Number(env.DACP_EMBED_DIM);
  expect(Number.isInteger(dim) && dim > 0, `DACP_EMBED_DIM ${show(env.DACP_EMBED_DIM)} is not a positive integer`);
  const inputs = ["the cat sat", "the cat sat", "a completely different sentence"];

  // No encoding_format: the SDK asks for base64 on the wire and decodes it itself.
  const response = await client.embeddings.create({ model: EMBED_MODEL, input: inputs });
  const data = response.data;
  expect(Array.isArray(data) && data.length === 3, `data has ${show(data?.length)} items, expected 3`);
  data.forEach((item, i) => {
    expect(item.index === i, `data[${i}].index is ${show(item.index)}`);
    const length = item.embedding?.length;
    expect(
      Array.isArray(item.embedding) && length === dim,
      `data[${i}].embedding has length ${show(length)}, expected ${dim}` +
        // The SDK decodes a float array it did not expect as base64: a quarter of the length.
        (length === Math.floor(dim / 4) ? " (the server ignored encoding_format=base64?)" : ""),
    );
    expect(
      item.embedding.every((x) => Number.isFinite(x)),
      `data[${i}].embedding has non-finite values`,
    );
  });
  expect(sameVector(data[0].embedding, data[1].embedding), "the two identical inputs differ");
  expect(
    !sameVector(data[0].embedding, data[2].embedding),
    "a different input gave the same embedding",
  );
  expect(
    typeof response.usage?.prompt_tokens === "number" && response.usage.prompt_tokens > 0,
    `usage.prompt_tokens ${show(response.usage?.prompt_tokens)}`,
  );

  // Explicit float and explicit base64 for one input: the SDK returns both as sent.
  const floats = await client.embeddings.create({
    model: EMBED_MODEL,
    input: inputs[0],
    encoding_format: "float",
  });
  const floatVector = floats.data?.[0]?.embedding;
  expect(
    Array.isArray(floatVector) && floatVector.length === dim,
    `encoding_format=float: embedding ${show(floatVector, 80)} is not ${dim} numbers`,
  );
  const encoded = await client.embeddings.create({
    model: EMBED_MODEL,
    input: inputs[0],
    encoding_format: "base64",
  });
  const text = encoded.data?.[0]?.embedding;
  expect(typeof text === "string", `encoding_format=base64: embedding ${show(text, 80)} is not a string`);
  const decoded = decodeBase64Floats(text);
  expect(decoded.length === dim, `base64 embedding decodes to ${decoded.length} floats, expected ${dim}`);
  const diff = maxAbsDiff(decoded, floatVector);
  expect(diff <= 1e-6, `base64 and float embeddings differ by up to ${diff}`);
  const batchDiff = maxAbsDiff(data[0].embedding, floatVector);
  expect(
    batchDiff <= 1e-6,
    `the batched embedding of ${show(inputs[0])} differs from the single one by up to ${batchDiff}`,
  );
  return `3 x ${dim}, prompt_tokens=${response.usage.prompt_tokens}; base64 == float (max diff ${diff})`;
}

async function completions(client) {
  const request = { model: CHAT_MODEL, prompt: "Once upon a time", max_tokens: 8, temperature: 0 };
  const response = await client.completions.create(request);
  expect(response.object === "text_completion", `object ${show(response.object)}`);
  const text = response.choices?.[0]?.text;
  expect(typeof text === "string" && text.length > 0, `choices[0].text ${show(text)}`);
  expect(
    typeof response.usage?.completion_tokens === "number" && response.usage.completion_tokens > 0,
    `usage.completion_tokens ${show(response.usage?.completion_tokens)}`,
  );

  const stream = await client.completions.create({ ...request, stream: true });
  let streamed = "";
  let chunks = 0;
  let finish = null;
  for await (const chunk of stream) {
    chunks += 1;
    const choice = chunk.choices?.[0];
    if (typeof choice?.text === "string") streamed += choice.text;
    if (choice?.finish_reason != null) finish = choice.finish_reason;
  }
  expect(streamed.length > 0, `streamed: ${chunks} chunks with no text`);
  expect(finish === "length" || finish === "stop", `streamed: final finish_reason ${show(finish)}`);
  return `${show(text, 80)}; streamed ${chunks} chunks ${show(streamed, 80)} (${finish})`;
}

const MINIMAL = {
  chat: () => ({ model: CHAT_MODEL, messages: [{ role: "user", content: "Hi" }], max_tokens: 1 }),
  completions: () => ({ model: CHAT_MODEL, prompt: "Hi", max_tokens: 1 }),
  embeddings: () => ({ model: EMBED_MODEL, input: "hi" }),
};

function send(client, endpoint, body) {
  if (endpoint === "chat") return client.chat.completions.create(body);
  if (endpoint === "completions") return client.completions.create(body);
  return client.embeddings.create(body);
}

async function refused(client) {
  let entries;
  try {
    entries = JSON.parse(env.DACP_REFUSED || "[]");
  } catch (err) {
    throw new CheckFailed(`DACP_REFUSED is not JSON: ${err.message}`);
  }
  expect(Array.isArray(entries), "DACP_REFUSED is not a JSON array");
  const failures = [];
  for (const [i, entry] of entries.entries()) {
    const label = `#${i} ${entry?.endpoint}:${show(entry?.body, 80)}`;
    if (!isPlainObject(entry) || !(entry.endpoint in MINIMAL) || !isPlainObject(entry.body ?? {})) {
      failures.push(`${label}: malformed entry`);
      continue;
    }
    const body = { ...MINIMAL[entry.endpoint](), ...(entry.body ?? {}) };
    try {
      const result = await send(client, entry.endpoint, body);
      result?.controller?.abort?.(); // an accepted stream: do not leave it running
      failures.push(`${label}: accepted (expected 400 on ${show(entry.param)})`);
    } catch (err) {
      if (!(err instanceof OpenAI.BadRequestError)) {
        failures.push(`${label}: ${err?.constructor?.name} ${err?.status ?? ""} ${show(err?.message, 160)}`);
      } else if (err.param !== entry.param) {
        failures.push(`${label}: 400 with param ${show(err.param)}, expected ${show(entry.param)} (${show(err.message, 160)})`);
      }
    }
  }
  expect(failures.length === 0, `${failures.length}/${entries.length} not refused as expected: ${failures.join("; ")}`);
  return entries.length === 0
    ? "nothing to check: DACP_REFUSED is empty"
    : `${entries.length} refused with the expected param`;
}

const CHECKS = {
  tool_round_trip: toolRoundTrip,
  json_schema: jsonSchema,
  json_object: jsonObject,
  logprobs,
  stream_tool_calls: streamToolCalls,
  embeddings,
  completions,
  refused,
};

// --- running -------------------------------------------------------------------------

/** The chain of causes of a transport error (fetch wraps the socket's error). */
function describeCause(cause, depth = 0) {
  const text = `${cause?.constructor?.name ?? "error"}(${cause?.code ?? ""}): ${cause?.message ?? String(cause)}`;
  return cause?.cause && depth < 3 ? `${text} <- ${describeCause(cause.cause, depth + 1)}` : text;
}

function describeError(err) {
  if (err instanceof CheckFailed) return err.message;
  if (err instanceof OpenAI.APIError) {
    const body = err.error === undefined ? "" : ` body=${show(err.error, 400)}`;
    const cause = err.cause ? ` cause=${describeCause(err.cause)}` : "";
    return `${err.constructor.name} status=${err.status ?? "none"}: ${show(err.message, 400)}${body}${cause}`;
  }
  return `${err?.constructor?.name ?? "error"}: ${err?.message ?? String(err)}`;
}

function report(check, ok, detail) {
  process.stdout.write(`${JSON.stringify({ check, ok, detail })}\n`);
}

async function main() {
  const only = (env.DACP_ONLY ?? "")
    .split(",")
    .map((name) => name.trim())
    .filter(Boolean);
  const names = only.length > 0 ? only : Object.keys(CHECKS);
  let client = null;
  let clientError = "";
  try {
    expect(env.DACP_BASE_URL, "DACP_BASE_URL is not set");
    client = makeClient();
  } catch (err) {
    clientError = `cannot create the client: ${describeError(err)}`;
  }
  let allOk = true;
  for (const [position, name] of names.entries()) {
    // A bare llama-server closes the connection right after every streamed response though
    // it answered "Keep-Alive"; a request sent at once may pick that socket from the pool and
    // fail with "other side closed". Every stream here is the last request of its check, so
    // a short pause between checks lets the client see the close first.
    if (position > 0) await new Promise((resolve) => setTimeout(resolve, PAUSE_BETWEEN_CHECKS_MS));
    let ok = false;
    let detail;
    if (!(name in CHECKS)) {
      detail = `unknown check (known: ${Object.keys(CHECKS).join(", ")})`;
    } else if (client === null) {
      detail = clientError;
    } else {
      const started = Date.now();
      try {
        detail = await CHECKS[name](client);
        ok = true;
      } catch (err) {
        detail = describeError(err);
      }
      process.stderr.write(`conformance: ${name} ${ok ? "ok" : "FAILED"} in ${Date.now() - started} ms\n`);
    }
    allOk &&= ok;
    report(name, ok, String(detail ?? ""));
  }
  return allOk ? 0 : 1;
}

process.on("unhandledRejection", (reason) => {
  process.stderr.write(`conformance: unhandled rejection: ${describeError(reason)}\n`);
});

main().then(
  (code) => process.exit(code),
  (err) => {
    process.stderr.write(`conformance: internal error: ${err?.stack ?? err}\n`);
    process.exit(2);
  },
);
