"""Sealed credentials travel through the driver's vault actor (rayllm/io/credentials.py), with a
real local Ray: a map of secret paths far over Ray's inline limit goes in pieces under it (so it
never enters the object store, which spills to disk), and a worker process gets it back whole."""

from __future__ import annotations

import pytest

from rayllm.io import credentials
from rayllm.io.settings import StorageSettings


def test_sealed_secrets_reach_a_worker_whole_in_pieces_ray_inlines(ray_local):
    from rayllm.io.redact import display_uri

    ray = ray_local
    signed = [f"s3://b/part-{i:05d}.jsonl?X-Amz-Signature={i:064x}" for i in range(3000)]  # ~250 KB
    storage = StorageSettings(key="AKIAVAULTTEST", secret="vault-secret-value")
    sealed = storage.with_secret_paths(signed).sealed()
    ref = sealed.__dict__["_sealed"]
    assert isinstance(ref, credentials.SealedRef) and ref.pieces > 3, "pieces, each under the inline limit"
    assert "vault-secret-value" not in repr(sealed) + repr(ref)

    @ray.remote(num_cpus=0)
    def in_a_worker(settings: StorageSettings, shown: str) -> tuple[dict, str]:
        return settings.credentials(), settings.real_path(shown)

    shown = display_uri(signed[-1])
    assert shown != signed[-1]
    values, real = ray.get(in_a_worker.remote(sealed, shown), timeout=60)
    assert values["key"] == "AKIAVAULTTEST" and values["secret"] == "vault-secret-value"
    assert real == signed[-1]


def test_a_ref_whose_vault_is_gone_is_named(ray_local):
    from rayllm.errors import DataError

    credentials._resolved.clear()
    ref = credentials.SealedRef("rayllm-vault-gone", "", "0" * 32, 1)
    with pytest.raises(DataError, match="the driver that holds them may have exited"):
        credentials.resolve(ref)
