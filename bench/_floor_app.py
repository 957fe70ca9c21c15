"""The floor for bench_service.py: the least a FastAPI app can do per request."""

from fastapi import FastAPI, Request
from fastapi.responses import Response

app = FastAPI()


@app.get("/ping")
async def ping() -> dict:
    return {}


@app.post("/trivial")
async def trivial(request: Request) -> dict:
    await request.json()  # parse the same small body the gradient endpoint gets
    return {"value": {"dtype": "float32", "shape": [], "data": [31.0]}}


@app.post("/echo")
async def echo(request: Request) -> Response:
    return Response(await request.body(), media_type="application/octet-stream")
