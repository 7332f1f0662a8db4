"""The ``brownout`` command's conventions: ``--version``, help in plain words with every
default shown, and one table of exit statuses for every command."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from brownout import __version__
from brownout._cli import (
    EXIT_MISSING_EXTRA,
    EXIT_OK,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    USAGE,
    _completion_parser,
    main,
)
from brownout._queue_cli import _confirm

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENT_IDS = sorted(
    set(
        re.findall(
            r'<a id="[a-z][0-9]+"></a>([A-Z][0-9]+)', (ROOT / "docs/requirements.md").read_text()
        )
    )
)


def brownout(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from brownout._cli import main; sys.exit(main())",
            *argv,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_version_prints_the_installed_version() -> None:
    r = brownout("--version")
    assert r.returncode == EXIT_OK
    assert r.stdout.strip() == f"brownout {__version__}"


@pytest.mark.parametrize("command", [(), ("lab",), ("top",), ("queue",)])
def test_help_is_in_plain_words_with_no_requirement_codes(command: tuple[str, ...]) -> None:
    assert len(REQUIREMENT_IDS) > 40  # the page was read
    r = brownout(*command, "--help")
    assert r.returncode == EXIT_OK, r.stderr
    cited = [tag for tag in REQUIREMENT_IDS if re.search(rf"\b{tag}\b", r.stdout)]
    assert cited == [], r.stdout
    assert "exit status" in r.stdout


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        ("top", ["(default: 2.0)", "(default: 10.0)", "(default: http://127.0.0.1:8000/metrics)"]),
        ("lab", ["(default: lab-report)", "(default: 1, or 0.5 with --quick)"]),
    ],
)
def test_help_shows_the_defaults(command: str, shown: list[str]) -> None:
    out = " ".join(brownout(command, "--help").stdout.split())  # unwrapped
    for default in shown:
        assert default in out, out
    assert "(default: None)" not in out and "(default: False)" not in out


def test_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == EXIT_USAGE
    assert main(["nonsense"]) == EXIT_USAGE
    assert "unknown command 'nonsense'" in capsys.readouterr().err
    assert main(["--help"]) == EXIT_OK
    assert "exit status" in capsys.readouterr().out
    assert main(["top", "--once", "--interval", "0.5", "http://127.0.0.1:9/metrics"]) == (
        EXIT_UNREACHABLE
    )
    with pytest.raises(SystemExit) as usage:
        main(["top", "--interval", "0"])
    assert usage.value.code == EXIT_USAGE
    assert "2 usage error" in USAGE and "3 the service could not be" in USAGE


def test_top_without_its_extra_says_what_to_install() -> None:
    code = (
        "import sys\nsys.modules['rich'] = None  # as if not installed\n"
        "from brownout._cli import main\nsys.exit(main(['top', '--once']))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_MISSING_EXTRA, r.stderr
    assert "Traceback" not in r.stderr
    assert "pip install 'brownout[top]'" in r.stderr


def test_the_completion_tree_has_every_command_and_option() -> None:
    # Built only when argcomplete asks (it is optional); the tree must match the commands.
    p = _completion_parser()
    top = p.parse_args(["top", "--window", "5", "--count", "2", "http://127.0.0.1:1/metrics"])
    assert (top.command, top.window, top.count) == ("top", 5.0, 2)
    args = p.parse_args(["lab", "--quick"])
    assert args.command == "lab" and args.quick
    queue = p.parse_args(["queue", "list", "--redis", "redis://127.0.0.1/0", "--queue", "q"])
    assert (queue.command, queue.action, queue.queue) == ("queue", "list", "q")


class _Terminal:
    def __init__(self, answer: str) -> None:
        self.answer = answer

    def isatty(self) -> bool:
        return True

    def readline(self) -> str:
        return self.answer


@pytest.mark.parametrize(
    ("yes", "stdin", "expected"),
    [
        (True, None, True),
        (False, _Terminal("y\n"), True),
        (False, _Terminal("YES\n"), True),
        (False, _Terminal("\n"), False),
        (False, _Terminal("n\n"), False),
        (False, io.StringIO("y\n"), None),  # not a terminal: nobody to ask
    ],
)
def test_queue_changes_are_confirmed(yes: bool, stdin: object, expected: bool | None) -> None:
    asked: list[str] = []
    assert _confirm("Delete?", yes, stdin, asked.append) is expected
    assert asked == ([] if yes or expected is None else ["Delete? [y/N] "])
