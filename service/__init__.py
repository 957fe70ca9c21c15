"""gradtape's HTTP service, laid out by the process each part runs in (ARCHITECTURE.md):

    core/     what both processes share: config (GRADTAPE_* settings), errors (the domain
              error), wire (arrays <-> bytes, dtypes), ipc (worker frames), store (SQLite),
              flat (flat vectors <-> named arrays)
    worker/   the engine worker process: main (its loop), dispatch (a message to its
              handler), compute and tapes (the engine calls), datasets (hot arrays),
              nonfinite; the only package that imports engine
    pool/     the HTTP process's side of the workers: the Pool protocol (base), its
              backends (local: processes of this host; ray: Ray actors), calls (who
              waits for a computation)
    domain/   what the HTTP process remembers and decides: tapes and models (sessions),
              datasets, jobs, metrics, requests (what a route hands the pool)
    api/      the HTTP layer: the app, routes, schemas, bodies, negotiation, problems
    cli.py    `gradtape serve` / `gradtape openapi`

Imports run downward only (core < worker; core < pool < domain < api < cli), and the
HTTP process never loads the engine: tests/test_architecture.py checks both.
TRANSPORT.md explains the binary (msgpack) transport.
"""
