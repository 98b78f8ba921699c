"""Text normalisation: one spelling for text that reads the same.

Runs before filtering and hashing, so that a copy differing only in Unicode form
(composed vs decomposed accents), line endings, invisible characters or spacing is an
exact duplicate of the original.
"""

from __future__ import annotations

import re
import unicodedata

from rayllm.prepare.config import NormalizeSettings

# Line separators other than \n: CR, vertical tab, form feed, NEL, Unicode line/paragraph separators.
_LINE_BREAKS = re.compile(r"\r\n|[\r\x0b\x0c\x85\u2028\u2029]")
# C0/C1 controls except tab and newline, plus invisible marks that only make copies look different.
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f\u200b\u200e\u200f\u2060\ufeff]")
_TRAILING_SPACE = re.compile(r"[^\S\n]+$", re.MULTILINE)
_BLANK_RUNS = re.compile(r"\n{3,}")
# Horizontal whitespace: any whitespace but the newline (tabs, NBSP, thin spaces, ideographic space...).
_SPACE_RUNS = re.compile(r"[^\S\n]+")
_LEADING_SPACE = re.compile(r"^ ", re.MULTILINE)


def normalize_text(text: str, settings: NormalizeSettings) -> str:
    """``text`` in the configured canonical form; empty when nothing visible is left."""
    if settings.unicode_form != "none":
        text = unicodedata.normalize(settings.unicode_form, text)
    if settings.newlines:
        text = _LINE_BREAKS.sub("\n", text)
    if settings.strip_control:
        text = _CONTROL.sub("", text)
    if settings.collapse_spaces:
        text = _LEADING_SPACE.sub("", _SPACE_RUNS.sub(" ", text))
    if settings.newlines:
        text = _BLANK_RUNS.sub("\n\n", _TRAILING_SPACE.sub("", text))
    return text.strip()
