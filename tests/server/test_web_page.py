"""The demo page in a real browser (Debian's chromium, headless): two panes stream at once.

The screenshot is kept as a test artifact under $MINFER_TEST_ARTIFACTS (default
/tmp/minfer-test-artifacts); the test prints where.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = os.environ.get("MINFER_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def artifacts() -> Path:
    out = Path(os.environ.get("MINFER_TEST_ARTIFACTS", "/tmp/minfer-test-artifacts"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed (apt-get install chromium)")
def test_two_panes_stream_side_by_side(server: Any, artifacts: Path, capsys: pytest.CaptureFixture) -> None:
    # imported here, not at collection: a `pytest -m gpu` run (which deselects this test) then needs no playwright
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(server.base_url + "/")
            page.wait_for_selector("body[data-ready='1']", timeout=15000)
            assert page.locator(".pane").count() == 3
            page.fill("#c-max_tokens", "400")
            page.fill("#c-seed", "1")
            page.check("#c-ignore_eos")  # both replies run the full 400 tokens
            page.fill("#pane-0 textarea", "def fibonacci(n):")
            page.fill("#pane-1 textarea", "class Stack:")
            # Both Send buttons in one task: Playwright's own click (actionability checks) can take
            # a second on a loaded CI machine, which is not what this test is about.
            page.evaluate("[0, 1].forEach(i => document.querySelector('#pane-' + i + ' .send').click())")
            both_live = "[0, 1].every(i => document.querySelector('#pane-' + i).dataset.state === 'streaming' " \
                        "&& document.querySelector('#pane-' + i + ' .msg.assistant').textContent.length > 20)"
            page.wait_for_function(both_live, timeout=20000, polling=10)
            page.wait_for_timeout(300)  # let the engine panel's next poll show both running
            page.screenshot(path=str(artifacts / "web-page-streaming.png"))
            done = "[0, 1].every(i => document.querySelector('#pane-' + i).dataset.state === 'done')"
            page.wait_for_function(done, timeout=60000)
            page.wait_for_timeout(300)  # one more /stats poll
            shot = artifacts / "web-page.png"
            page.screenshot(path=str(shot))
            with capsys.disabled():  # shown even though pytest captures output
                print(f"\nweb page screenshots: {artifacts}/web-page-streaming.png and {shot}")
            spans = [page.eval_on_selector(f"#pane-{i}", "e => [Number(e.dataset.firstTokenAt), "
                                                         "Number(e.dataset.doneAt)]") for i in (0, 1)]
            (a0, a1), (b0, b1) = spans
            assert a0 < b1 and b0 < a1, f"the two panes did not stream at the same time: {spans}"
            for i in (0, 1):
                assert page.locator(f"#pane-{i} .msg.assistant").inner_text().strip()
                assert page.locator(f"#pane-{i} .ttft").inner_text().endswith("ms")
                assert float(page.locator(f"#pane-{i} .tps").inner_text()) > 0
                assert int(page.locator(f"#pane-{i} .ntok").inner_text()) > 0
            assert int(page.get_attribute("#engine", "data-max-running") or 0) >= 1
            assert page.locator("#health.ok").count() == 1
            assert page.inner_text("#st-kv-text").endswith(f"/ {server.stats()['num_kv_blocks']}")
            assert errors == []
        finally:
            browser.close()
