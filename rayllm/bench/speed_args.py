"""``rayllm bench speed``'s arguments, in a module without torch: the CLI parses them at start,
and ``python -m rayllm.bench.speed`` parses the same ones without importing the CLI."""

from __future__ import annotations

import argparse

HELP = "rayllm's step against a bare PyTorch loop, MFU, tokens/s on 1 and 2 workers, peak memory"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("config", nargs="?", default="configs/tiny.yaml", help="config whose model to time")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, for example train.compile=true")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of each side")
    parser.add_argument("--steps", type=int, default=4, help="steps per round")
    parser.add_argument("--workers", default="1,2", help="worker counts to time on CPU ('' to skip)")
    parser.add_argument("--memory-steps", type=int, default=3, help="steps per memory variant (0 to skip)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    return parser
