"""The demo page in a real browser (Debian's chromium, headless): two panes stream at once; the API docs work,
and the Host and Origin checks hold against a page on another origin or under a rebound name.

The screenshot is kept as a test artifact under $MINFER_TEST_ARTIFACTS (default
/tmp/minfer-test-artifacts); the test prints where.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest

CHROMIUM = os.environ.get("MINFER_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def artifacts() -> Path:
    out = Path(os.environ.get("MINFER_TEST_ARTIFACTS", "/tmp/minfer-test-artifacts"))
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One headless Chromium for the module; its resolver maps attacker.example to 127.0.0.1, as a DNS
    rebinding attack would."""
    # imported here, not at collection: a `pytest -m gpu` run (which deselects these tests) then needs no playwright
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                      args=FLAGS + ["--host-resolver-rules=MAP attacker.example 127.0.0.1"])
        try:
            yield launched
        finally:
            launched.close()


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed (apt-get install chromium)")
def test_two_panes_stream_side_by_side(server: Any, browser: Any, artifacts: Path,
                                       capsys: pytest.CaptureFixture) -> None:
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    try:
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
        page.close()


@pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="chromium is not installed (apt-get install chromium)")
def test_docs_work_and_a_rebound_name_is_refused(server: Any, browser: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 44 in a browser: the API docs on a loopback name load and send requests; a page on another origin
    cannot drive the server, and a page under a name rebound to 127.0.0.1 gets nothing (Chromium's resolver
    maps attacker.example there, as a DNS rebinding attack would)."""
    parsed: list[str] = []
    real_parse = server.ctx.parse_body

    async def parse_body(request: Any, model: Any) -> Any:
        parsed.append(request.headers.get("origin"))
        return await real_parse(request, model)

    monkeypatch.setattr(server.ctx, "parse_body", parse_body)
    port = server.port
    post = ("async ([url, mode, type]) => { const r = await fetch(url, {method: 'POST', mode, headers: "
            "{'Content-Type': type}, body: JSON.stringify({prompt: 'hi', max_tokens: 2})}); return r.status; }")
    page = browser.new_page()
    try:
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        assert page.goto(f"http://localhost:{port}/docs").status == 200
        page.wait_for_selector(".swagger-ui .opblock", timeout=15000)  # Swagger UI rendered the schema
        # what the docs' "Try it out" sends: a same-origin fetch (with an Origin header), served
        assert page.evaluate(post, ["/v1/completions", "cors", "application/json"]) == 200
        assert parsed == [f"http://localhost:{port}"]
        # the same page posting to 127.0.0.1 is another origin: a no-cors post the browser sends blind
        # (status 0 to the page) is refused before its body is read
        assert page.evaluate(post, [f"http://127.0.0.1:{port}/v1/completions", "no-cors", "text/plain"]) == 0
        assert errors == [] and len(parsed) == 1
        rebound = page.goto(f"http://attacker.example:{port}/")
        assert rebound is not None and rebound.status == 400
        assert rebound.json()["error"]["code"] == "host_not_allowed"
    finally:
        page.close()
