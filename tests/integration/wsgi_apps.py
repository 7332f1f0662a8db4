"""A Flask service and a Django site behind brownout's edge, for real servers (gunicorn,
uvicorn) and the frameworks' own test clients.

Flask: ``tests.integration.wsgi_apps:flask_app``. Django: ``DJANGO_SETTINGS_MODULE`` set to
this module, ``tests.integration.wsgi_apps:django_wsgi`` / ``:django_asgi``. Bulkheads hold
one request (``/hold`` keeps it a while); ``/slow`` outlives its 0.2 s deadline."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from flask import Flask

from brownout import Bulkhead, EdgePolicy, Route, ThreadBulkhead, Trust
from brownout.integrations.flask import protect
from brownout.limits import FixedLimit

DEADLINE = 0.2
SLOW = 0.8
HOLD = 1.5
ROUTES = {"/slow": Route(default=DEADLINE), "/slow/": Route(default=DEADLINE)}


def trust(request: object) -> Trust:
    """Trusted only when authenticated: Django's user (after AuthenticationMiddleware), or
    what a WSGI authentication layer put in ``REMOTE_USER``."""
    user = getattr(request, "user", None)
    if user is not None:
        return Trust.TRUSTED if user.is_authenticated else Trust.UNTRUSTED
    environ = request if isinstance(request, dict) else {}
    return Trust.TRUSTED if environ.get("REMOTE_USER") else Trust.UNTRUSTED


# -- Flask -------------------------------------------------------------------------------
flask_app = Flask(__name__)


@flask_app.get("/items/<int:item_id>")
def flask_item(item_id: int) -> dict[str, int]:
    return {"id": item_id}


@flask_app.get("/slow")
def flask_slow() -> str:
    time.sleep(SLOW)
    return "late"


@flask_app.get("/hold")
def flask_hold() -> str:
    time.sleep(HOLD)
    return "held"


@flask_app.get("/health")
def flask_health() -> str:
    return "ok"


protect(
    flask_app,
    EdgePolicy(bulkhead=ThreadBulkhead("flask", FixedLimit(1), reserve=0), routes=ROUTES),
)


class _User:
    def __init__(self, authenticated: bool) -> None:
        self.is_authenticated = authenticated


class TokenAuthentication:
    """Authentication before the edge: ``request.user`` from an ``Authorization: Bearer mesh``
    header (sync and async capable, like Django's own)."""

    sync_capable = async_capable = True

    def __init__(self, get_response: Any) -> None:
        from asgiref.sync import iscoroutinefunction, markcoroutinefunction

        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: Any) -> Any:
        token = request.META.get("HTTP_AUTHORIZATION", "")
        request.user = _User(token == "Bearer mesh")
        return self.get_response(request)


# -- Django ------------------------------------------------------------------------------
SECRET_KEY = "tests-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
ROOT_URLCONF = __name__
INSTALLED_APPS: list[str] = []
DATABASES: dict[str, object] = {}
MIDDLEWARE = [
    f"{__name__}.TokenAuthentication",  # stands for AuthenticationMiddleware: no database
    "brownout.integrations.django.BrownoutMiddleware",
]
BROWNOUT_POLICY = f"{__name__}.DJANGO_POLICY"
USE_TZ = True
_ASGI = os.environ.get("BROWNOUT_DJANGO_MODE") == "asgi"
DJANGO_POLICY = EdgePolicy(
    bulkhead=(Bulkhead if _ASGI else ThreadBulkhead)("django", FixedLimit(1), reserve=0),
    routes=ROUTES,
    trust=trust,
    health_paths=("/health/",),
)

urlpatterns: list[object] = []
if os.environ.get("DJANGO_SETTINGS_MODULE") == __name__:
    from django.http import HttpRequest, HttpResponse, JsonResponse
    from django.urls import path

    def django_item(request: HttpRequest, item_id: int) -> JsonResponse:
        return JsonResponse({"id": item_id})

    def django_slow(request: HttpRequest) -> HttpResponse:
        time.sleep(SLOW)
        return HttpResponse("late")

    async def django_slow_async(request: HttpRequest) -> HttpResponse:
        await asyncio.sleep(SLOW)
        return HttpResponse("late")

    def django_hold(request: HttpRequest) -> HttpResponse:
        time.sleep(HOLD)
        return HttpResponse("held")

    def django_health(request: HttpRequest) -> HttpResponse:
        return HttpResponse("ok")

    urlpatterns = [
        path("items/<int:item_id>/", django_item),
        path("slow/", django_slow_async if _ASGI else django_slow),
        path("hold/", django_hold),
        path("health/", django_health),
    ]

    def __getattr__(name: str) -> object:  # the apps, built on first use
        if name == "django_wsgi":
            from django.core.wsgi import get_wsgi_application

            return get_wsgi_application()
        if name == "django_asgi":
            from django.core.asgi import get_asgi_application

            return get_asgi_application()
        raise AttributeError(name)
