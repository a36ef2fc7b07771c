"""Hostile clients beside normal ones, against real elmo-serve processes with the default limits, named by attack
(not part of the tests: a row takes from seconds to minutes). One runner, `python -m bench.hostile`, serves each
row on a server of its own, the code of `--tree` (this checkout), or with `--before DIR` that of an earlier checkout
first and then this one, back to back on the same machine, each figure with the CPU's flags and the load:

    .venv/bin/python -m bench.hostile [--rows NAME,NAME] [--before DIR [--before-model EXPORT]] [--tree DIR]
        [--model DIR] [--clients 4] [--seconds 30] [--list]

The attacks, a module each (`--list` prints every row with what it does):

- slow_clients.py: uploads stalled or trickling to hold the body budget, readers that never read the static files'
  answers, bodies answered early and then sent a byte more, bodies in 1-byte chunks;
- bodies.py: body bombs (punctuation Moses splits into millions of tokens, a million wrong items, bodies that parsed
  for seconds on the event loop, texts that made Moses slow, texts over the queue however they are cut);
- answers.py: answers at the answer limit beside small clients, answers and pipelines never read;
- floods.py: one address's hundreds of connections on /embed (mixed requests or texts), its idle connections at a
  1024 open-files limit, its long texts in line for Moses, and everything at once beside normal clients;
- headers.py: requests whose framing or headers lie (a key in a chunked trailer, WebSocket upgrades, a spoofed
  X-Forwarded-For);
- signals.py: a second SIGTERM or SIGINT while the engine computes, SIGHUP with requests in flight;
- metrics_port.py: the metrics port under hostile connections and scrapers.

What passes or fails rather than measures (a tampered model refused, no control bytes in the log, bad settings
refused, ETags) is a test, not a row: tests/e2e/ and tests/service/engine/test_canary.py. docs/limits.md's
"Measured" table names the row that prints each figure. parts.py holds what the rows share and the runner."""
