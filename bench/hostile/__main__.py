"""python -m bench.hostile: the rows of bench/hostile/'s attacks, against one checkout or before and after a fix
(bench/hostile/__init__.py says what each module attacks)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.hostile import answers, bodies, floods, headers, metrics_port, signals, slow_clients
from bench.hostile.parts import OPTIONS, Row, run_rows
from service.settings import DEFAULT_MODEL_DIR

ROWS: dict[str, Row] = {
    **slow_clients.ROWS, **bodies.ROWS, **answers.ROWS, **floods.ROWS, **headers.ROWS, **signals.ROWS,
    **metrics_port.ROWS,
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="", help=f"comma-separated rows (default: all): {', '.join(ROWS)}")
    parser.add_argument("--list", action="store_true", help="print every row with what it does, and stop")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="exported model (default: the embedded)")
    parser.add_argument("--before", type=Path, help="a checkout at the commit before a fix: each row there first")
    parser.add_argument("--before-model", type=Path, help="the --before checkout's own export, if its format differs")
    parser.add_argument(
        "--tree", type=Path, default=Path(__file__).resolve().parents[2], help="the checkout served (default: this one)"
    )
    parser.add_argument("--clients", type=int, default=4, help="normal clients (maximal-answers, mixed)")
    parser.add_argument("--seconds", type=float, default=30, help="length of the mixed load (mixed)")
    args = parser.parse_args(argv)
    if args.list:
        for name, (title, _) in ROWS.items():
            print(f"{name:18} {title}")
        return 0
    names = [row for row in args.rows.split(",") if row] or list(ROWS)
    if unknown := [row for row in names if row not in ROWS]:
        parser.error(f"unknown rows {unknown}; the rows: {', '.join(ROWS)}")
    if not (args.model / "manifest.json").exists():
        raise SystemExit(f"no model at {args.model}: run `make serve` once (it exports it), or pass --model")
    OPTIONS.update(clients=args.clients, seconds=args.seconds)
    run_rows(ROWS, args.model, args.tree, names, args.before, args.before_model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
