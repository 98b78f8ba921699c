"""What every rayllm config tree shares (a run's, a prepare job's): YAML and dotted overrides in,
validation, and the one redaction that every record of a config goes through."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, ClassVar, TypeVar

import yaml

from rayllm.config.tree import build_config, read_yaml_mapping
from rayllm.io import credentials
from rayllm.io.redact import REDACTED, display_uri, secret_strings

Root = TypeVar("Root", bound="RootConfig")


class RootConfig:
    """A dataclass config tree's root. Subclasses are dataclasses and define ``validate``."""

    # Keys that moved, old dotted prefix -> new one: an old key is refused naming the new one.
    MOVED_KEYS: ClassVar[dict[str, str]] = {}

    @classmethod
    def from_yaml(cls: type[Root], path: str | os.PathLike, overrides: list[str] | None = None) -> Root:
        """Load a YAML file and apply dotted ``key=value`` overrides."""
        return cls.from_dict(read_yaml_mapping(path), overrides)

    @classmethod
    def from_dict(cls: type[Root], raw: dict[str, Any], overrides: list[str] | None = None) -> Root:
        config = build_config(cls, raw, overrides, moved=cls.MOVED_KEYS)
        config.validate()
        return config

    def validate(self) -> None:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        """The whole tree, secrets included: to read back, never to show (``to_redacted_yaml``)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def with_overrides(self: Root, overrides: list[str]) -> Root:
        return type(self).from_dict(self.to_dict(), overrides)

    def redacted(self) -> dict[str, Any]:
        """The tree as a run or job records, prints and hands to Ray: every storage section's
        secrets, and in every string (any path field, any list of sources) a URL's password
        and a signed URL's signature, replaced, so they never reach a log, a file, a tracker
        or Ray's state API. Processes handed it open those paths through the sealed storage
        settings (``secret_paths``, StorageSettings.with_secret_paths)."""
        return _redact(self.to_dict(), section="")

    def __repr__(self) -> str:
        """Redacted: a repr lands in logs and tracebacks (subclasses are ``dataclass(repr=False)``)."""
        return f"{type(self).__name__}({self.redacted()!r})"

    def to_redacted_yaml(self) -> str:
        return yaml.safe_dump(self.redacted(), sort_keys=False)

    def secret_paths(self) -> list[str]:
        """Every string of the tree with a secret of its own: a password URL, a signed URL."""
        return secret_strings(self.to_dict())


def _redact(node: Any, section: str) -> Any:
    if isinstance(node, dict):
        shown = {k: _redact(v, k) for k, v in node.items()}
        if section == "storage":
            for name in credentials.secret_values(node):
                shown[name] = display_uri(node[name]) if name == "endpoint_url" else REDACTED
        return shown
    if isinstance(node, list):
        return [_redact(v, section) for v in node]
    return display_uri(node) if isinstance(node, str) else node
