"""`python -m bench [--quick] [--full] [--only flyd|registry|proxy|auth|flaps|fencing|console|hosts]
[--drivers process,oci]`: run the benchmarks, print tables (flyd's and the proxy control
plane's with both drivers side by side), write JSON to bench/results/."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bench import (
    auth_bench,
    console_bench,
    fencing_bench,
    flaps_bench,
    hosts_bench,
    proxy_bench,
    proxy_control_bench,
    registry_bench,
)
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
    parser.add_argument(
        "--full",
        action="store_true",
        help="the flaps benchmark's simulated workers hold 100 machines each instead of 20",
    )
    parser.add_argument(
        "--only",
        choices=["flyd", "registry", "proxy", "auth", "flaps", "fencing", "console", "hosts"],
        help="run one group of benchmarks",
    )
    parser.add_argument(
        "--drivers",
        default="process,oci",
        help="flyd drivers to measure side by side (comma-separated; default: process,oci)",
    )
    args = parser.parse_args(argv)
    drivers = tuple(d for d in args.drivers.split(",") if d)
    if not drivers or not set(drivers) <= {"process", "oci"}:
        parser.error("--drivers: a comma-separated list of process and oci")
    codes = []
    if args.only in (None, "flyd"):
        codes.append(
            run(
                quick=args.quick,
                out=args.out,
                strict=args.strict,
                bytecode_cache=not args.no_bytecode_cache,
                drivers=drivers,
            )
        )
    if args.only in (None, "registry"):
        codes.append(
            registry_bench.run(
                quick=args.quick, out=args.out.with_name("registry.json"), strict=args.strict
            )
        )
    if args.only in (None, "proxy"):
        codes.append(
            proxy_bench.run(
                quick=args.quick, out=args.out.with_name("proxy.json"), strict=args.strict
            )
        )
        codes.append(
            proxy_control_bench.run(
                quick=args.quick,
                out=args.out.with_name("proxy-control.json"),
                strict=args.strict,
                drivers=drivers,
            )
        )
    if args.only in (None, "fencing"):
        codes.append(
            fencing_bench.run(
                quick=args.quick, out=args.out.with_name("fencing.json"), strict=args.strict
            )
        )
    if args.only in (None, "auth"):
        codes.append(
            auth_bench.run(
                quick=args.quick, out=args.out.with_name("auth.json"), strict=args.strict
            )
        )
    if args.only in (None, "flaps"):
        codes.append(
            flaps_bench.run(
                quick=args.quick,
                full=args.full,
                out=args.out.with_name("flaps.json"),
                strict=args.strict,
            )
        )
    if args.only in (None, "console"):
        codes.append(
            console_bench.run(
                quick=args.quick, out=args.out.with_name("console.json"), strict=args.strict
            )
        )
    if args.only in (None, "hosts"):
        codes.append(
            hosts_bench.run(
                quick=args.quick, out=args.out.with_name("hosts.json"), strict=args.strict
            )
        )
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
