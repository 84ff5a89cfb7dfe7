"""The report pages (a run's report/index.html, a study's compare/index.html) opened in headless Chromium: they load
with no console errors, the tables and every image are there with a non-zero size, nothing is fetched; a
screenshot of each is saved with the test's outputs (tmp_path)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.chromium import Chromium, find_chromium
from whale_ray.cli import main

pytestmark = pytest.mark.slow

INSPECT = """JSON.stringify({
  images: [...document.images].map(i => ({id: i.id, src: i.getAttribute('src').slice(0, 22), complete: i.complete,
           natural: [i.naturalWidth, i.naturalHeight], box: [i.getBoundingClientRect().width, i.getBoundingClientRect().height]})),
  tables: [...document.querySelectorAll('table')].map(t => t.rows.length),
  sections: [...document.querySelectorAll('h2')].map(h => h.id),
  resources: performance.getEntriesByType('resource').map(r => r.name),
  text: document.body.innerText,
})"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    exe = find_chromium()
    if exe is None:
        pytest.skip("headless Chromium is not installed (scripts/setup.sh installs apt's chromium)")
    with Chromium(exe, tmp_path_factory.mktemp("chromium-profile")) as b:
        yield b


def load(browser: Chromium, page: Path, screenshot: Path) -> dict:
    """The page as Chromium renders it; fails on any console error; saves a full-page screenshot."""
    html = page.read_text()
    assert not re.search(r"<(script|link|iframe)\b", html), "a report page needs no script, stylesheet or frame"
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", html), "a report page fetches nothing"
    tab = browser.open(page.resolve().as_uri())
    seen = json.loads(tab.evaluate(INSPECT))
    assert tab.console_errors() == []
    assert tab.screenshot(screenshot).stat().st_size > 10_000
    assert seen["resources"] == []  # images are inlined: the page loads nothing after itself
    for img in seen["images"]:
        assert img["src"] == "data:image/png;base64," and img["complete"], img
        assert min(img["natural"]) > 0 and min(img["box"]) > 0, img
    return seen


def test_run_report_page(small_study, tmp_path, browser):
    run = tmp_path / "mh_only-s0"  # a harness run: its archive has an accepted chain with diffs to show
    shutil.copytree(small_study / "mh_only-s0", run)
    assert main(["report", str(run)]) == 0
    seen = load(browser, run / "report" / "index.html", tmp_path / "report.png")
    assert seen["sections"] == ["cycles", "curves", "chain", "frontier", "metrics", "ledgers", "config"]
    assert {img["id"] for img in seen["images"]} == {"img-curves", "img-frontier"}
    state = json.loads((run / "state.json").read_text())
    assert seen["tables"][0] == 1 + len(state["history"])  # the cycle table: a header and a row per cycle
    text = seen["text"]
    accepted = list(dict.fromkeys(row["accepted_harness"] for row in state["history"]))
    assert len(accepted) > 1, accepted  # h0 and what replaced it
    for hid in accepted:  # each accepted harness with its hypothesis and the lines its diff adds
        meta = json.loads((run / "archive" / hid / "meta.json").read_text())
        assert f"{hid}: accepted from cycle" in text and meta["hypothesis"] in text
        patch = (run / "archive" / hid / "diff.patch").read_text()
        for line in patch.splitlines():
            if line.startswith("+") and not line.startswith("+++") and line[1:].strip():
                assert line in text, line
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert f"condition: {cfg['condition']}" in text and f"seed: {cfg['seed']}" in text  # the resolved config
    assert f"candidates proposed {state['ledger']['candidates_proposed']}" in text  # the rollout ledger
    assert "proposer (separate ledger, not in rollouts)" in text


def test_study_page(small_study, tmp_path, browser):
    out = tmp_path / "compare"
    assert main(["compare", str(small_study), "--out", str(out)]) == 0
    seen = load(browser, out / "index.html", tmp_path / "compare.png")
    assert {img["id"] for img in seen["images"]} == {"img-compare", "img-chain"}
    assert seen["tables"][0] == 1 + 2  # a header and a row per condition
    assert seen["tables"][1] == 1 + 2  # D_test metrics: a header and a row per condition
    assert seen["tables"][2] == 1 + 4  # a header and a row per run
    assert "[paper]" in seen["text"]
