"""Data preparation: raw documents to cleaned, deduplicated parquet shards, as a Ray Data job.

from rayllm.prepare import PrepareConfig, prepare
report = prepare(PrepareConfig.from_yaml("configs/prepare-demo.yaml"))
"""

from rayllm.prepare.config import PrepareConfig

__all__ = ["PrepareConfig", "prepare"]


def prepare(config: PrepareConfig, *, quiet: bool = False) -> dict:
    """Run the prepare job (``rayllm.prepare.job``); returns the report that is also saved as _report.json."""
    from rayllm.prepare.job import prepare as _prepare

    return _prepare(config, quiet=quiet)
