"""The typed config tree of a ``rayllm prepare`` job: the only place its defaults live.

Built with the same builder as the training config (``rayllm.config.base.RootConfig``), so
unknown keys name the nearest valid key and wrong types name the key, before Ray starts.
The filter defaults are the Gopher quality rules (Rae et al. 2021, "MassiveText quality
filter") for English prose; set a threshold to null to turn that filter off, or
``filters.enabled: false`` to turn them all off (code and other non-prose corpora fail
prose rules: see configs/prepare-demo.yaml).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from rayllm.config.base import RootConfig
from rayllm.errors import ConfigError
from rayllm.io.settings import StorageSettings

DEFAULT_SHARD_ROWS = 50_000


@dataclass
class InputSettings:
    """Raw documents: a path, glob, folder or list of them, local or s3://."""

    path: str | list[str] = "data/demo/train"
    text_field: str = "text"
    # Write the bundled demo corpus first when `path` points at the missing demo folder.
    demo_corpus: bool = True


@dataclass
class OutputSettings:
    """Where the cleaned parquet shards (``id``, ``text``) and _report.json go, local or s3://.

    Set at most one of ``shard_rows`` (rows per file) and ``num_shards`` (files); with
    neither, files hold up to 50,000 rows. The folder's previous contents are replaced.
    """

    path: str = "data/demo-clean"
    shard_rows: int | None = None
    num_shards: int | None = None


@dataclass
class NormalizeSettings:
    """Text clean-up before filtering and hashing, so equal-looking documents compare equal."""

    # "NFC" (canonical composition), "NFKC" (also folds compatibility forms such as ligatures), or "none".
    unicode_form: str = "NFC"
    # Drop control characters (not tab or newline) and invisible zero-width marks.
    strip_control: bool = True
    # One newline convention (\n), no trailing spaces, at most one blank line in a row.
    newlines: bool = True
    # Runs of spaces/tabs become one space and lines lose their indentation; off for code.
    collapse_spaces: bool = True


@dataclass
class FilterSettings:
    """Quality thresholds; null turns one filter off. A document goes at the first filter it fails."""

    enabled: bool = True
    min_chars: int | None = None
    max_chars: int | None = None
    min_words: int | None = 50
    max_words: int | None = 100_000
    min_mean_word_length: float | None = 3.0
    max_mean_word_length: float | None = 10.0
    # Occurrences of "#", or of an ellipsis ("..." or "…"), per word.
    max_symbol_word_ratio: float | None = 0.1
    max_bullet_lines_fraction: float | None = 0.9
    max_ellipsis_lines_fraction: float | None = 0.3
    min_alpha_words_fraction: float | None = 0.8
    # Of the non-space characters, the share that is neither a letter nor a digit (not a Gopher rule).
    max_non_alnum_chars_fraction: float | None = 0.25
    max_duplicate_lines_fraction: float | None = 0.3
    max_duplicate_line_chars_fraction: float | None = 0.2
    # Word characters covered by the most frequent word n-gram.
    max_top_2gram_chars_fraction: float | None = 0.20
    max_top_3gram_chars_fraction: float | None = 0.18
    max_top_4gram_chars_fraction: float | None = 0.16
    # Word characters covered by word n-grams that occur more than once.
    max_duplicate_5gram_chars_fraction: float | None = 0.15
    max_duplicate_6gram_chars_fraction: float | None = 0.14
    max_duplicate_7gram_chars_fraction: float | None = 0.13
    max_duplicate_8gram_chars_fraction: float | None = 0.12
    max_duplicate_9gram_chars_fraction: float | None = 0.11
    max_duplicate_10gram_chars_fraction: float | None = 0.10

    def thresholds(self) -> dict[str, float]:
        """The filters that are on, by name, in the order they are checked."""
        if not self.enabled:
            return {}
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "enabled" and getattr(self, f.name) is not None
        }


@dataclass
class ExactDedupSettings:
    """Keep one document per content hash of the normalised text (the lowest id)."""

    enabled: bool = True


@dataclass
class NearDedupSettings:
    """MinHash + LSH over word shingles across the whole corpus; one document per cluster survives.

    ``bands`` x ``rows`` signature values make the LSH buckets; left null they are derived
    from ``threshold`` (for 128 permutations and 0.7: 16 x 8, whose S-curve midpoint
    (1/16)^(1/8) is about 0.71). With ``verify`` a candidate pair counts only when the
    signatures estimate a Jaccard similarity of at least ``threshold``.
    """

    enabled: bool = True
    num_perm: int = 128
    ngram: int = 5  # words per shingle
    bands: int | None = None
    rows: int | None = None
    threshold: float = 0.7
    verify: bool = True
    seed: int = 0

    def lsh_shape(self) -> tuple[int, int]:
        """(bands, rows): as given, or the split of num_perm whose threshold is closest to ``threshold``."""
        if self.bands and self.rows:
            return self.bands, self.rows
        if self.bands or self.rows:
            given = self.bands or self.rows
            other = max(1, self.num_perm // given)
            return (given, other) if self.bands else (other, given)
        splits = [(self.num_perm // r, r) for r in range(1, self.num_perm + 1) if self.num_perm % r == 0]
        return min(splits, key=lambda br: abs((1 / br[0]) ** (1 / br[1]) - self.threshold))


@dataclass
class DedupSettings:
    exact: ExactDedupSettings = field(default_factory=ExactDedupSettings)
    near: NearDedupSettings = field(default_factory=NearDedupSettings)


@dataclass
class TokenizeSettings:
    """Optionally also write pre-tokenised shards (format: ``rayllm.prepare.job``)."""

    # A tokenizer.json (local or s3://); when set, token counts in the report use it too.
    tokenizer: str | None = None
    # Where the token shards go; default: the output path with "-tokens" appended.
    output: str | None = None


@dataclass
class ClusterSettings:
    """Ray to run on: unset means RAY_ADDRESS when set, else a local Ray on 127.0.0.1."""

    address: str | None = None


@dataclass(repr=False)  # RootConfig.__repr__: redacted
class PrepareConfig(RootConfig):
    """The whole prepare job."""

    input: InputSettings = field(default_factory=InputSettings)
    output: OutputSettings = field(default_factory=OutputSettings)
    storage: StorageSettings = field(default_factory=StorageSettings)
    normalize: NormalizeSettings = field(default_factory=NormalizeSettings)
    filters: FilterSettings = field(default_factory=FilterSettings)
    dedup: DedupSettings = field(default_factory=DedupSettings)
    tokenize: TokenizeSettings = field(default_factory=TokenizeSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    # A shard that cannot be read: "error" stops the job naming it; "skip" leaves it out and reports it.
    on_bad_shard: str = "error"

    @property
    def shard_rows(self) -> int | None:
        """Rows per output file, or None when ``output.num_shards`` fixes the file count instead."""
        if self.output.num_shards:
            return None
        return self.output.shard_rows or DEFAULT_SHARD_ROWS

    @property
    def tokens_output(self) -> str | None:
        if not self.tokenize.tokenizer:
            return None
        return self.tokenize.output or self.output.path.rstrip("/") + "-tokens"

    def validate(self) -> None:
        """Cross-field checks that types alone cannot express."""
        if self.on_bad_shard not in ("error", "skip"):
            raise ConfigError(f"on_bad_shard must be error or skip; got {self.on_bad_shard!r}")
        if self.normalize.unicode_form not in ("NFC", "NFKC", "none"):
            raise ConfigError(f"normalize.unicode_form must be NFC, NFKC or none; got {self.normalize.unicode_form!r}")
        if not self.output.path:
            raise ConfigError("output.path is empty; give a local folder or an s3:// prefix for the cleaned shards")
        o = self.output
        if o.shard_rows is not None and o.num_shards is not None:
            raise ConfigError("set output.shard_rows or output.num_shards, not both")
        for key, value in (("output.shard_rows", o.shard_rows), ("output.num_shards", o.num_shards)):
            if value is not None and value < 1:
                raise ConfigError(f"{key} must be >= 1, got {value}")
        near = self.dedup.near
        if near.num_perm < 1 or near.ngram < 1:
            raise ConfigError("dedup.near.num_perm and dedup.near.ngram must be >= 1")
        if not 0 < near.threshold <= 1:
            raise ConfigError(f"dedup.near.threshold must be in (0, 1], got {near.threshold}")
        bands, rows = near.lsh_shape()
        if bands < 1 or rows < 1 or bands * rows > near.num_perm:
            raise ConfigError(
                f"dedup.near.bands x dedup.near.rows ({bands} x {rows}) must be at least 1 x 1 and at most "
                f"dedup.near.num_perm ({near.num_perm})"
            )
        inputs = [self.input.path] if isinstance(self.input.path, str) else self.input.path
        outputs = [p for p in (self.output.path, self.tokens_output) if p]
        for out in outputs:
            for item in inputs:
                if _contains(out, item):
                    raise ConfigError(
                        f"output {out!r} holds the input {item!r}; writing there would replace the raw documents. "
                        "Choose another output.path (or tokenize.output)"
                    )


def _contains(folder: str, path: str) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (plain path comparison, no globbing)."""

    def norm(p: str) -> str:
        return p.rstrip("/") if "://" in p else os.path.abspath(os.path.expanduser(p))

    folder, path = norm(folder), norm(path)
    return path == folder or path.startswith(folder + "/")
