"""Moses in processes of its own, fed by threads in turns by client address (service/turns.py), as the batcher's
queue takes sentences. Tokenizing a text is service/text/'s job; which text is tokenized first, admission's, and
so here.

A first-in, first-out pool let one address starve everyone's tokenizing: Moses costs 0.2-0.6 s per million
characters, and two connections looping 8 texts of 999,000 characters took other clients' text requests from
15 ms to 358 ms median and 8.6 s p99. Here a worker takes one text at a time, from the address whose turn it is,
and that address goes to the back of the line: another address's text waits for at most one text per address
ahead of it, not for everything one address sent. And the characters an address has waiting or being tokenized
are bounded (`per_client_chars`): over it, 503 with Retry-After, before any of it is queued.

Moses is pure Python: on threads beside the event loop it held the interpreter lock, and the loop, which gives the
lock up at every callback's I/O, waited up to the switch interval (5 ms) for it back each time. 300 connections
looping 4 texts of 150 words took /health/live to 8.7 s and other clients' small requests to p99 9.6 s. In
processes, the threads only wait on a pipe, lock released: Moses runs on other cores, and the loop keeps its lock."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from service.errors import Overloaded
from service.turns import Held, Turns


class Abandoned(Exception):
    """The request's client has gone: its texts left the line."""


class _Job:
    """One request's texts: tokens by index as they are done."""

    def __init__(self, client: str, items: list, language: str, stop: threading.Event, chars: int):
        self.client, self.items, self.language, self.stop, self.chars = client, items, language, stop, chars
        self.waiting = deque(i for i, x in enumerate(items) if isinstance(x, str))
        self.running = 0
        self.result: list = list(items)  # a list of tokens stays as it is
        self.future: Future = Future()
        self.cpu = 0.0


def _child_start(parent: int) -> None:
    """A tokenizing process's start: a stop signal is the server's to act on (sent to the process group, as a
    terminal's Ctrl-C or systemd's stop are, it would break texts being tokenized while the server drains), and the
    process ends once its server has gone, however it went (killed, its pipes are not closed for it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=orphaned, daemon=True).start()


def _in_child(tokenize: Callable[[str, str], list[str]], text: str, language: str) -> tuple[str, float]:
    """The tokens of `text` as one string, and the CPU time they took: a token holds no whitespace (Moses splits
    on it), so they are joined by spaces, and one string crosses the pipe, not a list of many."""
    start = time.thread_time()
    joined = " ".join(tokenize(text, language))
    return joined, time.thread_time() - start


class Processes:
    """`tokenize` in `count` processes of its own, started on first use or by `warm`; one that dies (killed for
    memory) fails the texts it had, and the next text starts them again. `tokenize` must pickle (a module's
    function): only its name crosses."""

    def __init__(self, tokenize: Callable[[str, str], list[str]], count: int):
        self.tokenize, self.count = tokenize, count
        self.lock = threading.Lock()
        self.pool = self._pool()

    def _pool(self) -> ProcessPoolExecutor:
        # spawned, not forked: a fork copies the server's threads' locks in whatever state they are
        context = multiprocessing.get_context("spawn")
        return ProcessPoolExecutor(self.count, context, initializer=_child_start, initargs=(os.getpid(),))

    def warm(self, language: str) -> None:
        """Each process started and its Moses loaded, not waited for."""
        for _ in range(self.count):
            self.pool.submit(_in_child, self.tokenize, "", language)

    def __call__(self, text: str, language: str) -> tuple[list[str], float]:
        pool = self.pool
        try:
            joined, cpu = pool.submit(_in_child, self.tokenize, text, language).result()
        except BrokenProcessPool:
            with self.lock:
                if self.pool is pool:
                    self.pool = self._pool()
            raise
        return joined.split(), cpu

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class TokenizeTurns:
    """`threads` workers running `tokenize(text, language)` for requests in turns by client address; with
    `processes`, each in a process of its own (the server's way: see above), else on the thread itself."""

    def __init__(
        self,
        threads: int,
        per_client_chars: int,
        tokenize: Callable[[str, str], list[str]],
        observe=None,
        processes: bool = False,
    ):
        self.per_client_chars, self.tokenize, self.observe = per_client_chars, tokenize, observe
        self.processes = Processes(tokenize, threads) if processes else None
        self.lock = threading.Condition()
        self.lines: Turns[_Job] = Turns()  # each address's jobs with texts waiting, the addresses in turns
        self.chars = Held(per_client_chars)  # each address's characters waiting or being tokenized
        self.closed = False
        self.workers = [threading.Thread(target=self._work, name=f"tokenize-{k}", daemon=True) for k in range(threads)]
        for worker in self.workers:
            worker.start()

    def submit(self, client: str, items: list, language: str, stop: threading.Event) -> Future:
        """A future of `items` with every text tokenized; Overloaded (nothing queued) if the address's characters
        in flight would pass the bound."""
        chars = sum(len(x) for x in items if isinstance(x, str))
        with self.lock:
            if not self.chars.fits(client, chars):  # one request alone is always taken
                raise Overloaded(
                    f"overloaded: texts being tokenized for your address hold {self.chars[client]} of "
                    f"{self.per_client_chars} characters; retry later"
                )
            job = _Job(client, items, language, stop, chars)
            self.chars.add(client, chars)
            if not job.waiting:
                self._finish(job)
                return job.future
            self.lines.put(client, job)
            self.lock.notify()
        return job.future

    def held(self, client: str) -> int:
        with self.lock:
            return self.chars[client]

    def warm(self, language: str) -> None:
        if self.processes is not None:
            self.processes.warm(language)

    def shutdown(self) -> None:
        with self.lock:
            self.closed = True
            for client in self.lines.addresses():
                for job in self.lines.line(client):
                    job.stop.set()
            self.lock.notify_all()
        if self.processes is not None:
            self.processes.shutdown()

    def _next(self) -> tuple[_Job, int] | None:
        """The next text: the first waiting one of the first address in line, which then goes to the back."""
        while True:
            if self.closed:
                return None
            for client in self.lines.addresses():
                line = self.lines.line(client)
                while line and line[0].stop.is_set():  # its client has gone: the rest of its texts never run
                    job = self.lines.pop(client)
                    job.waiting.clear()
                    if not job.running:
                        self._finish(job)
                    line = self.lines.line(client)
                if not line:
                    continue
                job = line[0]
                if job.waiting:
                    index = job.waiting.popleft()
                    job.running += 1
                    if not job.waiting:
                        self.lines.pop(client)
                    self.lines.turn_over(client)  # its turn is over
                    return job, index
            self.lock.wait(timeout=1.0)  # woken by a new job; the timeout finds jobs whose clients have gone

    def _work(self) -> None:
        while True:
            with self.lock:
                task = self._next()
            if task is None:
                return
            job, index = task
            tokens, cpu, error = None, 0.0, None
            try:
                tokens, cpu = self._tokenize(job.items[index], job.language)
            except Exception as err:  # handed to the request, never lost on the thread
                error = err
            with self.lock:
                job.cpu += cpu
                job.running -= 1
                if error is not None and not job.future.done():
                    job.stop.set()
                    job.future.set_exception(error)
                job.result[index] = tokens
                if not job.running and not job.waiting:
                    self._finish(job)

    def _tokenize(self, text: str, language: str) -> tuple[list[str], float]:
        """The tokens of `text`, and the CPU time they took (the process's, where it ran in one)."""
        if self.processes is not None:
            return self.processes(text, language)
        start = time.thread_time()
        return self.tokenize(text, language), time.thread_time() - start

    def _finish(self, job: _Job) -> None:
        """The job leaves: its characters leave the address's bound, its future gets its result (lock held)."""
        if job.chars:
            self.chars.add(job.client, -job.chars)
            job.chars = 0
        if job.future.done():
            return
        if job.stop.is_set():
            job.future.set_exception(Abandoned())
            return
        if self.observe is not None:
            self.observe("tokenize", job.cpu)
        job.future.set_result(job.result)
