"""Write a tiny random GLM-5.3-Flash checkpoint (`glmflash make-tiny` plus test variants):

    python tools/make_tiny_checkpoint.py DIR [--seed N] [--variant embedded|kpool16|recipe] [--bf16]
"""

from __future__ import annotations

import argparse

from glmflash.tiny.checkpoint import make_tiny_checkpoint
from glmflash.tiny.configs import VARIANTS
from glmflash.utils.logging import setup_logging


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="embedded")
    parser.add_argument("--bf16", action="store_true", help="unquantised layout (no FP8)")
    args = parser.parse_args()
    setup_logging()
    make_tiny_checkpoint(args.dir, seed=args.seed, variant=args.variant, fp8=not args.bf16)


if __name__ == "__main__":
    main()
