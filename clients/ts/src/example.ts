// Calling gradtape from TypeScript: the types come from openapi/openapi.json
// (`npm run generate`, openapi-typescript), the calls go through openapi-fetch, and tsc
// checks every request body and answer against the contract.
//
//     npm ci && npm run build && node dist/example.js http://localhost:8000
//
// Prints a JSON summary of what the server answered; exits non-zero on a wrong answer.

import createClient from "openapi-fetch";

import type { components, paths } from "./schema.js";

type Tensor = components["schemas"]["Tensor"];
type Problem = components["schemas"]["Problem"];

const baseUrl = process.argv[2] ?? process.env.GRADTAPE_URL ?? "http://localhost:8000";
const client = createClient<paths>({ baseUrl });

/** The elements of a tensor answered as a JSON list (the default for JSON requests). */
function values(tensor: Tensor | null | undefined): number[] {
  if (!tensor || !("data" in tensor)) {
    throw new Error(`expected a tensor with data, got ${JSON.stringify(tensor)}`);
  }
  const flat = (items: unknown[]): number[] =>
    items.flatMap((item) => (Array.isArray(item) ? flat(item) : [Number(item)]));
  return flat(tensor.data);
}

function expectEqual(what: string, got: unknown, want: unknown): void {
  if (JSON.stringify(got) !== JSON.stringify(want)) {
    throw new Error(`${what}: got ${JSON.stringify(got)}, want ${JSON.stringify(want)}`);
  }
}

async function main(): Promise<void> {
  // SCENARIOS.md 15: s = w1*x1 + w2*x2 at w = (2, 3), x = (5, 7).
  const gradient = await client.POST("/v1/gradient", {
    body: {
      definition: {
        variables: { w1: { value: 2.0 }, w2: { value: 3.0, trainable: true } },
        inputs: { x1: 5.0, x2: 7.0 },
        program: ["s = w1 * x1 + w2 * x2"],
      },
      target: "s",
      sources: ["w1", "w2"],
    },
  });
  if (gradient.error) throw new Error(`gradient: ${gradient.error.detail}`);
  expectEqual("value", values(gradient.data.value), [31]);
  expectEqual("dw1", values(gradient.data.gradients["w1"]), [5]);
  expectEqual("dw2", values(gradient.data.gradients["w2"]), [7]);

  // The jacobian of y = w * w: diag(2w).
  const jacobian = await client.POST("/v1/jacobian", {
    body: {
      definition: { variables: { w: [1.0, 2.0] }, program: ["y = w * w"] },
      target: "y",
    },
  });
  if (jacobian.error) throw new Error(`jacobian: ${jacobian.error.detail}`);
  // The success type also holds the 202 of a job ("async": true): narrow to the answer.
  if (!("jacobians" in jacobian.data)) throw new Error("jacobian: a job was started");
  const dy = jacobian.data.jacobians["w"];
  expectEqual("jacobian", values(dy), [2, 0, 0, 4]);
  expectEqual("jacobian shape", dy && "shape" in dy ? dy.shape : null, [2, 2]);

  // A tape of loss = sum(w**3) at w = (1, 2): recorded once, then HVPs with
  // H = diag(6w) = diag(6, 12), one vector and then two in one pass.
  const tape = await client.POST("/v1/tapes", {
    body: {
      definition: { variables: { w: [1.0, 2.0] }, program: ["loss = sum(w * w * w)"] },
      target: "loss",
    },
  });
  if (tape.error) throw new Error(`tape: ${tape.error.detail}`);
  const path = { params: { path: { tape_id: tape.data.tape_id } } };
  const one = await client.POST("/v1/tapes/{tape_id}/hvp", {
    ...path,
    body: { vector: { w: [1.0, 0.0] } },
  });
  const two = await client.POST("/v1/tapes/{tape_id}/hvp", {
    ...path,
    body: { vectors: [{ w: [0.0, 1.0] }, { w: [1.0, 1.0] }] },
  });
  if (one.error || two.error) throw new Error("hvp failed");
  expectEqual("hvp", values(one.data.hvp?.["w"]), [6, 0]);
  const hvps = (two.data.hvps ?? []).map((h) => values(h["w"]));
  expectEqual("hvps", hvps, [[0, 12], [6, 12]]);
  const deleted = await client.DELETE("/v1/tapes/{tape_id}", path);
  expectEqual("delete", deleted.response.status, 204);
  const gone = await client.POST("/v1/tapes/{tape_id}/hvp", {
    ...path,
    body: { vector: { w: [1.0, 0.0] } },
  });
  expectEqual("after delete", gone.response.status, 404);

  // An error: a name the program never defines. The answer is a problem+json document.
  const failed = await client.POST("/v1/gradient", {
    body: {
      definition: { variables: { w: [1.0, 2.0] }, program: ["loss = sum(w * q)"] },
      target: "loss",
    },
  });
  const problem: Problem | undefined = failed.error;
  if (!problem) throw new Error("an undefined name was accepted");
  expectEqual("error status", failed.response.status, 422);
  expectEqual("error type", failed.response.headers.get("content-type"), "application/problem+json");

  console.log(
    JSON.stringify({
      gradient: { value: values(gradient.data.value), w1: values(gradient.data.gradients["w1"]) },
      jacobian: values(dy),
      tape: {
        gradient: values(tape.data.gradients["w"]),
        hvp: values(one.data.hvp?.["w"]),
        hvps,
        after_delete: gone.error?.type,
      },
      error: { status: problem.status, title: problem.title, detail: problem.detail },
    }),
  );
}

main().catch((err: unknown) => {
  console.error(err instanceof Error ? err.message : err);
  process.exit(1);
});
