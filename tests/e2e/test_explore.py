"""The /explore page in a real browser (Debian's Chromium headless shell, driven by Playwright) against real
elmo-serve processes on 127.0.0.1 serving the embedded default model. Without the browser these tests are skipped
with what to install (`make browser`), except where CI or BROWSER_TESTS=required is set: there a missing browser
fails them.

ELMO_EXPLORE_SCREENSHOT=docs/images/explore.png writes the docs' screenshot from the example's view."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from bench.explore import PAGE_FILES, browser_missing, embed_and_wait, example, launch_chromium, wait_until
from tests.live_server import counter, running_server

MISSING = browser_missing()
if MISSING and (os.environ.get("CI") or os.environ.get("BROWSER_TESTS") == "required"):
    raise RuntimeError(f"CI needs the browser tests: {MISSING}")
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

KEY = "explore-k3y-0123456789"
MAX_TOKENS = 60  # the limited server's tokens per sentence: an over-long line gets the server's 413
BANK = example("bank")  # the page's own example: 8 sentences, "bank" in each, 4 by the river (A), 4 of money (B)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    settings = {"ELMO_MAX_TOKENS_PER_SENTENCE": str(MAX_TOKENS)}
    with running_server(None, tmp_path_factory.mktemp("explore"), settings) as s:
        yield s


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    with running_server(None, tmp_path_factory.mktemp("explore-keys"), {"ELMO_API_KEYS": KEY}) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        yield browser
        browser.close()


class Page:
    """A fresh tab on `url`'s page; every request it makes is recorded, and any to another address refused."""

    def __init__(self, browser, url: str):
        self.context = browser.new_context(viewport={"width": 1280, "height": 900})
        self.page = self.context.new_page()
        self.requests: list[str] = []
        self.outside: list[str] = []
        self.errors: list[str] = []
        self.page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.origin = url

        def route(r):
            self.requests.append(r.request.url)
            if r.request.url.startswith(self.origin + "/"):
                r.continue_()
            else:
                self.outside.append(r.request.url)
                r.abort()

        self.context.route("**/*", route)

    def open(self, path: str = "/explore"):
        self.page.goto(self.origin + path)
        return self

    def models_loaded(self):
        wait_until(self.page, "document.getElementById('model').options.length", 30)
        return self

    def value(self, expression: str):
        return self.page.evaluate(expression)

    def matrix(self, view: str) -> np.ndarray:
        values = self.value(f"""document.querySelector('svg.matrix[data-view="{view}"]').dataset.values
                                .split(",").map(Number)""")
        n = round(len(values) ** 0.5)
        return np.asarray(values).reshape(n, n)

    def close(self):
        self.context.close()


@pytest.fixture
def tab(browser, server):
    tab = Page(browser, server.url)
    yield tab
    tab.close()


def embed_example(tab: Page, word: str = "bank") -> float:
    tab.open().models_loaded()
    tab.page.select_option("#example", word)
    return embed_and_wait(tab.page, 60)


def test_the_page_loads_and_embeds_with_no_request_leaving_the_server(tab, server):
    answer = httpx.get(f"{server.url}/explore")
    assert answer.headers["content-security-policy"].startswith("default-src 'self'")
    embed_example(tab)
    assert tab.outside == [] and tab.errors == []
    paths = [url[len(server.url) :] for url in tab.requests]
    assert sorted(paths) == sorted([*PAGE_FILES, "/v1/models", "/embed"]), paths  # one /embed: every layer at once
    # the views: a trail per occurrence, a matrix per layer and the mix, neighbours per occurrence and view
    assert tab.value("window.elmoExplore.state.occurrences.length") == 8
    assert tab.value("document.querySelectorAll('#trails-svg polyline').length") == 8
    assert tab.value("document.querySelectorAll('svg.matrix').length") == 4
    rows = tab.value("[...document.querySelectorAll('table.nearest tr')].slice(1).map((r) => r.cells.length)")
    assert rows == [5] * 8  # the occurrence, then layers 0, 1, 2 and the mix


def test_layer_0_matrix_is_all_ones_and_the_senses_come_apart_above_it(tab):
    embed_example(tab)
    layer0 = tab.matrix("0")
    assert layer0.shape == (8, 8) and np.abs(layer0 - 1).max() <= 1e-5
    assert "1.000" in tab.value("document.querySelector('svg.matrix[data-view=\"0\"]').closest('figure').innerText")
    # its numbers one click away: the table, written when opened
    tab.page.click('figure:has(svg.matrix[data-view="0"]) details summary')
    # the table is written on the details' toggle event, which the browser fires after the click returns
    tab.page.wait_for_function(
        """document.querySelectorAll('figure:has(svg.matrix[data-view="0"]) table td').length >= 64""", timeout=10_000
    )
    cells = tab.value("""[...document.querySelectorAll('figure:has(svg.matrix[data-view="0"]) table td')]
                         .map((c) => c.textContent)""")
    assert cells == ["1.000"] * 64
    upper = tab.matrix("2")
    assert upper.min() < 0.99  # context moved the occurrences apart
    # A/B from the example: layer 0 separates nothing; the biLSTM layers do
    separation = tab.value("[...document.querySelectorAll('#separation rect')].map((r) => Number(r.dataset.v))")
    assert len(separation) == 4 and abs(separation[0]) <= 1e-5 and separation[2] > 0, separation
    print(f"separation by layer 0, 1, 2, mix: {separation}")


def mix_from_api(url: str, texts: list[str], mix: dict, headers: dict | None = None) -> list[np.ndarray]:
    body = {"sentences": texts, "output": "mix", **mix}
    answer = httpx.post(f"{url}/embed", json=body, headers=headers or {}, timeout=60)
    assert answer.status_code == 200, answer.text
    return [np.asarray(item["embedding"], dtype=np.float32) for item in answer.json()["data"]]


def page_mix(tab: Page) -> list[np.ndarray]:
    lengths = tab.value("window.elmoExplore.state.data.sentences.map((s) => s.n)")
    return [
        np.asarray([tab.value(f"window.elmoExplore.mix({s}, {t})") for t in range(n)], dtype=np.float32)
        for s, n in enumerate(lengths)
    ]


def test_a_slider_changes_the_mix_and_the_page_mix_equals_the_api_mix(tab, server):
    embed_example(tab)
    before = tab.matrix("mix")
    tab.page.focus("#weight-2")
    for _ in range(30):  # s2 from 0 to 3: the upper layer dominates the mix
        tab.page.keyboard.press("ArrowRight")
    assert tab.value("window.elmoExplore.state.weights") == [0, 0, 3]
    after = tab.matrix("mix")
    assert np.abs(after - before).max() > 1e-3
    np.testing.assert_allclose(after, tab.matrix("2"), atol=0.1)  # softmax(0, 0, 3) = 0.05, 0.05, 0.91
    # "Copy as Python" runs as copied (the Python client) and answers the page's mix
    copied = tab.value("document.getElementById('copy-python').textContent")
    assert "weights=[0,0,3]" in copied, copied
    scope: dict = {}
    exec(copied, scope)
    shown = page_mix(tab)
    assert max(float(np.abs(a - b).max()) for a, b in zip(shown, scope["vectors"], strict=True)) <= 1e-5
    cases = [
        {"weights": [0, 0, 3], "gamma": 1.0, "normalize": "softmax", "layer_norm": False},
        {"weights": [0.5, -1.2, 2.5], "gamma": 2.5, "normalize": "softmax", "layer_norm": True},
        {"weights": [0.2, 0.3, 0.5], "gamma": 0.7, "normalize": "none", "layer_norm": False},
        {"weights": [1, -0.5, 0.25], "gamma": 1.3, "normalize": "none", "layer_norm": True},
    ]
    for mix in cases:
        tab.value(f"""(() => {{ const s = window.elmoExplore.state; s.weights = {mix["weights"]};
            s.gamma = {mix["gamma"]}; s.normalize = "{mix["normalize"]}";
            s.layerNorm = {str(mix["layer_norm"]).lower()}; window.elmoExplore.remix(); }})()""")
        served = mix_from_api(server.url, BANK, mix)
        shown = page_mix(tab)
        worst = max(float(np.abs(a - b).max()) for a, b in zip(shown, served, strict=True))
        assert worst <= 1e-5, (mix, worst)
        # the mix's matrix (cosines from the layers' dot products, never from the mixed vectors) is the cosines of
        # the API's mixed vectors of "bank" (shown to 6 decimals)
        at = tab.value("window.elmoExplore.state.occurrences.map((o) => [o.s, o.t])")
        bank = np.asarray([served[s][t] for s, t in at], dtype=np.float64)
        unit = bank / np.linalg.norm(bank, axis=1, keepdims=True)
        np.testing.assert_allclose(tab.matrix("mix"), unit @ unit.T, rtol=0, atol=2e-6, err_msg=str(mix))
    # gamma changes no cosine: the norm it shows does change
    norm = tab.value("document.getElementById('mix-norm').textContent")
    tab.page.fill("#gamma", "2")
    tab.page.dispatch_event("#gamma", "input")
    assert tab.value("document.getElementById('mix-norm').textContent") != norm


def test_an_over_limit_input_shows_the_servers_413_and_keeps_the_text(tab):
    tab.open().models_loaded()
    text = " ".join(["word"] * (MAX_TOKENS + 5))
    tab.page.fill("#sentences", text)
    tab.page.click("#embed")
    error = "document.getElementById('error')"
    message = wait_until(tab.page, f"{error}.hidden ? '' : {error}.textContent")
    assert "413" in message and str(MAX_TOKENS) in message, message
    assert tab.page.input_value("#sentences") == text


def test_errors_in_words(tab):
    tab.open().models_loaded()
    explain = "([s, d, r]) => import('./explore/app.js').then((m) => m.explain(s, d, r))"
    busy = tab.page.evaluate(explain, [503, "the queue is full", "2"])
    assert "503" in busy and "the queue is full" in busy and "again in 2 seconds" in busy, busy
    assert "again in 1 second:" in tab.page.evaluate(explain, [503, "busy", "1"])
    assert "in about 2 minutes" in tab.page.evaluate(explain, [503, "busy", "120"])
    assert "in a few seconds" in tab.page.evaluate(explain, [503, "busy", None])
    later = "new Date(Date.now() + 30500).toUTCString()"  # an HTTP date (a proxy's Retry-After), 30-31 s away
    assert "again in 3" in tab.page.evaluate(f"import('./explore/app.js').then((m) => m.explain(503, 'x', {later}))")
    assert "sentences.0" in tab.page.evaluate(explain, [422, "sentences.0: a string is too long", None])


def test_with_keys_the_page_asks_for_one_shows_the_401_and_a_key_works(browser, keyed):
    assert httpx.get(f"{keyed.url}/explore").status_code == 200  # the page and its files need no key
    assert all(httpx.get(f"{keyed.url}{path}").status_code == 200 for path in PAGE_FILES)
    assert httpx.get(f"{keyed.url}/v1/models").status_code == 401
    tab = Page(browser, keyed.url)
    try:
        tab.open()
        message = wait_until(tab.page, "document.getElementById('error').textContent")
        assert "401" in message and "API key" in message, message
        tab.page.select_option("#example", "bank")
        tab.page.fill("#key", KEY)
        tab.page.dispatch_event("#key", "change")
        assert embed_and_wait(tab.page, 60) > 0
        assert tab.value("document.getElementById('error').hidden")
        assert tab.value(f"sessionStorage.getItem('elmo-explore-key') === '{KEY}'")
        assert KEY not in tab.page.url  # the key never goes in the fragment
        served = mix_from_api(keyed.url, BANK, {"weights": [0, 0, 0]}, {"authorization": f"Bearer {KEY}"})
        shown = page_mix(tab)
        assert max(float(np.abs(a - b).max()) for a, b in zip(shown, served, strict=True)) <= 1e-5
        assert tab.outside == []
    finally:
        tab.close()


def test_the_fragment_restores_the_view(tab, browser, server):
    embed_example(tab, "plant")
    tab.page.focus("#weight-1")
    for _ in range(12):
        tab.page.keyboard.press("ArrowLeft")
    tab.page.check("#layer-norm")
    tab.page.select_option("#heat-view", "1")
    url = tab.page.url
    assert "#" in url and "word=plant" in url
    want = tab.matrix("mix")
    again = Page(browser, server.url)
    try:
        again.page.goto(url)
        again.models_loaded()
        time.sleep(0.5)
        assert not any(r.endswith("/embed") for r in again.requests)  # nothing embedded on opening the link
        assert "press Embed" in again.page.inner_text("#status")
        embed_and_wait(again.page, 60)
        state = again.value("({...window.elmoExplore.state, data: null, mixed: null, fixed: null, models: null})")
        assert state["word"] == "plant" and state["weights"] == pytest.approx([0, -1.2, 0])
        assert state["layerNorm"] is True and state["heat"]["view"] == 1 and state["groups"] == ["A"] * 4 + ["B"] * 4
        np.testing.assert_allclose(again.matrix("mix"), want, atol=1e-6)
        assert again.page.input_value("#sentences") == tab.page.input_value("#sentences")
    finally:
        again.close()


def test_a_link_s_numbers_are_clamped_and_it_embeds_only_on_a_press(tab, server):
    """A link is anyone's to send: gamma=1e308 drew NaN, and opening a link sent its text to the server at once."""
    fragment = "#s=The+bank+of+the+river+.%0AThe+bank+raised+rates+.&word=bank&weights=1e308,-1e308,0&gamma=1e308"
    tab.open("/explore" + fragment).models_loaded()
    time.sleep(0.5)
    assert not any(r.endswith("/embed") for r in tab.requests)
    state = tab.value("window.elmoExplore.state")
    assert state["gamma"] == 4 and state["weights"] == [5, -5, 0]  # the sliders' ends
    assert tab.page.input_value("#gamma") == "4"
    embed_and_wait(tab.page, 60)
    assert [r for r in tab.requests if r.endswith("/embed")] == [server.url + "/embed"]
    mixed = tab.matrix("mix")
    assert mixed.shape == (2, 2) and np.isfinite(mixed).all()  # was NaN
    vector = np.asarray(tab.value("window.elmoExplore.mix(0, 1)"))
    assert np.isfinite(vector).all() and np.abs(vector).max() > 0
    tab.open("/explore#s=a+b&gamma=0")
    tab.page.reload()  # a new fragment alone does not load the page again
    tab.models_loaded()
    assert tab.value("window.elmoExplore.state.gamma") == 0.1  # the other end
    assert not tab.errors, tab.errors


def test_the_keyboard_alone_runs_the_whole_flow(tab):
    tab.open().models_loaded()
    page = tab.page

    def tab_to(selector: str, limit: int = 400) -> None:
        for _ in range(limit):
            page.keyboard.press("Tab")
            if page.evaluate(f"document.activeElement.matches({selector!r})"):
                return
        raise AssertionError(f"Tab never reached {selector}")

    tab_to("#sentences")
    page.keyboard.type("The bank of the river flooded .\nThe bank lent money to the farmer .")
    tab_to("#embed")
    page.keyboard.press("Enter")
    wait_until(page, "window.elmoExplore.timings.embedToRender", 60)
    tab_to("button.token[data-token='bank']")
    page.keyboard.press("Enter")
    assert tab.value("window.elmoExplore.state.word") == "bank"
    assert tab.value("window.elmoExplore.state.occurrences.length") == 2
    before = tab.matrix("mix")
    tab_to("#weight-2")
    for _ in range(20):
        page.keyboard.press("ArrowRight")
    assert tab.value("window.elmoExplore.state.weights[2]") == 2
    assert np.abs(tab.matrix("mix") - before).max() > 1e-4
    tab_to("#copy-curl-button")
    assert "weights" in tab.value("document.getElementById('copy-curl').textContent")
    # every control has a label; every chart a <title>
    unlabelled = tab.value("""[...document.querySelectorAll('input, select, textarea')].filter((e) =>
        !e.labels?.length && !e.getAttribute('aria-label')).map((e) => e.id)""")
    assert unlabelled == []
    assert tab.value("[...document.querySelectorAll('svg')].every((s) => s.querySelector(':scope > title'))")


def test_the_screenshot(tab, tmp_path):
    """The docs' picture: the example, the mix moved towards the upper layer, from the mix's sliders to the
    matrices."""
    embed_example(tab)
    tab.page.focus("#weight-2")
    for _ in range(20):
        tab.page.keyboard.press("ArrowRight")
    out = Path(os.environ.get("ELMO_EXPLORE_SCREENSHOT") or tmp_path / "explore.png")
    top = tab.value("document.getElementById('mix-section').getBoundingClientRect().top + scrollY")
    bottom = tab.value("document.getElementById('nearest').getBoundingClientRect().top + scrollY")
    clip = {"x": 0, "y": top - 8, "width": 1280, "height": bottom - top}
    tab.page.screenshot(path=str(out), full_page=True, clip=clip)
    assert 20_000 < out.stat().st_size < 300_000


# A real overload: the queue holds 200 tokens and the engine waits up to 3 s for company before it runs what is
# queued, so two requests of 100 tokens from another address (127.0.0.2) fill it for that long. The page's request
# (the example: 8 sentences, about 140 tokens with their boundaries) is over its address's share of a full queue
# (200 / 2 clients), so the batcher refuses it (QueueFull): 503 with the server's Retry-After (7 s here).
BUSY = {"ELMO_QUEUE_TOKENS": "200", "ELMO_BATCH_TOKENS": "4096", "ELMO_MAX_WAIT_MS": "3000", "ELMO_RETRY_AFTER_S": "7"}


def test_a_real_503_is_shown_in_words_keeps_the_text_and_the_next_embed_recovers(browser, tmp_path):
    with (
        running_server(None, tmp_path, BUSY) as busy,
        httpx.Client(base_url=busy.url) as client,
        httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), base_url=busy.url, timeout=60) as other,
        ThreadPoolExecutor(2) as pool,
    ):
        tab = Page(browser, busy.url)
        try:
            assert embed_example(tab) > 0  # a view on screen before the server gets busy
            text = tab.page.input_value("#sentences")
            flood = [{"sentences": [[f"w{k}"] * 98], "pooling": "mean"} for k in range(2)]  # 100 tokens each
            flooding = [pool.submit(other.post, "/embed", json=body) for body in flood]
            deadline = time.monotonic() + 2
            while counter(client, "elmo_queue_tokens") < 200:  # both queued: the queue is full
                assert time.monotonic() < deadline, "the other address's requests never filled the queue"
                time.sleep(0.02)
            # what the page's request gets, as any client would: a 503 with Retry-After
            refused = httpx.post(f"{busy.url}/embed", json={"sentences": BANK, "output": "layers"})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "7", refused.text
            tab.page.click("#embed")
            error = "document.getElementById('error')"
            message = wait_until(tab.page, f"{error}.hidden ? '' : {error}.textContent", 10)
            assert counter(client, "elmo_queue_tokens") == 200, "the flood was answered first: the 503 was missed"
            assert "503" in message and refused.json()["detail"] in message, message  # the server's own words
            assert "again in 7 seconds" in message, message
            assert tab.page.input_value("#sentences") == text  # nothing typed is lost
            assert tab.value("document.querySelectorAll('#trails-svg polyline').length") == 8  # the last view stays
            assert not tab.value("document.getElementById('embed').disabled")
            assert [f.result().status_code for f in flooding] == [200, 200]  # answered: the queue is free again
            embed_and_wait(tab.page, 60)  # the next Embed recovers
            assert tab.value(f"{error}.hidden") and tab.value("window.elmoExplore.state.occurrences.length") == 8
            served = mix_from_api(busy.url, BANK, {"weights": [0, 0, 0]})
            shown = page_mix(tab)
            assert max(float(np.abs(a - b).max()) for a, b in zip(shown, served, strict=True)) <= 1e-5
            assert tab.outside == [] and len(tab.errors) == 1 and "503" in tab.errors[0]  # the browser's own line
        finally:
            tab.close()


def test_the_page_reads_the_npz_answer_and_falls_back_to_base64_json(tab, server):
    """The page asks for the layers as an .npz (their float32 bytes, read in place); an answer in JSON (a proxy that
    drops the Accept header) still works: the layers in base64. Either gives the API's mix to 1e-5."""
    seen = []
    tab.page.on("request", lambda r: r.url.endswith("/embed") and seen.append(r.headers.get("accept")))
    embed_example(tab)
    assert seen == ["application/x-npz"]
    # JSON instead: the Accept header dropped on the way
    tab.page.route("**/embed", lambda r: r.continue_(headers={**r.request.headers, "accept": "application/json"}))
    embed_and_wait(tab.page, 60)
    served = mix_from_api(server.url, BANK, {"weights": [0, 0, 0]})
    shown = page_mix(tab)
    assert max(float(np.abs(a - b).max()) for a, b in zip(shown, served, strict=True)) <= 1e-5
    assert tab.value("window.elmoExplore.state.occurrences.length") == 8 and tab.errors == []


def test_a_matrix_cell_pointed_at_shows_its_row_column_and_cosine(tab):
    embed_example(tab)
    chart = tab.page.locator('svg.matrix[data-view="2"]')
    chart.scroll_into_view_if_needed()
    box = chart.bounding_box()
    cell = box["width"] / 8  # 8 x 8: the cell in row 2, column 5 (1-based), at its centre
    tab.page.mouse.move(box["x"] + 4.5 * cell, box["y"] + 1.5 * cell)
    titles = tab.value("""[...document.querySelectorAll('svg.matrix[data-view="2"] g.cells path > title')]
                          .map((t) => t.textContent)""")
    value = tab.matrix("2")[1, 4]
    assert titles == [f"bank (2) × bank (5): {value:.3f}"], titles
