"""The pytest plugin as a user sees it: a test file in a fresh session gets the fixtures, a
failed assertion reads well, and the entry point names the plugin module."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = "brownout.integrations.pytest_plugin"


def plugin_args() -> list[str]:
    """``-p`` the plugin unless brownout is installed with its entry point (a source run)."""
    eps = importlib.metadata.entry_points(group="pytest11")
    return [] if any(ep.value == PLUGIN for ep in eps) else ["-p", PLUGIN]


def doc_example() -> str:
    text = (ROOT / "docs" / "testing.md").read_text()
    match = re.search(
        r"## A pytest example.*?<!-- no-run -->\n```python\n(.*?)^```", text, re.S | re.M
    )
    assert match is not None
    return match.group(1)


@pytest.fixture(autouse=True)
def _user_ini(pytester: pytest.Pytester) -> None:
    # a user's project settles pytest-asyncio's loop scope; unset, it warns in every run
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")


def test_the_entry_point_names_the_plugin_module() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["entry-points"]["pytest11"] == {"brownout": PLUGIN}


def test_the_docs_example_passes_in_a_users_session(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_service=doc_example())
    result = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


def test_a_failed_assertion_lists_what_was_shed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_user="""
        import asyncio
        import brownout
        from brownout import Bulkhead, Priority, Reason
        from brownout.limits import FixedLimit

        def test_expects_a_timeout(brownout_events, brownout_force):
            db = Bulkhead("db", FixedLimit(2))
            brownout_force.full(db)
            async def call():
                async with db.admit():
                    pass
            with brownout.request(operation="/search", priority=Priority.SHEDDABLE):
                try:
                    asyncio.run(call())
                except brownout.Rejected:
                    pass
            brownout_events.assert_shed(reason=Reason.QUEUE_TIMEOUT, operation="/search")

        def test_after_teardown_nothing_is_forced_or_listening():
            assert brownout.events.hub.sinks == ()
        """
    )
    result = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*AssertionError: expected at least one shed with reason=QUEUE_TIMEOUT,"
            " operation='/search', found 0",
            "*recorded * events (1 sheds):",
            "*RequestShed(source='db', operation='/search', priority=SHEDDABLE,*reason=QUEUE_FULL*",
        ]
    )


def test_a_session_without_the_fixtures_is_unchanged(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_plain="""
        import brownout

        def test_plain():
            assert brownout.events.hub.sinks == ()
            assert not brownout.events.hub.enabled
        """
    )
    with_plugin = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider")
    with_plugin.assert_outcomes(passed=1)
    without = pytester.runpytest("-p", "no:brownout", "-p", "no:cacheprovider")
    without.assert_outcomes(passed=1)
    fixtures = pytester.runpytest(*plugin_args(), "--fixtures")
    fixtures.stdout.fnmatch_lines(
        ["*brownout_time*", "*brownout_clock*", "*brownout_events*", "*brownout_force*"]
    )
