"""gradtape's HTTP service.

    main.py          create_app(): the FastAPI app, its lifespan (the worker pool), middleware
    cli.py           `gradtape serve` / `gradtape openapi`
    core/config.py   Settings (GRADTAPE_* environment variables), get_settings()
    schemas.py       request and response models
    tensors.py       wire tensors <-> NumPy arrays (JSON lists, base64, msgpack bytes)
    api/             routes (one module per resource), dependencies, payloads, errors
    workers.py       the worker pool: the only module that starts worker processes
    ipc.py           msgpack frames between the HTTP process and the workers
    compute.py       runs inside the workers: the only module that imports the engine
    metrics.py, middleware.py, docs.py

The HTTP process validates, queues and encodes; every derivative is computed in a
worker process. TRANSPORT.md explains the binary (msgpack) transport.
"""
