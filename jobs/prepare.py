"""Entry point for ``ray job submit``: python jobs/prepare.py CONFIG [key=value ...].

Cleans a corpus as the prepare config says (see configs/prepare-demo.yaml) and prints the
report; exits non-zero with a one-line message when the config or the data is wrong.
"""

import sys
from pathlib import Path

# With --working-dir . the package is the job's working dir, not an installed distribution.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayllm.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["prepare", *sys.argv[1:]]))
