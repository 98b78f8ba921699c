"""Training from s3:// data on moto's S3 server (127.0.0.1, HTTP), checkpoints written to s3://."""

import json
from pathlib import Path

import pytest
from helpers import s3_client

from rayllm import TrainConfig, train

pytestmark = pytest.mark.slow


@pytest.fixture
def bucket(s3_server, corpus):
    s3 = s3_client(s3_server)
    s3.create_bucket(Bucket="rayllm-test")
    for path in sorted(corpus.rglob("part-*")):
        s3.upload_file(str(path), "rayllm-test", f"corpus/{path.parent.name}/{path.name}")
    return s3


def test_train_from_s3_with_checkpoints_on_s3_and_resume(ray_local, s3_server, bucket, overrides):
    from helpers import TEST_MODEL

    base = [
        *TEST_MODEL,
        "data.train=s3://rayllm-test/corpus/train",
        "data.val=s3://rayllm-test/corpus/val/part-0.parquet",
        f"storage.endpoint_url={s3_server}",
        "storage.key=testing",
        "storage.secret=testing",
        "storage.region=us-east-1",
        "run.dir=s3://rayllm-test/runs/s3run",
        "train.max_steps=4",
        "train.log_every=1",
        "train.val_every=2",
        "train.checkpoint_every=2",
        "tracking.enabled=false",
    ]
    first = train(TrainConfig.from_yaml("configs/tiny.yaml", overrides=[*base, "train.stop_at_step=2"]), quiet=True)
    assert first.step == 2
    assert first.checkpoint == "s3://rayllm-test/runs/s3run/checkpoint_00000002"
    keys = {o["Key"] for o in bucket.list_objects_v2(Bucket="rayllm-test", Prefix="runs/s3run/")["Contents"]}
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "train_state.json"):
        assert f"runs/s3run/checkpoint_00000002/{name}" in keys
    assert "runs/s3run/tokenizer.json" in keys and "runs/s3run/config.yaml" in keys
    state = json.loads(
        bucket.get_object(Bucket="rayllm-test", Key="runs/s3run/checkpoint_00000002/train_state.json")["Body"].read()
    )
    assert state["step"] == 2

    second = train(TrainConfig.from_yaml("configs/tiny.yaml", overrides=base), quiet=True)
    starts = [r for r in second.history if r["kind"] == "start"]
    assert starts[0]["step"] == 2
    assert second.step == 4
    assert second.checkpoint == "s3://rayllm-test/runs/s3run/checkpoint_00000004"
    # metrics.jsonl on object storage holds both drivers' records, the first's kept.
    log = bucket.get_object(Bucket="rayllm-test", Key="runs/s3run/metrics.jsonl")["Body"].read().decode()
    records = [json.loads(line) for line in log.splitlines()]
    assert [r["step"] for r in records if r["kind"] == "start"] == [0, 2]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4]
    # Credentials never reach the config the run records.
    config_text = bucket.get_object(Bucket="rayllm-test", Key="runs/s3run/config.yaml")["Body"].read().decode()
    assert "secret: <redacted>" in config_text and "testing" not in config_text


def test_init_from_a_folder_on_s3_gives_its_loss_at_the_first_step(s3_server, bucket, overrides, tmp_path):
    """model.init_from=s3://...: the folder is read from object storage once (torchrun's rank 0
    converts it into the run dir), and two FSDP ranks start from exactly its weights."""
    import torch
    from helpers import losses, torchrun_records

    from rayllm.checkpoint.hf import save_hf
    from rayllm.config.resolve import resolve
    from rayllm.data.discover import prepare_data
    from rayllm.data.order import local_stream
    from rayllm.loop.setup import model_args
    from rayllm.model import Llama

    storage = [
        f"storage.endpoint_url={s3_server}",
        "storage.key=testing",
        "storage.secret=testing",
        "storage.region=us-east-1",
    ]
    run = [*overrides, *storage, "train.max_steps=2", "train.log_every=1", "tracking.enabled=false"]
    run += ["data.val=null", "train.sample_tokens=0", "cluster.use_gpu=false"]
    shape = TrainConfig.from_yaml("configs/tiny.yaml", overrides=run)
    model = Llama(model_args(shape), seed=7)
    with torch.no_grad():  # peaked logits: a loss far from a fresh start's ln(vocab)
        model.output.weight.mul_(50.0)
    save_hf(model, Path(shape.data.tokenizer).read_text(), str(tmp_path / "hf"), None, None)
    for path in (tmp_path / "hf").iterdir():
        bucket.upload_file(str(path), "rayllm-test", f"models/seed7/{path.name}")
    run = [o for o in run if not o.startswith("data.tokenizer=")] + ["model.init_from=s3://rayllm-test/models/seed7"]
    config = resolve(TrainConfig.from_yaml("configs/tiny.yaml", overrides=run))  # as the driver does
    rows, _ = next(local_stream(prepare_data(config).train, global_batch=config.train.global_batch_size))
    assert config.data.tokenizer == "s3://rayllm-test/models/seed7/tokenizer.json"
    with torch.no_grad():
        tokens = torch.from_numpy(rows["tokens"]).long()
        expected = model(tokens[:, :-1], tokens[:, 1:]).item()
    first = losses(torchrun_records(2, run))[1]
    assert abs(first - expected) / expected <= 1e-4, (first, expected)
    assert expected > 10  # not a fresh start's ln(1024) = 6.9
