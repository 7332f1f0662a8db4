"""``brownout sim FILE --out DIR``: the plots and the HTML report, verdict first."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from brownout._cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sim" / "zone_loss.toml"


def test_the_example_renders_a_report_with_every_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    argv = ["sim", str(EXAMPLE), "--json", str(tmp_path / "r.json"), "--out", str(out)]
    assert main([*argv, "--quiet"]) == 0
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["layers.png", "work.png"]
    for name in pngs:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "index.html").read_text()
    assert set(re.findall(r"<img src='([^']+)'", page)) == set(pngs)
    assert (out / "result.json").exists()
    # The verdict comes before anything else on the page.
    assert page.index("PASS: all 3 invariants held") < page.index("<img")
    assert "zone_loss (a) 12 s to 28 s" in page


def test_a_failed_invariant_is_the_first_thing_the_report_says(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    model = tmp_path / "m.toml"
    model.write_text(
        EXAMPLE.read_text()
        .replace("duration = 40", "duration = 6")
        .replace("min = 0.99", "min = 0.99\nmax = 0.5")
    )
    out = tmp_path / "report"
    assert main(["sim", str(model), "--json", str(tmp_path / "r.json"), "--out", str(out),
                 "--quiet"]) == 1  # fmt: skip
    page = (out / "index.html").read_text()
    assert page.index("FAIL: 1 of 3 invariants failed") < page.index("<img")


def test_out_alone_writes_the_json_into_the_report_folder_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "report"
    assert main(["sim", str(EXAMPLE), "--out", str(out), "--quiet"]) == 0
    assert (out / "result.json").exists()
    assert not (tmp_path / "sim-result.json").exists()
