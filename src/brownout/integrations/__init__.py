"""Adapters between brownout and frameworks: the only place framework imports live.

Inbound (the edge, `brownout._edge`):

- `brownout.integrations.asgi`: `BrownoutMiddleware` for Starlette, FastAPI and any ASGI app;
- `brownout.integrations.grpc_server`: `BrownoutServerInterceptor` for ``grpc.aio`` servers;
- `brownout.integrations.aiohttp_server`: `brownout_middleware` for aiohttp web servers.

Outbound clients live next to them (``httpx``, ``aiohttp_client``, ``grpc_client``);
`brownout.integrations.lifespan` starts and stops background work with the server;
`brownout.integrations.redis_streams` runs durable queues on Redis Streams.
Import the module you need; this package imports no framework itself.
"""
