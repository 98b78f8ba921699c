"""What a secret inside a path looks like, and the one way every record and message hides it.

A path can carry a credential of its own: a password in a URL's userinfo
(``https://user:pw@host/...``) or the signature of a signed URL (S3's ``X-Amz-Signature``,
``X-Amz-Credential`` and ``X-Amz-Security-Token``, Azure SAS's ``sig``, GCS's ``Signature`` and
``GoogleAccessId``). ``display_uri`` replaces those parts by ``<redacted>`` and keeps the rest,
so a message still names the object. No library offers this for all three URL kinds (urllib
parses but does not redact; botocore redacts only its own log lines), hence a few lines here.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"

# Query parameters that authorise a request by themselves (compared case-insensitively).
SIGNED_URL_PARAMETERS = (
    "x-amz-signature",
    "x-amz-credential",
    "x-amz-security-token",
    "awsaccesskeyid",
    "signature",
    "x-goog-signature",
    "x-goog-credential",
    "googleaccessid",
    "sig",
    "access_token",
    "token",
)

_USERINFO = re.compile(r"(://)[^/@\s]+@")
_SIGNED_PARAMETER = re.compile(
    r"([?&](?:" + "|".join(re.escape(p) for p in SIGNED_URL_PARAMETERS) + r")=)[^&#\s]*",
    re.IGNORECASE,
)


def display_uri(text: str) -> str:
    """``text`` with every URL's userinfo and every signed-URL parameter's value redacted.

    ``https://u:pw@h/x`` -> ``https://<redacted>@h/x``;
    ``https://h/x.jsonl?X-Amz-Signature=abc&a=1`` -> ``https://h/x.jsonl?X-Amz-Signature=<redacted>&a=1``.
    """
    if "://" not in text and "=" not in text:
        return text
    text = _USERINFO.sub(rf"\1{REDACTED}@", text)
    return _SIGNED_PARAMETER.sub(rf"\1{REDACTED}", text)


def has_secret(text: str) -> bool:
    return display_uri(text) != text


def redact_tree(node: Any) -> Any:
    """A copy of a tree of dicts, lists and scalars with ``display_uri`` applied to every string."""
    if isinstance(node, dict):
        return {k: redact_tree(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return [redact_tree(v) for v in node]
    return display_uri(node) if isinstance(node, str) else node


def secret_strings(node: Any) -> list[str]:
    """Every string in a tree that holds a secret of its own (a password URL, a signed URL)."""
    if isinstance(node, dict):
        return [s for v in node.values() for s in secret_strings(v)]
    if isinstance(node, (list, tuple)):
        return [s for v in node for s in secret_strings(v)]
    return [node] if isinstance(node, str) and has_secret(node) else []
