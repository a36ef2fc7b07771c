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

import importlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

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


class TokenizerDied(Exception):
    """The tokenizing process ended while it had a text (killed for memory?): that text fails, the next starts
    another."""


class TokenizingProcess:
    """`tokenize` in a process of its own, for one worker thread: `python -m service.tokenizing MODULE:NAME`, a
    text and its tokens each way on its stdin and stdout, 8 bytes of length and then the pickle. Started anew, not
    forked (a fork copies the server's threads' locks in whatever state they are), it imports only the tokenizer;
    it ends when its stdin does, so when the server goes however it went (killed, too)."""

    def __init__(self, tokenize: Callable[[str, str], list[str]]):
        self.name = f"{tokenize.__module__}:{tokenize.__qualname__}"
        self.lock = threading.Lock()
        self.process: subprocess.Popen | None = None

    def start(self) -> subprocess.Popen:
        """Started if it is not running (not waited for: it loads Moses while the server starts)."""
        with self.lock:
            if self.process is None or self.process.poll() is not None:
                command = [sys.executable, "-m", "service.tokenizing", self.name]
                self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            return self.process

    def __call__(self, text: str, language: str) -> tuple[list[str], float]:
        """The tokens of `text`, and the CPU time the process took for them. The thread waits on the pipe without
        the interpreter lock."""
        process = self.start()
        try:
            _send(process.stdin, (text, language))
            answer = _receive(process.stdout)
        except (OSError, EOFError, ValueError) as err:  # a broken pipe, or a pipe closed by shutdown
            process.kill()
            process.wait()  # reaped: its pipe can end before it does, and the next text must start another
            raise TokenizerDied(f"the tokenizing process ended ({err or type(err).__name__})") from None
        if isinstance(answer, Exception):
            raise answer
        joined, cpu = answer
        return joined.split(), cpu

    def stop(self) -> None:
        with self.lock:
            if self.process is not None:
                self.process.stdin.close()  # it ends after the text it has


def _send(pipe, value) -> None:
    payload = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    pipe.write(len(payload).to_bytes(8, "big") + payload)
    pipe.flush()


def _receive(pipe):
    header = pipe.read(8)
    if len(header) < 8:
        raise EOFError("its pipe ended")
    return pickle.loads(pipe.read(int.from_bytes(header, "big")))


def _serve(name: str) -> None:
    """The tokenizing process: texts from stdin tokenized until it ends, each answered with its tokens joined by
    spaces (a token holds no whitespace: Moses splits on it), one string rather than a list of many to pickle, and
    the CPU time they took; or with the error. A stop signal is the server's to act on (sent to the process group,
    as a terminal's Ctrl-C or systemd's stop are, it would break texts the server is draining)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to the server's log, not into the answers
    module, _, attribute = name.partition(":")
    tokenize = getattr(importlib.import_module(module), attribute)
    texts = sys.stdin.buffer
    while True:
        try:
            text, language = _receive(texts)
        except EOFError:
            return
        start = time.thread_time()
        try:
            answer = " ".join(tokenize(text, language)), time.thread_time() - start
        except Exception as err:  # the request's to report
            answer = err
        try:
            _send(answers, answer)
        except (pickle.PicklingError, TypeError, AttributeError):  # an error that does not pickle, by its words
            _send(answers, RuntimeError(f"{type(answer).__name__}: {answer}"))


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
        self.processes = [TokenizingProcess(tokenize) for _ in range(threads)] if processes else []
        self.lock = threading.Condition()
        self.lines: Turns[_Job] = Turns()  # each address's jobs with texts waiting, the addresses in turns
        self.chars = Held(per_client_chars)  # each address's characters waiting or being tokenized
        self.closed = False
        self.workers = [
            threading.Thread(target=self._work, args=(k,), name=f"tokenize-{k}", daemon=True) for k in range(threads)
        ]
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

    def warm(self) -> None:
        """The processes started (the server's start-up: they load Moses while the models load)."""
        for process in self.processes:
            process.start()

    def shutdown(self) -> None:
        with self.lock:
            self.closed = True
            for client in self.lines.addresses():
                for job in self.lines.line(client):
                    job.stop.set()
            self.lock.notify_all()
        for process in self.processes:
            process.stop()

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

    def _work(self, k: int) -> None:
        while True:
            with self.lock:
                task = self._next()
            if task is None:
                return
            job, index = task
            tokens, cpu, error = None, 0.0, None
            try:
                tokens, cpu = self._tokenize(k, job.items[index], job.language)
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

    def _tokenize(self, k: int, text: str, language: str) -> tuple[list[str], float]:
        """Worker `k`'s tokens of `text`, and the CPU time they took (its process's, where it has one)."""
        if self.processes:
            return self.processes[k](text, language)
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


if __name__ == "__main__":  # a tokenizing process (TokenizingProcess)
    _serve(sys.argv[1])
