"""Entry point for ``ray job submit``: python jobs/pretrain.py CONFIG [key=value ...].

Exits non-zero with a one-line message when the config, data or training fails.
"""

import sys
from pathlib import Path

# With --working-dir . the package is the job's working dir, not an installed distribution.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayllm.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
