"""The status page (``GET /``) in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``) driven by Selenium over a real 3-stage SmolLM2 route. The page loads,
draws every stage with its layers, endpoint and health, and a chat round trip renders the
streamed reply, in several updates, equal to the route's greedy chat text. A screenshot of
the page is kept in the test's output directory (``$DGR_TEST_OUTPUT``, default
``.test-output/`` in the checkout, ignored by git).

Skipped where Chromium is not installed, except under CI (``CI`` set), where its absence is a
failure: ``.ci/run`` installs it.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import urllib.request

import pytest

from dgr.driver.route import AsyncRoute
from dgr.testing.serving import Served
from dgr.testing.waits import wait_until

pytestmark = pytest.mark.slow

uvicorn = pytest.importorskip("uvicorn")

SETTINGS = dict(n_ctx=256, n_slots=2, n_threads=1, n_ubatch=32)
RANGES = [(0, 10), (10, 20), (20, 30)]
MESSAGE = "Name three colours."
MAX_TOKENS = 12
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _browser_paths() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium and driver:
        return chromium, driver
    why = "Debian's chromium and chromium-driver are not installed (.ci/run installs them)"
    if os.environ.get("CI"):
        pytest.fail(why)
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser():
    chromium, driver_path = _browser_paths()
    if not os.environ.get("CI"):
        pytest.importorskip("selenium")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1280,1100", "--no-first-run", "--disable-extensions"):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(executable_path=driver_path), options=opts)
    d.set_page_load_timeout(60)
    d.set_script_timeout(60)
    yield d
    d.quit()


@pytest.fixture(scope="module")
def served(stages, smollm2):
    from dgr.serve.app import create_app
    from dgr.serve.templates import ChatTemplate

    app = create_app(AsyncRoute([w.address for w in stages]), model="smollm2",
                     template=ChatTemplate.from_gguf(smollm2))
    s = Served(app)
    yield s
    s.stop()


def _output_dir() -> pathlib.Path:
    d = pathlib.Path(os.environ.get("DGR_TEST_OUTPUT", ROOT / ".test-output"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _cards(browser) -> list[dict]:
    """The stage cards as the page shows them now, read in one script (the page redraws them
    on every poll, so elements found one by one could go stale between reads)."""
    return browser.execute_script("""
        return [...document.querySelectorAll('#stages li.stage')].map(li => ({
            endpoint: li.dataset.endpoint, health: li.dataset.health, text: li.innerText}));""")


def _compute_shown(card: dict) -> bool:
    """Whether a stage card shows a compute figure (not the placeholder dash)."""
    lines = card["text"].split("\n")
    i = lines.index("compute / token")
    return lines[i + 1] != "\u2013"


def _wait(browser, what: str, fn, timeout: float = 60):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(browser, timeout, poll_frequency=0.1,
                             ignored_exceptions=[StaleElementReferenceException]
                             ).until(lambda d: fn(d))
    except Exception as e:
        shot = _output_dir() / "status-page-failure.png"
        browser.save_screenshot(str(shot))
        raise AssertionError(f"{what} (screenshot {shot}; page text: "
                             f"{browser.find_element('tag name', 'body').text[:2000]!r})") from e


def test_the_page_shows_every_stage_and_a_chat_round_trip_streams(browser, served, stages,
                                                                  smollm2):
    from selenium.webdriver.common.by import By

    browser.get(served.base + "/")
    _wait(browser, "the page did not load its status",
          lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-loaded") == "true")
    cards = _wait(browser, "the page did not draw 3 stages",
                  lambda d: (lambda c: c if len(c) == 3 else False)(_cards(d)))
    for card, w, (a, b) in zip(cards, stages, RANGES):
        assert card["endpoint"] == w.address and card["health"] == "ok"
        assert f"layers [{a}, {b})" in card["text"] and w.address in card["text"]
        assert "slots in use" in card["text"] and "0 / 2" in card["text"]
    assert browser.find_element(By.ID, "model").text == "smollm2"
    # this front keeps no sessions (tests/system/test_prefix_cache.py counts a cache's use)
    assert browser.find_element(By.ID, "fig-prompt-cache").text == "off"

    # count the updates of the reply as it streams in
    browser.execute_script("""
        window.dgrUpdates = 0;
        new MutationObserver(() => { window.dgrUpdates += 1; })
          .observe(document.getElementById('chat-log'),
                   {childList: true, characterData: true, subtree: true});""")
    mx = browser.find_element(By.ID, "chat-max")
    mx.clear()
    mx.send_keys(str(MAX_TOKENS))
    browser.find_element(By.ID, "chat-input").send_keys(MESSAGE)
    browser.find_element(By.ID, "chat-send").click()
    reply = _wait(browser, "the chat reply did not complete",
                  lambda d: d.find_elements(
                      By.CSS_SELECTOR, ".msg.assistant[data-state='done']"))[0]
    text = reply.get_attribute("textContent")
    updates = browser.execute_script("return window.dgrUpdates")

    # the same request, not streamed, gives the route's greedy text (tests/system/test_serve)
    req = urllib.request.Request(served.base + "/v1/chat/completions", data=json.dumps({
        "messages": [{"role": "user", "content": MESSAGE}], "max_tokens": MAX_TOKENS,
        "temperature": 0}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        want = json.load(r)["choices"][0]["message"]["content"]
    assert text == want and text
    # the user's message, the empty reply, then at least two pieces of text
    assert updates >= 4, f"the reply was rendered in {updates} update(s): not streamed"
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == MESSAGE

    # after the chat, the stages show their measured compute per token and the page the
    # traffic: wait for a poll that has both
    _wait(browser, "no compute figure per stage after the chat",
          lambda d: (lambda c: len(c) == 3 and all(map(_compute_shown, c)))(_cards(d)))

    # the trends: the server's samples (one per 2 s of polling) drawn as SVG lines, no CDN;
    # the tokens/s line rose with the chat, and each stage has its own compute line
    def drawn(d):
        pts = d.execute_script("""
            const out = {};
            for (const p of document.querySelectorAll('.chart polyline'))
              out[p.closest('figure').id + '/' + p.dataset.series] = p.getAttribute('points');
            return out;""")
        # (no drafts on this route: the acceptance line is empty; the seam may be unknown)
        ok = len(pts) == 8 and all(len(v.split()) >= 2 for k, v in pts.items()
                                   if not k.endswith(("seam per link", "accepted")))
        return pts if ok else False

    pts = _wait(browser, "the trend charts did not draw their lines", drawn)
    assert {k.split("/")[0] for k in pts} == {"chart-tps", "chart-ttft", "chart-waiting",
                                              "chart-acceptance", "chart-seam"}
    assert [k for k in pts if k.startswith("chart-seam/stage")] == [
        "chart-seam/stage 0 compute", "chart-seam/stage 1 compute", "chart-seam/stage 2 compute"]
    tps = [float(p.split(",")[1]) for p in pts["chart-tps/tokens/s"].split()]
    assert min(tps) < max(tps), "the tokens/s line is flat: the chat's traffic is not in it"
    shot = _output_dir() / "status-page.png"
    browser.save_screenshot(str(shot))
    assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshot: {shot}")


def test_the_status_json_after_a_completion(served, stages):
    req = urllib.request.Request(served.base + "/v1/completions", data=json.dumps({
        "prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
    with urllib.request.urlopen(served.base + "/status", timeout=30) as r:
        st = json.load(r)
    assert [s["endpoint"] for s in st["stages"]] == [w.address for w in stages]
    assert [s["layers"] for s in st["stages"]] == [list(r) for r in RANGES]
    assert all(s["health"] == "ok" and s["slots_used"] == 0 for s in st["stages"])
    assert st["healthy"] and st["in_flight"] == 0 and st["requests"] == []
    assert st["traffic"]["tokens_per_s"] > 0 and st["traffic"]["ttft_ms"] > 0
    assert st["path"] in ("relay+loop", "relay", "hop-by-hop")
    assert st["prompt_cache"]["size"] == 0 and st["prompt_cache"]["kept"] == 0
    # the trends' samples: one per 2 s of polls at most (a page may be polling too), so a
    # sample after the completion comes within a few polls
    def history():
        with urllib.request.urlopen(served.base + "/status", timeout=30) as r:
            h = json.load(r)["history"]
        return h if h["tokens_per_s"] and h["tokens_per_s"][-1] > 0 else None

    h = wait_until(history, "a trend sample with the completion's tokens", 30, every=0.5)
    assert h["span_s"] == 300 and len(h["age_s"]) == len(h["tokens_per_s"]) >= 1
    assert [len(c) for c in h["compute_ms"]] == [len(RANGES)] * len(h["age_s"])
    for name in ("status.js", "status.css"):
        with urllib.request.urlopen(served.base + "/static/" + name, timeout=30) as r:
            assert r.status == 200 and len(r.read()) > 500
