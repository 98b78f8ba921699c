"""Entry point for ``ray job submit``: python jobs/pretrain.py CONFIG [key=value ...]."""

import sys

from rayllm.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
