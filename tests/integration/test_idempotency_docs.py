"""The Redis and PostgreSQL examples of docs/idempotency.md (shown, not run by test_docs.py)
run here against the real servers, with the page's other blocks before them as in the page."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from tests import services

pytestmark = pytest.mark.integration

PAGE = Path(__file__).resolve().parents[2] / "docs" / "idempotency.md"
BLOCK = re.compile(r"^(?:<!-- no-run -->\n)?```python[^\n]*\n(.*?)^```", re.S | re.M)

CHECK = """
from brownout.idempotency import Ticket


async def _check() -> None:
    key = '"doc-{tag}"'
    first = await idempotency.begin(
        method="POST", target="/payments", operation="/payments", key=key, body=b"{{}}",
        caller="doc",
    )
    assert isinstance(first, Ticket), first
    await first.complete(201, [], b"ok")
    again = await idempotency.begin(
        method="POST", target="/payments", operation="/payments", key=key, body=b"{{}}",
        caller="doc",
    )
    assert again.replayed and again.body == b"ok", again
    await client.aclose()

    layer = await build()
    pool = layer.store._pool
    await pool.execute("CREATE TABLE {effects} (amount int)")
    try:
        app = Starlette(routes=[StarletteRoute("/payments", pay, methods=["POST"])])
        app.add_middleware(IdempotencyMiddleware, idempotency=layer)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://svc") as http:
            headers = {{"Idempotency-Key": '"pay-{tag}"'}}
            answers = await asyncio.gather(
                *(http.post("/payments", json={{"amount": 7}}, headers=headers) for _ in range(4))
            )
            assert sorted(a.status_code for a in answers).count(201) >= 1, answers
            for _ in range(3):
                r = await http.post("/payments", json={{"amount": 7}}, headers=headers)
                assert r.status_code == 201 and r.headers["idempotent-replayed"] == "true"
        assert await pool.fetchval("SELECT count(*) FROM {effects}") == 1
    finally:
        await pool.execute("DROP TABLE IF EXISTS {effects}, {table}")
        await pool.close()


asyncio.run(_check())
print("doc examples ok")
"""


def test_redis_and_postgres_examples_run(
    redis_server: services.Service, postgres_server: services.Service
) -> None:
    tag = uuid.uuid4().hex[:8]
    table, effects = f"idem_doc_{tag}", f"payments_doc_{tag}"
    script = "\n".join(BLOCK.findall(PAGE.read_text()))
    assert "RedisIdempotencyStore(client" in script and "transaction().execute" in script
    script = (
        script.replace(
            'host="127.0.0.1", port=6379', f"host={redis_server.host!r}, port={redis_server.port}"
        )
        .replace("postgres@127.0.0.1/test", f"postgres@{postgres_server.address}/test")
        .replace('table="brownout_idempotency"', f"table={table!r}")
        .replace("INSERT INTO payments ", f"INSERT INTO {effects} ")
    )
    script += CHECK.format(tag=tag, table=table, effects=effects)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=90
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "doc examples ok" in result.stdout
