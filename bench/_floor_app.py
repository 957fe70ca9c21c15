"""The floor for bench_service.py and bench_request.py: the least a FastAPI app can do per
request."""

import msgpack
from fastapi import FastAPI, Request
from fastapi.responses import Response

app = FastAPI()

SMALL_ANSWER = {"value": {"dtype": "float32", "shape": [], "data": [31.0]}}
SMALL_ANSWER_MSGPACK = msgpack.packb(SMALL_ANSWER)


@app.get("/ping")
async def ping() -> dict:
    return {}


@app.post("/trivial", response_model=None)
async def trivial(request: Request) -> Response | dict:
    # parse the same body the compared endpoint gets, answer in its format
    if request.headers.get("content-type") == "application/msgpack":
        msgpack.unpackb(await request.body())
        return Response(SMALL_ANSWER_MSGPACK, media_type="application/msgpack")
    await request.json()
    return SMALL_ANSWER


@app.post("/echo")
async def echo(request: Request) -> Response:
    return Response(await request.body(), media_type="application/octet-stream")
