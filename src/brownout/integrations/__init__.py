"""Adapters between brownout and frameworks: the only place framework imports live.

- `brownout.integrations.asgi`: `BrownoutMiddleware` for Starlette, FastAPI and any ASGI app;
- `brownout.integrations.grpc_server`: `BrownoutServerInterceptor` for ``grpc.aio`` servers;
- `brownout.integrations.aiohttp_server`: `brownout_middleware` for aiohttp web servers.

Import the module you need; this package imports no framework itself.
"""
