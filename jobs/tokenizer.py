"""Entry point for ``ray job submit``: python jobs/tokenizer.py CONFIG [key=value ...] -o PATH
[--vocab-size N] [--special-tokens T ...].

Trains a byte-level BPE on a sample of the config's data.train and writes tokenizer.json to
PATH (local or s3://); exits non-zero with a one-line message when the config or data is wrong.
"""

import sys
from pathlib import Path

# With --working-dir . the package is the job's working dir, not an installed distribution.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayllm.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["tokenizer", "train", *sys.argv[1:]]))
