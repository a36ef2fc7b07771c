"""The /explore page's figures, in Debian's Chromium (headless shell) driven by Playwright:

    python -m bench.explore [--runs 5] [--moves 60] [--full/--no-full] [--threads 1,2] [--before CHECKOUT]

- page weight: the page's HTML, JavaScript and CSS as served, uncompressed (goal: at most 100 KB);
- Embed to full render: from the Embed press to every view drawn and laid out (the page's own clock), 8 sentences
  of about 15 tokens on the default model (goal: under 1.0 s), and 40 such sentences on the full-size
  architecture, dim 1024, random weights (goal: under 2.5 s); the server alone for the same request beside it, and
  where the time goes: the request to its answer's first byte (the server), the body's transfer (the browser's
  Resource Timing), then the page's laps (body received, parsed, controls, the layers' dot products, cosines,
  neighbours and PCA, views drawn, laid out);
- a slider move to the views redrawn (the page's mix recomputed, every view drawn again and laid out): p95 on the
  default model with the 8 sentences (goal: under 30 ms), at dim 1024 with 40 occurrences (goal: under 100 ms).

The server runs on each of --threads' ONNX Runtime thread counts in turn (default 1, and 2: the host's cores, what
`make serve` takes there; the server computes while the page waits, and the page after, so they take turns, but
on a host whose cores other jobs hold, two threads lose more than they gain); --before CHECKOUT measures another
checkout's page and server first (on --before-threads, default 1: how the figures were first taken), back to back
in this process. Prints the CPU's flags and the load beside the figures. The launch of the browser is here
(tests/e2e/test_explore.py uses it too)."""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import httpx

from bench.common import ROOT, full_size_model, percentiles, start_server

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


# Where an Embed's time goes, from the browser's own records of the /embed request (Resource Timing) and the page's
# laps (timings.embedParts): the request sent to its first byte back (the server: tokenizing, the engine,
# composing and encoding the answer), the body's transfer, then the page's own parts.
EMBED_TIMING = """() => {
  const all = performance.getEntriesByType("resource").filter((e) => e.name.endsWith("/embed"));
  const e = all[all.length - 1];
  performance.clearResourceTimings();
  return { server: e.responseStart - e.requestStart, transfer: e.responseEnd - e.responseStart,
           bytes: e.encodedBodySize, parts: window.elmoExplore.timings.embedParts || {} };
}"""


def server_alone(url: str, sentences: list[str], runs: int, npz: bool) -> float:
    """The median seconds of the page's /embed request (the layers; base64 in JSON, or the .npz answer) sent
    from Python, the body read whole."""
    body = {"sentences": sentences, "output": "layers"} | ({} if npz else {"encoding": "base64"})
    headers = {"accept": "application/x-npz"} if npz else {}
    seconds = []
    for _ in range(runs):
        t0 = time.perf_counter()
        httpx.post(f"{url}/embed", json=body, headers=headers, timeout=300).raise_for_status()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def stage_totals(url: str) -> dict[str, tuple[float, float]]:
    """The server's elmo_stage_seconds by stage: (sum, count) so far."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in ("elmo_stage_seconds_sum", "elmo_stage_seconds_count"):
                totals.setdefault(sample.labels["stage"], [0.0, 0.0])[sample.name.endswith("count")] += sample.value
    return {stage: (total, count) for stage, (total, count) in totals.items()}


def measure(url: str, sentences: list[str], word: str, runs: int, moves: int) -> dict:
    from playwright.sync_api import sync_playwright

    server_s = {"base64": server_alone(url, sentences, runs, False), "npz": server_alone(url, sentences, runs, True)}
    stages_before = stage_totals(url)
    with sync_playwright() as p:
        browser = launch_chromium(p)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{url}/explore")
        wait_until(page, "document.getElementById('model').options.length")
        page.fill("#sentences", "\n".join(sentences))
        renders, laps = [], []
        for _ in range(runs + 1):  # the first warms the page's code
            renders.append(embed_and_wait(page))
            laps.append(page.evaluate(EMBED_TIMING))
        renders, laps = renders[1:], laps[1:]
        stages_after = stage_totals(url)
        page.evaluate("(w) => window.elmoExplore.pickWord(w)", word)
        occurrences = page.evaluate("window.elmoExplore.state.occurrences.length")
        page.evaluate(SLIDER_MOVES, 10)  # warm
        slider = page.evaluate(SLIDER_MOVES, moves)
        browser.close()
    return {
        "occurrences": occurrences,
        "render_ms": statistics.median(renders),
        "render_all": renders,
        "server_ms": {k: 1000 * v for k, v in server_s.items()},
        "laps": laps,
        # the page's Embeds' mean per stage, in the server (parse, tokenize, compose, encode: CPU; engine: wall,
        # queued and computed)
        "stages": {
            stage: 1000 * (total - stages_before.get(stage, (0, 0))[0]) / (count - stages_before.get(stage, (0, 0))[1])
            for stage, (total, count) in stages_after.items()
            if count > stages_before.get(stage, (0, 0))[1]
        },
        "slider": percentiles(slider),
    }


def example(word: str = "bank") -> list[str]:
    """The page's own example for `word` (8 sentences of 15 to 17 tokens), read from its script."""
    import re

    text = (DEFAULT_MODEL.parents[1] / "api" / "explore" / "app.js").read_text()
    block = re.search(rf"  {word}: \[(.*?)\],\n", text, re.S).group(1)
    return re.findall(r'"(.*?)"', block)


def report(name: str, texts: list[str], tokens: int, weight: int, got: dict, load: tuple[float, float], args) -> None:
    s = got["slider"]
    print(f"\n{name}: {len(texts)} sentences, {tokens} tokens, {got['occurrences']} occurrences of 'bank'")
    print(f"  page weight            {weight:,} B (HTML + JS + CSS, uncompressed)")
    each = ", ".join(f"{x:.0f}" for x in got["render_all"])
    alone = ", ".join(f"{k} {v:.0f} ms" for k, v in got["server_ms"].items())
    print(f"  Embed to full render   {got['render_ms']:.0f} ms median of {args.runs} ({each}); "
          f"the server alone (from Python): {alone}")  # fmt: skip
    laps = got["laps"]
    mb = statistics.median(lap["bytes"] for lap in laps) / 1e6
    where = [("request to first byte (server)", statistics.median(lap["server"] for lap in laps)),
             (f"body transfer ({mb:.1f} MB)", statistics.median(lap["transfer"] for lap in laps))]  # fmt: skip
    where += [(f"page: {k}", statistics.median(lap["parts"][k] for lap in laps)) for k in laps[0]["parts"]]
    after = statistics.median(r - lap["server"] for r, lap in zip(got["render_all"], laps, strict=True))
    where.append(("after the first byte (transfer + page)", after))
    print("  where it goes (medians, ms; the page's parts include the transfer where they wait on it)")
    stages = ", ".join(f"{stage} {ms:.0f}" for stage, ms in got["stages"].items())
    print(f"    the server's stages, mean per Embed (ms; /metrics): {stages}")
    for label, ms in where:
        print(f"    {label:<40} {ms:8.1f}")
    print(f"  slider move to redrawn p50 {s['p50']:.1f} ms, p95 {s['p95']:.1f} ms, p99 {s['p99']:.1f} ms "
          f"({args.moves} moves)")  # fmt: skip
    print(f"  load average at start  {load[0]:.1f}; end {load[1]:.1f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--moves", type=int, default=60)
    parser.add_argument("--full", action=argparse.BooleanOptionalAction, default=True, help="also at dim 1024")
    parser.add_argument("--default", action=argparse.BooleanOptionalAction, default=True, help="the default model")
    parser.add_argument("--threads", default="1,2", help="the server's ONNX Runtime threads, comma-separated: each "
                        "measured in turn (default: one, and the host's two cores)")  # fmt: skip
    parser.add_argument("--before", type=Path, help="another checkout (its page and server) measured first, as a "
                        "baseline, back to back with this one")  # fmt: skip
    parser.add_argument("--before-threads", type=int, default=1, help="the baseline server's threads")
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
    cases = [("default model", DEFAULT_MODEL, sentences)] if args.default else []
    if args.full:
        cases.append(("full size, dim 1024, random weights", full_size_model() / "onnx", sentences * 5))
    checkouts = [(f"before ({args.before})", args.before.resolve(), args.before_threads)] if args.before else []
    checkouts += [("this checkout", ROOT, int(threads)) for threads in args.threads.split(",")]
    for name, model, texts in cases:
        for which, root, threads in checkouts:
            server, url, _ = start_server(model, threads=threads, root=root)
            try:
                weight = sum(len(httpx.get(f"{url}{path}").content) for path in PAGE_FILES)
                tokenized = httpx.post(f"{url}/tokenize", json={"sentences": texts}).json()["data"]
                tokens = sum(len(item["tokens"]) for item in tokenized)
                load = os.getloadavg()[0]
                got = measure(url, texts, "bank", args.runs, args.moves)
            finally:
                server.terminate()
                server.wait()
            title = f"{name}; {which}, the server on {threads} ONNX Runtime thread{'s' if threads > 1 else ''}"
            report(title, texts, tokens, weight, got, (load, os.getloadavg()[0]), args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
