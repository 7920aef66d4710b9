"""`ltm serve`: an HTTP inference server with continuous batching, streaming and an OpenAI-compatible API.

The engine (`engine.Engine`) keeps a fixed batch of decoding rows busy with independent requests; the device programs
it runs are in `slots`; `app` is the ASGI app (Starlette, run by uvicorn); `protocol` checks requests and shapes
answers; `metrics` holds the Prometheus metrics. Needs the `serve` extra (starlette, uvicorn, prometheus-client).
"""

from ltm_jax.serve.engine import Engine, Finished, Piece, QueueFull, Request, ShuttingDown, TokenLogprob
