"""Document quality heuristics after Gopher (Rae et al. 2021, appendix A, "MassiveText quality filter").

Each filter is a measure of one document and a bound: ``min_<measure>`` or ``max_<measure>``,
named as in ``FilterSettings``, so the report's count for a filter and the setting that
produced it share a name. Words are whitespace-separated tokens; lines are the non-blank
lines. These rules describe English prose: source code, tables or lists fail several of
them by design.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cached_property

import numpy as np

BULLETS = ("•", "‣", "◦", "⁃", "∙", "●", "○", "▪", "▫", "■", "□", "-", "*", "–", "—")
ELLIPSES = ("...", "…")
_NGRAM_MEASURE = re.compile(r"(top|duplicate)_(\d+)gram_chars_fraction")


class Document:
    """One normalised text and the views of it the measures share (each computed once)."""

    def __init__(self, text: str):
        self.text = text

    @cached_property
    def words(self) -> list[str]:
        return self.text.split()

    @cached_property
    def lines(self) -> list[str]:
        return [line.strip() for line in self.text.split("\n") if line.strip()]

    @cached_property
    def word_chars(self) -> int:
        return sum(len(w) for w in self.words)

    @cached_property
    def word_ids(self) -> tuple[np.ndarray, np.ndarray]:
        """(id of each word in a per-document vocabulary, length of each word), for n-gram counting."""
        vocab: dict[str, int] = {}
        ids = np.array([vocab.setdefault(w, len(vocab)) for w in self.words], dtype=np.int64)
        lengths = np.array([len(w) for w in self.words], dtype=np.int64)
        return ids, lengths

    def ngram_counts(self, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(index of each position's n-gram among the distinct n-grams, count of each), or None if too short."""
        ids, _ = self.word_ids
        if len(ids) < n:
            return None
        windows = np.lib.stride_tricks.sliding_window_view(ids, n)  # (positions, n)
        _, inverse, counts = np.unique(windows, axis=0, return_inverse=True, return_counts=True)
        return inverse.reshape(-1), counts


def _ratio(part: float, whole: float) -> float:
    return part / whole if whole else 0.0


def chars(doc: Document) -> float:
    return len(doc.text)


def words(doc: Document) -> float:
    return len(doc.words)


def mean_word_length(doc: Document) -> float:
    return _ratio(doc.word_chars, len(doc.words))


def symbol_word_ratio(doc: Document) -> float:
    hashes = doc.text.count("#")
    ellipses = sum(doc.text.count(e) for e in ELLIPSES)
    return _ratio(max(hashes, ellipses), len(doc.words))


def bullet_lines_fraction(doc: Document) -> float:
    return _ratio(sum(line.startswith(BULLETS) for line in doc.lines), len(doc.lines))


def ellipsis_lines_fraction(doc: Document) -> float:
    return _ratio(sum(line.endswith(ELLIPSES) for line in doc.lines), len(doc.lines))


def alpha_words_fraction(doc: Document) -> float:
    return _ratio(sum(any(c.isalpha() for c in w) for w in doc.words), len(doc.words))


def non_alnum_chars_fraction(doc: Document) -> float:
    return _ratio(sum(not c.isalnum() for w in doc.words for c in w), doc.word_chars)


def _repeated_lines(doc: Document) -> tuple[int, int]:
    """(lines that repeat an earlier line, their characters)."""
    seen: set[str] = set()
    count = chars_ = 0
    for line in doc.lines:
        if line in seen:
            count += 1
            chars_ += len(line)
        seen.add(line)
    return count, chars_


def duplicate_lines_fraction(doc: Document) -> float:
    return _ratio(_repeated_lines(doc)[0], len(doc.lines))


def duplicate_line_chars_fraction(doc: Document) -> float:
    return _ratio(_repeated_lines(doc)[1], sum(len(line) for line in doc.lines))


def top_ngram_chars_fraction(doc: Document, n: int) -> float:
    """Word characters in all occurrences of the most frequent n-gram (0 when no n-gram repeats)."""
    found = doc.ngram_counts(n)
    if found is None or found[1].max() < 2:
        return 0.0
    inverse, counts = found
    top = int(np.argmax(counts))
    first = int(np.argmax(inverse == top))
    _, lengths = doc.word_ids
    return min(1.0, _ratio(counts[top] * int(lengths[first : first + n].sum()), doc.word_chars))


def duplicate_ngram_chars_fraction(doc: Document, n: int) -> float:
    """Word characters covered by n-grams that occur more than once, each character counted once."""
    found = doc.ngram_counts(n)
    if found is None:
        return 0.0
    inverse, counts = found
    repeated = counts[inverse] > 1  # per starting position
    covered = np.zeros(len(doc.words), dtype=bool)
    for k in range(n):
        covered[k : k + len(repeated)] |= repeated
    _, lengths = doc.word_ids
    return _ratio(int(lengths[covered].sum()), doc.word_chars)


_MEASURES: dict[str, Callable[[Document], float]] = {
    f.__name__: f
    for f in (
        chars,
        words,
        mean_word_length,
        symbol_word_ratio,
        bullet_lines_fraction,
        ellipsis_lines_fraction,
        alpha_words_fraction,
        non_alnum_chars_fraction,
        duplicate_lines_fraction,
        duplicate_line_chars_fraction,
    )
}


def measure(name: str, doc: Document) -> float:
    """The value a filter compares: ``name`` is the filter's name with or without its min_/max_ prefix."""
    key = name.removeprefix("min_").removeprefix("max_")
    ngram = _NGRAM_MEASURE.fullmatch(key)
    if ngram:
        kind, n = ngram.group(1), int(ngram.group(2))
        return top_ngram_chars_fraction(doc, n) if kind == "top" else duplicate_ngram_chars_fraction(doc, n)
    if key not in _MEASURES:
        raise KeyError(f"no quality measure named {key!r}")
    return _MEASURES[key](doc)


def first_failed_filter(text: str, thresholds: dict[str, float]) -> str:
    """The name of the first filter ``text`` fails, in ``thresholds`` order; "" when it passes all."""
    doc = Document(text)
    for name, bound in thresholds.items():
        value = measure(name, doc)
        if (name.startswith("min_") and value < bound) or (name.startswith("max_") and value > bound):
            return name
    return ""
