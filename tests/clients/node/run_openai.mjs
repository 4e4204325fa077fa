// The official OpenAI Node client, as an application uses it: streamed completions and chat at a set
// concurrency through a base URL. Run by tests/clients/test_clients.py as its own process.
//
//   node run_openai.mjs JOB_JSON   (JOB: base_url, model, max_tokens, concurrency, requests: [{kind, prompt}])
//
// Prints one JSON list: per request, in order, {"text", "finish_reason", "error"}.
import OpenAI from "openai";

const job = JSON.parse(process.argv[2]);
const client = new OpenAI({ baseURL: job.base_url + "/v1", apiKey: "none", maxRetries: 0, timeout: 120000 });

async function one(request) {
  const text = [];
  let finish = null;
  try {
    if (request.kind === "chat") {
      const stream = await client.chat.completions.create({
        model: job.model, messages: [{ role: "user", content: request.prompt }], max_tokens: job.max_tokens,
        temperature: 0, stream: true, ignore_eos: true,
      });
      for await (const chunk of stream) {
        for (const choice of chunk.choices) {
          text.push(choice.delta.content ?? "");
          finish = choice.finish_reason ?? finish;
        }
      }
    } else {
      const stream = await client.completions.create({
        model: job.model, prompt: request.prompt, max_tokens: job.max_tokens, temperature: 0, stream: true,
        ignore_eos: true,
      });
      for await (const chunk of stream) {
        for (const choice of chunk.choices) {
          text.push(choice.text);
          finish = choice.finish_reason ?? finish;
        }
      }
    }
  } catch (err) {
    return { text: text.join(""), finish_reason: finish, error: String(err) };
  }
  return { text: text.join(""), finish_reason: finish, error: null };
}

const results = new Array(job.requests.length);
let next = 0;
async function worker() {
  while (next < job.requests.length) {
    const i = next++;
    results[i] = await one(job.requests[i]);
  }
}
await Promise.all(Array.from({ length: job.concurrency }, worker));
process.stdout.write(JSON.stringify(results) + "\n");
