"""`brownout proxy`'s pure parts: fault settings, timelines (TOML), addresses, the netem
probe's verdicts (with a fake ``run``) and the command's usage errors."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from brownout._cli import main
from brownout._lab.faults import Faults, FaultsError, Timeline, load_timeline, parse_timeline
from brownout._lab.netem import netem_status
from brownout._lab.proxy import ProxyError, is_loopback, parse_address


def test_faults_are_validated() -> None:
    assert not Faults().active
    assert Faults(latency=0.1).active
    for bad in ({"latency": -1}, {"error_rate": 1.5}, {"jitter": float("nan")}):
        with pytest.raises(FaultsError):
            Faults.from_mapping(bad)
    with pytest.raises(FaultsError, match="error_status"):
        Faults(error_status=42)
    with pytest.raises(FaultsError, match=r"unknown fault setting.*latncy"):
        Faults.from_mapping({"latncy": 0.1})


def test_timeline_steps_in_order() -> None:
    timeline = Timeline.of((1.0, Faults(latency=0.1)), (3.0, Faults(error_rate=0.5)))
    assert timeline.at(0.5) == (-1, Faults())
    assert timeline.at(1.0) == (0, Faults(latency=0.1))
    assert timeline.at(10.0) == (1, Faults(error_rate=0.5))
    with pytest.raises(FaultsError, match="increasing"):
        Timeline.of((2.0, Faults()), (1.0, Faults()))


def test_timeline_from_toml(tmp_path: Path) -> None:
    path = tmp_path / "faults.toml"
    path.write_text(
        "[[step]]\nat = 0\n\n[[step]]\nat = 5\nlatency = 0.1\njitter = 0.02\n\n"
        "[[step]]\nat = 10.5\nerror_rate = 0.3\nerror_status = 503\n"
    )
    timeline = load_timeline(path)
    assert [s.at for s in timeline.steps] == [0.0, 5.0, 10.5]
    assert timeline.steps[1].faults == Faults(latency=0.1, jitter=0.02)
    assert timeline.as_list()[2]["error_rate"] == 0.3
    with pytest.raises(FaultsError, match="step 2: unknown"):
        parse_timeline({"step": [{"at": 0}, {"at": 1, "delay": 2}]})
    with pytest.raises(FaultsError, match="needs 'at'"):
        parse_timeline({"step": [{"latency": 1}]})
    with pytest.raises(FaultsError, match="expected \\[\\[step\\]\\]"):
        parse_timeline({"steps": []})
    (tmp_path / "bad.toml").write_text("[[step]\n")
    with pytest.raises(FaultsError, match="not valid TOML"):
        load_timeline(tmp_path / "bad.toml")


def test_addresses() -> None:
    assert parse_address("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert parse_address("[::1]:80") == ("::1", 80)
    assert parse_address("9000", default_host="127.0.0.1") == ("127.0.0.1", 9000)
    for bad in ("9000", "host:port", "127.0.0.1:70000", ":80"):
        with pytest.raises(ProxyError):
            parse_address(bad)
    assert is_loopback("127.0.0.2") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")


def fake_run(returncode: int, stderr: str = "") -> Any:
    calls: list[list[str]] = []

    def run(argv: list[str], **options: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, returncode, "", stderr)

    run.calls = calls  # type: ignore[attr-defined]
    return run


def test_netem_status_verdicts() -> None:
    every = lambda tool: f"/usr/bin/{tool}"  # noqa: E731
    ok = netem_status(run=fake_run(0), which=every, euid=1000)
    assert ok.usable and ok.how == "--user --map-root-user --net"
    run = fake_run(2, "Error: Specified qdisc kind is unknown.\n")
    no = netem_status(run=run, which=every, euid=0)
    assert not no.usable and "sch_netem" in no.detail
    assert [argv[1] for argv in run.calls] == ["--net", "--user"]  # root tries both
    missing = netem_status(run=fake_run(0), which=lambda tool: None, euid=0)
    assert not missing.usable and "tc" in missing.detail


def test_cli_usage_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["proxy", "--listen", "127.0.0.1:0"]) == 2
    assert "--upstream" in capsys.readouterr().err
    assert main(["proxy", "--upstream", "127.0.0.1:1", "--listen", "0.0.0.0:0"]) == 2
    assert "not loopback" in capsys.readouterr().err
    assert main(["proxy", "--upstream", "127.0.0.1:1", "--error-rate", "2"]) == 2
    assert "error_rate" in capsys.readouterr().err
    (tmp_path / "t.toml").write_text("[[step]]\nat = 0\nstal_rate = 1\n")
    assert main(["proxy", "--upstream", "127.0.0.1:1", "--timeline", str(tmp_path / "t.toml")]) == 2
    assert "stal_rate" in capsys.readouterr().err
    assert main(["proxy", "--upstream", "127.0.0.1:1", "--error-rate", "0.5"]) == 2
    assert "needs http mode" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["proxy", "--mode", "udp", "--upstream", "127.0.0.1:1"])
