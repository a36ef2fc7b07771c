"""The /explore page's figures, in Debian's Chromium (headless shell) driven by Playwright:

    python -m bench.explore [--runs 5] [--moves 60] [--full/--no-full]

- page weight: the page's HTML, JavaScript and CSS as served, uncompressed (goal: at most 100 KB);
- Embed to full render: from the Embed press to every view drawn (the page's own clock), 8 sentences of about 15
  tokens on the default model (goal: under 1.0 s), and 40 such sentences on the full-size architecture, dim 1024,
  random weights (goal: under 2.5 s); the server's own time for the same request beside it;
- a slider move to the views redrawn (the page's mix recomputed, every view drawn again and laid out): p95 on the
  default model with the 8 sentences (goal: under 30 ms), at dim 1024 with 40 occurrences (goal: under 100 ms).

Each server runs on one ONNX Runtime thread; the browser on what is left. Prints the CPU's flags and the load beside
the figures. The launch of the browser is here (tests/e2e/test_explore.py uses it too)."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import httpx

from bench.common import full_size_model, percentiles, start_server

CHROMIUM = Path(os.environ.get("ELMO_CHROMIUM", "/usr/lib/chromium/chromium-headless-shell"))
# Nothing of the browser's own calls out (updates, sync, field trials), no GPU process, and no sandbox: the tests
# run as whatever user CI is, root in containers, where Chromium's sandbox cannot start.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
INSTALL = (
    "the browser tests need Debian's Chromium headless shell and Playwright for Python: `make browser` "
    "(apt-get install -y --no-install-recommends chromium-headless-shell; pip install playwright from the dev "
    "lock), never `playwright install`, whose download cannot work here"
)
PAGE_FILES = ["/explore", "/explore/app.js", "/explore/vectors.js", "/explore/explore.css"]
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "service" / "embedded" / "default"


def browser_missing() -> str | None:
    """Why the browser cannot start here (what to install), or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return f"Playwright for Python is not installed: {INSTALL}"
    if not (CHROMIUM.is_file() or shutil.which(str(CHROMIUM))):
        return f"{CHROMIUM} is missing: {INSTALL}"
    return None


def launch_chromium(playwright):
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True)


def chromium_version() -> str:
    import subprocess

    done = subprocess.run([str(CHROMIUM), "--version"], capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def wait_until(page, expression: str, timeout_s: float = 120):
    """Poll `expression` in the page until it is truthy; its value. (Playwright's wait_for_function evaluates a
    string in the page, which the page's Content-Security-Policy forbids; evaluate goes through the debugger.)"""
    deadline = time.monotonic() + timeout_s
    while not (value := page.evaluate(expression)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true within {timeout_s} s: {expression}")
        time.sleep(0.02)
    return value


def embed_and_wait(page, timeout_s: float = 120) -> float:
    """Press Embed and wait for every view; the page's Embed-to-render milliseconds."""
    page.evaluate("window.elmoExplore.timings.embedToRender = null")
    page.click("#embed")
    return wait_until(page, "window.elmoExplore.timings.embedToRender", timeout_s)


# One slider move as a person makes it (the input event), to the views redrawn and laid out.
SLIDER_MOVES = """(moves) => {
  const input = document.getElementById("weight-0");
  const times = [];
  for (let i = 0; i < moves; i++) {
    const t0 = performance.now();
    input.value = String(((i % 20) - 10) / 4);
    input.dispatchEvent(new Event("input", { bubbles: true }));
    document.body.getBoundingClientRect();
    void document.body.offsetHeight;
    times.push(performance.now() - t0);
  }
  return times;
}"""


def measure(url: str, sentences: list[str], word: str, runs: int, moves: int) -> dict:
    from playwright.sync_api import sync_playwright

    body = {"sentences": sentences, "output": "layers", "encoding": "base64"}
    server_s = []
    for _ in range(runs):
        t0 = time.perf_counter()
        httpx.post(f"{url}/embed", json=body, timeout=300).raise_for_status()
        server_s.append(time.perf_counter() - t0)
    with sync_playwright() as p:
        browser = launch_chromium(p)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{url}/explore")
        wait_until(page, "document.getElementById('model').options.length")
        page.fill("#sentences", "\n".join(sentences))
        renders = [embed_and_wait(page) for _ in range(runs + 1)][1:]  # the first warms the page's code
        page.evaluate("(w) => window.elmoExplore.pickWord(w)", word)
        occurrences = page.evaluate("window.elmoExplore.state.occurrences.length")
        page.evaluate(SLIDER_MOVES, 10)  # warm
        slider = page.evaluate(SLIDER_MOVES, moves)
        browser.close()
    return {
        "occurrences": occurrences,
        "render_ms": statistics.median(renders),
        "render_all": renders,
        "server_ms": 1000 * statistics.median(server_s),
        "slider": percentiles(slider),
    }


def example(word: str = "bank") -> list[str]:
    """The page's own example for `word` (8 sentences of 15 to 17 tokens), read from its script."""
    import re

    text = (DEFAULT_MODEL.parents[1] / "api" / "explore" / "app.js").read_text()
    block = re.search(rf"  {word}: \[(.*?)\],\n", text, re.S).group(1)
    return re.findall(r'"(.*?)"', block)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--moves", type=int, default=60)
    parser.add_argument("--full", action=argparse.BooleanOptionalAction, default=True, help="also at dim 1024")
    args = parser.parse_args()
    missing = browser_missing()
    if missing:
        raise SystemExit(missing)
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = next((line.split(":", 1)[1] for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")), "")
    print(f"{model or platform.machine()}, {os.cpu_count()} cores; {chromium_version()}")
    print(f"cpu flags:{flags}")
    sentences = example()
    cases = [("default model", DEFAULT_MODEL, sentences)]
    if args.full:
        cases.append(("full size, dim 1024, random weights", full_size_model() / "onnx", sentences * 5))
    for name, model, texts in cases:
        server, url, _ = start_server(model, threads=1)
        try:
            weight = sum(len(httpx.get(f"{url}{path}").content) for path in PAGE_FILES)
            tokenized = httpx.post(f"{url}/tokenize", json={"sentences": texts}).json()["data"]
            tokens = sum(len(item["tokens"]) for item in tokenized)
            load = os.getloadavg()[0]
            got = measure(url, texts, "bank", args.runs, args.moves)
        finally:
            server.terminate()
            server.wait()
        s = got["slider"]
        print(f"\n{name}: {len(texts)} sentences, {tokens} tokens, {got['occurrences']} occurrences of 'bank'")
        print(f"  page weight            {weight:,} B (HTML + JS + CSS, uncompressed)")
        each = ", ".join(f"{x:.0f}" for x in got["render_all"])
        print(f"  Embed to full render   {got['render_ms']:.0f} ms median of {args.runs} ({each}); "
              f"the server alone {got['server_ms']:.0f} ms")  # fmt: skip
        print(f"  slider move to redrawn p50 {s['p50']:.1f} ms, p95 {s['p95']:.1f} ms, p99 {s['p99']:.1f} ms "
              f"({args.moves} moves)")  # fmt: skip
        print(f"  load average at start  {load:.1f}; end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
