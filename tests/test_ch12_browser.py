"""Chapter 12 — the /engine page in a real headless Chromium (Debian's chromium + chromium-driver, via selenium).

The server runs a tiny random-weight model behind the real SmolLM2 tokenizer and chat template, with a
tiny KV pool (40 blocks of 4 tokens) so that a burst overloads it. The tiny model's steps are short, too short
for a page to show anything, so each step is padded to 40 ms.

The test drives the page as a learner would: it presses "Burst" and checks, in the page's DOM, that the
pool grid shows blocks owned by requests while they run and none once they are done, that the queues list
the requests, that a preemption is shown; it sends a chat message and sees the reply grow as it streams;
it restarts the server and sees the page reconnect; it fails on any browser console error; and it saves
screenshots — into chapters/img/ with

    NANOSERVE_SCREENSHOTS=chapters/img python -m pytest tests/test_ch12_browser.py

(the chapter's figures), else into a temporary folder.
"""

import functools
import os
import time
from pathlib import Path

import pytest

from nanoserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

from nanoserve.engine.llm_engine import LLMEngine
from tests.engine_view_server import start_server
from tests.tiny_model import tiny_llama

pytestmark = pytest.mark.slow

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
HOW_TO_INSTALL = ("needs Debian's chromium and its driver: `sudo apt-get install -y chromium chromium-driver`, "
                  "and `pip install selenium` (CI installs them in .ci/run)")
if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip(f"{CHROMIUM} or {CHROMEDRIVER} is missing: this test {HOW_TO_INSTALL}", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason=f"selenium is missing: this test {HOW_TO_INSTALL}")

STEP_SECONDS = 0.04
PACE = {"step_s": STEP_SECONDS}  # the servers' step time, changed where the test must see a reply grow
FREE = ("free", "cached")


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from nanoserve.text.tokenizer import Tokenizer

    model = tiny_llama(vocab_size=49152)
    return model, Tokenizer.from_gguf()


def serve(model_and_tokenizer, port=0):
    model, tokenizer = model_and_tokenizer
    engine = LLMEngine(model, EngineConfig(cache_config=CacheConfig(num_blocks=40, block_size=4),
                                           scheduler_config=SchedulerConfig(max_num_seqs=8)), tokenizer)
    step = engine.step

    @functools.wraps(step)
    def padded_step():
        t0 = time.perf_counter()
        outputs = step()
        time.sleep(max(0.0, PACE["step_s"] - (time.perf_counter() - t0)))
        return outputs

    engine.step = padded_step
    return start_server(engine, tokenizer, port)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,1000",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    yield driver
    driver.quit()


@pytest.fixture
def shots(tmp_path):
    folder = Path(os.environ.get("NANOSERVE_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def until(predicate, timeout=60.0, every=0.05, what="the page"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def page_state(driver) -> dict:
    """What the page shows right now, read from its DOM in one go."""
    return driver.execute_script("""
        const owners = [...document.querySelectorAll('#pool .block')].map(b => b.dataset.owner);
        const ids = (sel) => [...document.querySelectorAll(sel)].map(li => li.dataset.id);
        return {owners, running: ids('#running li'), waiting: ids('#waiting li'),
                preemptedTags: document.querySelectorAll('#waiting li.preempted, #running li.preempted').length,
                preemptedEvents: document.querySelectorAll('#events li.preempted').length,
                preemptions: Number(document.getElementById('preemptions').textContent),
                status: document.getElementById('status').className, connects: document.getElementById('status').dataset.connects,
                step: document.getElementById('step').textContent, burst: document.getElementById('burst-status').textContent,
                reply: document.getElementById('reply').textContent, kv: document.getElementById('kv-usage').textContent,
                titles: [...document.querySelectorAll('#pool .block')].slice(0, 3).map(b => b.title),
                overflow: document.documentElement.scrollWidth - window.innerWidth};
    """)


def console_errors(driver, allow=()):
    return [e for e in driver.get_log("browser")
            if e["level"] == "SEVERE" and not any(a in e["message"] for a in allow)]


def fill(driver, element_id, value):
    box = driver.find_element("id", element_id)
    box.clear()
    box.send_keys(str(value))


def test_the_page_live(browser, model_and_tokenizer, shots):
    server = serve(model_and_tokenizer)
    port = server.port
    try:
        browser.get(f"http://127.0.0.1:{port}/engine")
        s = until(lambda: (lambda s: s if s["status"].endswith("live") and s["owners"] else None)(page_state(browser)),
                  what="the first snapshot")
        assert len(s["owners"]) == 40 and set(s["owners"]) == {"free"} and s["running"] == s["waiting"] == []
        assert s["titles"][0] == "block 0: free"  # readable without colour

        # a burst through the page's own form
        fill(browser, "burst-n", 6)
        fill(browser, "max-tokens", 40)
        browser.find_element("id", "burst").click()
        seen = {"owned": 0, "queued": set(), "waiting": 0, "preempted": False}
        shot_taken = False

        def watch_burst():
            nonlocal shot_taken
            s = page_state(browser)
            owned = [o for o in s["owners"] if o not in FREE]
            seen["owned"] = max(seen["owned"], len(owned))
            seen["queued"] |= set(s["running"]) | set(s["waiting"])
            seen["waiting"] = max(seen["waiting"], len(s["waiting"]))
            seen["preempted"] |= s["preemptions"] > 0 and s["preemptedEvents"] > 0
            if owned and s["waiting"] and s["running"] and not shot_taken:
                browser.save_screenshot(str(shots / "12-engine-view-burst.png"))
                shot_taken = True
            return s["burst"].startswith("6 / 6 done")

        until(watch_burst, timeout=120, what="the burst to finish")
        assert "failed" not in page_state(browser)["burst"]
        assert seen["owned"] > 0, "the grid never showed a block owned by a request"
        assert len(seen["queued"]) == 6 and seen["waiting"] > 0, seen  # every request was listed, some waited
        assert seen["preempted"], "a 40-block pool under 6 requests of ~75 tokens must preempt, and show it"
        assert shot_taken

        # once idle: every block free (or cached: free, reusable by a prefix hit), nothing listed
        s = until(lambda: (lambda s: s if not s["running"] and not s["waiting"] and all(o in FREE for o in s["owners"])
                           else None)(page_state(browser)), what="an all-free pool")
        assert s["kv"] == "0 %" and "cached" in s["owners"]  # the shared chat template prefix stays cached

        # the page opened afresh after the burst: its timeline already holds the burst's last steps (the feed's
        # history), up to the engine's own latest step, 120 bars at most
        browser.refresh()
        drawn = until(lambda: browser.find_element("id", "timeline").get_attribute("data-steps"), what="the timeline")
        last = server.state.engine.engine.num_steps
        assert drawn == f"{max(1, last - 119)}-{last}", (drawn, last)
        # ... and a latency window of its own: none of the burst's requests, which finished before it connected
        until(lambda: browser.find_element("id", "last-n").text == "0", what="a fresh latency window")

        # a chat message, streamed: the reply grows while it arrives (slow steps, 0.25 s: a loaded machine's page
        # reads, which can take a few tenths of a second each, still see it grow)
        fill(browser, "chat-input", "Hello there")
        fill(browser, "max-tokens", 30)
        PACE["step_s"] = 0.25
        try:
            browser.find_element("id", "send").click()
            lengths = set()
            until(lambda: lengths.add(len(page_state(browser)["reply"])) or len(lengths - {0}) >= 3,
                  what="the reply to stream in")
            until(lambda: browser.find_element("id", "reply").get_attribute("data-state") == "done",
                  what="the reply's end")
        finally:
            PACE["step_s"] = STEP_SECONDS
        browser.save_screenshot(str(shots / "12-engine-view-idle.png"))

        browser.set_window_size(420, 1000)  # a narrow window: one column, nothing wider than the screen
        until(lambda: page_state(browser)["overflow"] <= 0, what="the narrow layout to fit the window")
        browser.save_screenshot(str(shots / "12-engine-view-narrow.png"))
        browser.set_window_size(1280, 1000)
        assert console_errors(browser) == []

        # the server restarts: the page says it is down, then reconnects to the new one (fresh step count)
        server.stop()
        until(lambda: page_state(browser)["status"].endswith("down"), what="the page to notice the server left")
        server = serve(model_and_tokenizer, port)
        # "live" shows when the stream's headers arrive, the step count with its first frame: wait for both
        until(lambda: (lambda s: s["status"].endswith("live") and s["connects"] == "2" and s["step"] == "0")(
            page_state(browser)), what="the page to reconnect and show the new server's step 0")
        # while the server was down, the only errors are the browser's own notes of refused connections
        assert console_errors(browser, allow=("ERR_CONNECTION_REFUSED", "ERR_EMPTY_RESPONSE")) == []
    finally:
        server.stop()

