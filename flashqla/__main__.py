"""Command line: `flashqla verify` (or `python -m flashqla verify`), `flashqla --version`.

    flashqla verify [--size small|medium] [--skip-derivations]
    flashqla --version

walks the ladder derivations -> reference -> kernels and prints a compact report; exit status 0
when every rung that could run passed.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from flashqla import __version__

    parser = argparse.ArgumentParser(prog="flashqla", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"flashqla {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("verify", help="prove the derivations, check the reference, check the kernels")
    p.add_argument("--size", choices=("small", "medium"), default="small", help="problem sizes of the numeric checks")
    p.add_argument("--skip-derivations", action="store_true", help="skip the SymPy proofs")
    args = parser.parse_args(argv)
    if args.command == "verify":
        from flashqla.verify import verify

        return verify(size=args.size, derivations=not args.skip_derivations)
    return 2


if __name__ == "__main__":
    sys.exit(main())
