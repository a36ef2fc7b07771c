"""Tokenizing on a real elmo-serve (service/tokenizing.py): one address's long texts do not starve another's (a
text at a time, in turns by address), an address's characters in line are bounded, and truncate tokenizes only
what it keeps, the same tokens as the whole text's. `python -m bench.hostile --rows tokenize-turns` prints the
figures; tests/service/test_tokenizing.py checks the turns without a server."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.live_server import counter, refusal, running_server

JSON = {"content-type": "application/json"}


LONG_TEXT = " ".join(["x" * 199] * 1000)  # 200,000 characters, 1,000 tokens: Moses reads every character


def test_one_address_s_long_texts_do_not_starve_another_s_tokenizing(tiny_model_dir, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    settings = {"ELMO_TOKENIZE_THREADS": "1"}
    body = httpx.Request("POST", "/", json={"sentences": [LONG_TEXT] * 8}).content
    small = {"sentences": ["She went to the bank."]}
    with running_server(tiny_model_dir, tmp_path, settings) as server:
        stop = threading.Event()

        def attacker(_):
            transport = httpx.HTTPTransport(local_address="127.0.0.2")
            with httpx.Client(base_url=server.url, transport=transport, timeout=120) as c:
                while not stop.is_set():
                    assert c.post("/tokenize", content=body, headers=JSON).status_code in (200, 503)

        times = []
        with ThreadPoolExecutor(4) as pool:
            attacks = [pool.submit(attacker, k) for k in range(4)]
            time.sleep(1.0)  # every attacker's texts in line
            transport = httpx.HTTPTransport(local_address="127.0.0.3")
            with httpx.Client(base_url=server.url, transport=transport, timeout=120) as c:
                for _ in range(12):
                    start = time.perf_counter()
                    assert c.post("/tokenize", json=small).status_code == 200
                    times.append(time.perf_counter() - start)
                    time.sleep(0.1)
            stop.set()
            for attack in attacks:
                attack.result()
    times.sort()
    # Before: first in, first out behind up to 32 texts of 200,000 characters (seconds); in turns, behind one.
    assert times[len(times) // 2] < 0.5 and times[-1] < 1.0, times


def test_an_address_s_characters_in_tokenizing_are_bounded(tiny_model_dir, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    settings = {"ELMO_TOKENIZE_THREADS": "1", "ELMO_MAX_TOKENIZE_CHARS_PER_CLIENT": "1000000"}
    text = " ".join(["x" * 899] * 1000)  # 900,000 characters: one request is always taken, two are not
    with running_server(tiny_model_dir, tmp_path, settings) as server:
        with ThreadPoolExecutor(3) as pool:
            posts = [
                pool.submit(httpx.post, f"{server.url}/tokenize", json={"sentences": [text]}, timeout=120)
                for _ in range(3)
            ]
            statuses = sorted(p.result().status_code for p in posts)
            refused = next(p.result() for p in posts if p.result().status_code == 503)
        assert statuses[0] == 200 and 503 in statuses, statuses
        assert "texts being tokenized for your address hold" in refusal(refused)
        assert refused.headers["retry-after"] == "1"


def test_truncate_tokenizes_only_what_it_keeps_and_keeps_the_same_tokens(server, client):
    from service.text.moses import tokenize

    # Non-breaking prefixes and full stops around the cut, which Moses reads with the next word
    words = ("Dr. Smith went to the U.S. in 1999 , e.g. to see Mr. Jones . " * 600).split()
    texts = [" ".join(words[k:]) for k in range(20)]  # 20 texts of 8,400 words (13,800 by the upper bound)
    before = counter(client, "elmo_stage_seconds_sum", stage="tokenize")
    response = client.post("/tokenize", json={"sentences": texts, "truncate": True})
    moses_cpu = counter(client, "elmo_stage_seconds_sum", stage="tokenize") - before
    assert response.status_code == 200, response.text[:300]
    start = time.thread_time()
    tokenize(texts[0])
    whole_cpu = time.thread_time() - start
    for text, item in zip(texts, response.json()["data"], strict=True):
        assert item["tokens"] == tokenize(text)[:1000]  # what the whole text's tokenizing keeps
        assert item["truncated"] is True and item["original_tokens_at_least"] is True
        assert item["original_tokens"] == len(text.split())  # its words: no more than its tokens
    # Before: Moses read all 168,000 words (20 whole texts' CPU); now 20 x 1,016 of them (an eighth of that).
    assert moses_cpu < 0.4 * 20 * whole_cpu, (moses_cpu, whole_cpu)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    with running_server(tiny_model_dir, tmp_path_factory.mktemp("tokenizing")) as s:  # the default limits
        yield s


def _cpu_seconds(pid: int) -> float:
    """The CPU time of process `pid`'s own threads (not its children's), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the server's CPU time from /proc")
def test_moses_runs_off_the_interpreter_the_event_loop_needs(tiny_model_dir, tmp_path):
    # On threads of the server's process, Moses held the interpreter lock that the event loop waits for at every
    # callback: a text flood took /health/live to seconds. In processes of its own, the server's CPU while texts
    # are tokenized is its own work (the request, the answer), not Moses'.
    body = httpx.Request("POST", "/", json={"sentences": [LONG_TEXT] * 8}).content
    with running_server(tiny_model_dir, tmp_path) as server, httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.post("/tokenize", json={"sentences": ["Warm."]}).status_code == 200  # Moses loaded
        moses = counter(c, "elmo_stage_seconds_sum", stage="tokenize")
        before = _cpu_seconds(server.proc.pid)
        answers = [c.post("/tokenize", content=body, headers=JSON) for _ in range(3)]
        served = _cpu_seconds(server.proc.pid) - before
        moses = counter(c, "elmo_stage_seconds_sum", stage="tokenize") - moses
        assert all(a.status_code == 200 for a in answers), [a.text[:200] for a in answers]
        assert answers[0].json()["data"][0]["tokens"] == ["x" * 199] * 1000
        assert c.get("/health/live").status_code == 200
    assert moses > 0.1, moses  # Moses' own CPU time, as the metric reports it
    assert served < moses / 2, (served, moses)  # before: the server's CPU was Moses' and more
