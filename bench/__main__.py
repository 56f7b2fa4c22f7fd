"""`python -m bench [--quick]`: run the flyd benchmarks, print a table, write JSON."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench.flyd_bench import run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="smaller counts and shorter loops (a smoke test)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parent / "results" / "flyd.json",
        help="where to write the JSON results (default: bench/results/flyd.json)",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit with status 1 when a target is missed"
    )
    parser.add_argument(
        "--no-bytecode-cache",
        action="store_true",
        help="start flyd with this environment's bytecode settings as they are (by default the "
        "run caches flyd's bytecode in its temp dir, as an installed flyd would have it)",
    )
    args = parser.parse_args(argv)
    return run(
        quick=args.quick,
        out=args.out,
        strict=args.strict,
        bytecode_cache=not args.no_bytecode_cache,
    )


if __name__ == "__main__":
    sys.exit(main())
