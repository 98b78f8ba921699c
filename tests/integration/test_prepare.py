"""``rayllm prepare`` on a generated prose corpus with planted duplicates and junk, through real Ray Data.

The corpus is made here, deterministically: prose documents from a seeded word list, plus
exact duplicates (one differing only in Unicode form, line endings and spacing), near
duplicates (a few words changed) and one document for each kind of low-quality text. Each
planted document records the stage that must remove it, so the surviving ids and every
count in the report are known exactly.
"""

from __future__ import annotations

import collections
import json
import random
import unicodedata
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import s3_client

from rayllm.errors import ConfigError, DataError
from rayllm.prepare import PrepareConfig, prepare
from rayllm.prepare.config import FilterSettings, NormalizeSettings
from rayllm.prepare.dedup import MinHasher, estimated_jaccard, non_lowest_of_clusters
from rayllm.prepare.label import document_id, split_id
from rayllm.prepare.normalize import normalize_text
from rayllm.prepare.quality import Document, first_failed_filter, measure

pytestmark = pytest.mark.slow

WORDS = """
river mountain village harbour garden window morning evening summer winter autumn letter
teacher student doctor farmer sailor painter writer reader market station bridge castle
forest meadow valley island ocean desert candle lantern kitchen library museum theatre
journey festival council partner neighbour stranger captain soldier merchant baker
quiet gentle bright narrow ancient modern famous simple careful curious silent golden
walked carried opened watched followed gathered painted remembered discovered answered
slowly rarely often quickly warmly softly nearly always perhaps finally together
through across beneath beside between against toward without during before after
the a of and to in on with from under over near their every another small large
old young early late long short warm cold heavy light green blue silver wooden stone
café naïve résumé façade coöperate
bread water music story picture question answer promise secret season weather
history science garden pocket basket ladder mirror blanket engine wheel anchor compass
""".split()

SHARDS = 4
DOCS_PER_SHARD = 34
LOCAL = fsspec.filesystem("file")


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(8, 15))]
    return " ".join(words).capitalize() + "."


def prose(rng: random.Random) -> str:
    paragraphs = [" ".join(sentence(rng) for _ in range(rng.randint(2, 4))) for _ in range(rng.randint(3, 4))]
    return "\n\n".join(paragraphs)


def change_words(text: str, rng: random.Random, n: int) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), n):
        words[i] = "lighthouse"
    return " ".join(words)


def junk(rng: random.Random) -> dict[str, str]:
    """One low-quality document per filter it must fail first (the order filters are checked in)."""
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))
    return {
        "min_words": "Click here to subscribe today.",
        "max_symbol_word_ratio": " ".join(f"{w} #trending" for w in words(60).split()),
        "max_bullet_lines_fraction": "\n".join(f"• {words(7)}" for _ in range(20)),
        "max_ellipsis_lines_fraction": "\n".join(f"{words(12)} …" for _ in range(12)),
        "min_alpha_words_fraction": " ".join(str(rng.randint(100, 99999)) for _ in range(80)),
        "max_non_alnum_chars_fraction": " ".join(f"{w[0]}@@%%" for w in words(80).split()),
        "max_duplicate_lines_fraction": "\n".join(["The offer ends soon so buy your tickets now."] * 20),
        "max_top_2gram_chars_fraction": " ".join(f"{w} buy now" for w in words(60).split()),
        "max_duplicate_5gram_chars_fraction": " ".join(
            [words(40)] + ["the quiet river carried every golden lantern toward the harbour"] * 6 + [words(40)]
        ),
    }


def build_corpus(seed: int = 0):
    """Shards of documents and, per document, the stage that must remove it ("" = survives)."""
    rng = random.Random(seed)
    shards = [[prose(rng) for _ in range(DOCS_PER_SHARD)] for _ in range(SHARDS)]
    fates = [[""] * DOCS_PER_SHARD for _ in range(SHARDS)]

    def plant(shard: int, text: str, fate: str) -> None:
        at = rng.randint(0, len(shards[shard]))
        shards[shard].insert(at, text)
        fates[shard].insert(at, fate)

    accented = next(d for d in shards[0][10:] if "é" in d)
    originals = [accented, shards[1][5], shards[0][7], shards[2][2]]  # taken before anything moves
    # (a) exact duplicates, in later shards than their originals (so the original has the lower id);
    # the first differs from its original in Unicode form, line endings, spacing and a zero-width space
    variant = unicodedata.normalize("NFD", originals[0]).replace("\n", "\r\n").replace(" ", "  ", 5) + "\u200b "
    plant(2, variant, "exact_duplicates")
    plant(3, originals[1], "exact_duplicates")
    # (b) near duplicates: a few words changed
    plant(1, change_words(originals[2], rng, 3), "near_duplicates")
    plant(3, change_words(originals[3], rng, 2), "near_duplicates")
    # (c) low quality, and text that normalises to nothing
    for i, (fate, text) in enumerate(junk(rng).items()):
        plant(i % SHARDS, text, fate)
    plant(1, "\u200b\x00 \x07\r\n\t \ufeff", "normalize_empty")
    expected = {document_id(s, d): fate for s, shard_fates in enumerate(fates) for d, fate in enumerate(shard_fates)}
    return shards, expected


def write_shards(folder, shards) -> list:
    """jsonl for the first shards, parquet for the last: both readers in one run."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, docs in enumerate(shards):
        if i == len(shards) - 1:
            path = folder / f"part-{i}.parquet"
            pq.write_table(pa.table({"text": docs}), path)
        else:
            path = folder / f"part-{i}.jsonl"
            path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        paths.append(path)
    return paths


def read_parquet_folder(fs, folder: str) -> pa.Table:
    """The folder's parquet files in name order, as one table (_report.json lies beside them)."""
    files = sorted(p for p in fs.ls(folder, detail=False) if p.endswith(".parquet"))
    return pa.concat_tables([pq.read_table(fs.open(p, "rb")) for p in files])


def check_report_counts(report: dict, expected: dict[int, str]) -> None:
    fates = collections.Counter(expected.values())
    removed = report["removed"]
    assert report["input"]["documents"] == len(expected)
    assert removed["normalize_empty"]["documents"] == fates["normalize_empty"]
    filters = {name: entry["documents"] for name, entry in removed["filters"].items()}
    assert filters == {name: fates.get(name, 0) for name in FilterSettings().thresholds()}
    assert removed["exact_duplicates"]["documents"] == fates["exact_duplicates"] == 2
    assert removed["near_duplicates"]["documents"] == fates["near_duplicates"] == 2
    assert report["output"]["documents"] == fates[""]
    # Each document is counted once: what went in is what came out plus what each stage removed.
    stages = [removed["normalize_empty"], *removed["filters"].values()]
    stages += [removed["exact_duplicates"], removed["near_duplicates"]]
    assert sum(s["documents"] for s in stages) + report["output"]["documents"] == report["input"]["documents"]
    after_normalize = stages[1:]
    assert report["normalized"]["tokens"] - sum(s["tokens"] for s in after_normalize) == report["output"]["tokens"]


@pytest.fixture(scope="module")
def corpus_shards():
    return build_corpus()


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory, corpus_shards):
    from rayllm.data.tokenizer import train_bpe

    shards, _ = corpus_shards
    path = tmp_path_factory.mktemp("prepare-tok") / "tokenizer.json"
    train_bpe([d for docs in shards for d in docs], 400).save(str(path))
    return path


@pytest.fixture(scope="module")
def local_run(ray_local, tmp_path_factory, corpus_shards, tokenizer_path):
    """One prepare run on local disk with pre-tokenised output; several tests read its results."""
    shards, expected = corpus_shards
    root = tmp_path_factory.mktemp("prepare-local")
    write_shards(root / "raw", shards)
    config = PrepareConfig.from_dict(
        {
            "input": {"path": str(root / "raw")},
            "output": {"path": str(root / "clean"), "shard_rows": 60},
            "tokenize": {"tokenizer": str(tokenizer_path)},
        }
    )
    return config, prepare(config, quiet=True), expected


def test_prepare_removes_every_planted_duplicate_and_junk_document_and_keeps_the_rest(local_run):
    config, report, expected = local_run
    table = read_parquet_folder(LOCAL, config.output.path)
    ids = table.column("id").to_pylist()
    assert set(ids) == {doc_id for doc_id, fate in expected.items() if fate == ""}
    assert ids == sorted(ids)  # files, and rows within them, in id order
    assert table.column_names == ["id", "text"]
    files = sorted(p.name for p in Path(config.output.path).glob("*.parquet"))
    assert files == report["output"]["files"] == ["part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]


def test_prepare_report_counts_match_the_planted_documents(local_run):
    config, report, expected = local_run
    check_report_counts(report, expected)
    assert report["token_unit"].startswith("tokens of")
    assert report["bad_shards"] == {"count": 0, "shards": []}
    saved = json.loads((Path(config.output.path) / "_report.json").read_text())
    assert saved == json.loads(json.dumps(report))


def test_pre_tokenised_shards_decode_to_the_normalised_text(local_run, tokenizer_path):
    from tokenizers import Tokenizer

    config, report, _ = local_run
    text = read_parquet_folder(LOCAL, config.output.path)
    tokens = read_parquet_folder(LOCAL, config.tokens_output)
    assert tokens.schema.field("tokens").type == pa.list_(pa.int32())
    assert tokens.column("id").to_pylist() == text.column("id").to_pylist()
    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    decoded = [tokenizer.decode(ids) for ids in tokens.column("tokens").to_pylist()]
    assert decoded == text.column("text").to_pylist()
    assert sum(len(t) for t in tokens.column("tokens").to_pylist()) == report["output"]["tokens"]


def test_prepare_on_s3_skips_a_bad_shard_and_names_it(ray_local, s3_server, corpus_shards, tmp_path):
    import s3fs

    shards, expected = corpus_shards
    s3 = s3_client(s3_server)
    s3.create_bucket(Bucket="prepare-test")
    paths = write_shards(tmp_path / "raw", shards)
    (tmp_path / "raw" / "part-4-broken.jsonl").write_text('{"text": "fine"}\n{not json\n')
    for path in [*paths, tmp_path / "raw" / "part-4-broken.jsonl"]:
        s3.upload_file(str(path), "prepare-test", f"raw/{path.name}")
    storage = {"endpoint_url": s3_server, "key": "testing", "secret": "testing", "region": "us-east-1"}
    config = PrepareConfig.from_dict(
        {
            "input": {"path": "s3://prepare-test/raw/"},
            "output": {"path": "s3://prepare-test/clean", "num_shards": 2},
            "storage": storage,
            "on_bad_shard": "skip",
        }
    )
    report = prepare(config, quiet=True)

    fs = s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=s3_server)
    survivors = set(read_parquet_folder(fs, "prepare-test/clean").column("id").to_pylist())
    assert survivors == {doc_id for doc_id, fate in expected.items() if fate == ""}
    assert report["bad_shards"]["count"] == 1
    (bad,) = report["bad_shards"]["shards"]
    assert bad["uri"] == "s3://prepare-test/raw/part-4-broken.jsonl" and "line 2" in bad["error"]
    assert report["input"]["shards"] == SHARDS + 1
    assert report["token_unit"] == "whitespace-separated words"
    check_report_counts(report, expected)
    saved = json.loads(fs.cat("prepare-test/clean/_report.json"))
    assert saved["bad_shards"] == report["bad_shards"]
    assert saved["config"]["storage"]["secret"] == "<redacted>"


def test_unreadable_shard_in_error_mode_raises_data_error_naming_it(ray_local, tmp_path):
    rng = random.Random(1)
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.jsonl").write_text(json.dumps({"text": prose(rng)}) + "\n")
    (tmp_path / "raw" / "b.jsonl.gz").write_bytes(b"\x1f\x8bnot gzip at all")
    config = PrepareConfig.from_dict(
        {"input": {"path": str(tmp_path / "raw")}, "output": {"path": str(tmp_path / "o")}}
    )
    with pytest.raises(DataError) as failure:
        prepare(config, quiet=True)
    assert str(tmp_path / "raw" / "b.jsonl.gz") in str(failure.value)
    assert "on_bad_shard: skip" in str(failure.value)


def test_missing_input_path_raises_before_ray_starts(tmp_path):
    config = PrepareConfig.from_dict(
        {"input": {"path": str(tmp_path / "nope")}, "output": {"path": str(tmp_path / "o")}}
    )
    with pytest.raises(DataError, match="no shards found"):
        prepare(config, quiet=True)


def test_input_without_documents_raises_data_error(ray_local, tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "empty.jsonl").write_text(json.dumps({"text": ""}) + "\n")
    config = PrepareConfig.from_dict(
        {"input": {"path": str(tmp_path / "raw")}, "output": {"path": str(tmp_path / "o")}}
    )
    with pytest.raises(DataError, match="hold no non-empty 'text' documents"):
        prepare(config, quiet=True)


# Cheap unit tests of the pieces: no Ray.


def test_config_rejects_unknown_keys_with_the_nearest_one_and_checks_values():
    with pytest.raises(ConfigError, match="did you mean 'filters.min_words'"):
        PrepareConfig.from_dict({"filters": {"min_word": 10}})
    with pytest.raises(ConfigError, match="dedup.near.num_perm"):
        PrepareConfig.from_dict({"dedup": {"near": {"bands": 20, "rows": 8}}})
    with pytest.raises(ConfigError, match="not both"):
        PrepareConfig.from_dict({"output": {"shard_rows": 10, "num_shards": 2}})
    with pytest.raises(ConfigError, match="on_bad_shard"):
        PrepareConfig.from_dict({"on_bad_shard": "ignore"})


def test_lsh_shape_defaults_to_16_bands_of_8_and_follows_the_threshold():
    config = PrepareConfig()
    assert config.dedup.near.lsh_shape() == (16, 8)
    config.dedup.near.threshold = 0.9
    assert config.dedup.near.lsh_shape() == (8, 16)
    config.dedup.near.bands, config.dedup.near.rows = 20, 5
    assert config.dedup.near.lsh_shape() == (20, 5)


def test_demo_config_keeps_almost_all_of_the_python_corpus():
    from rayllm.data.demo_corpus import stdlib_modules

    config = PrepareConfig.from_yaml("configs/prepare-demo.yaml")
    thresholds = config.filters.thresholds()
    texts = [
        normalize_text(p.read_text(encoding="utf-8", errors="replace"), config.normalize) for p in stdlib_modules()
    ]
    texts = [t for t in texts[::6] if t]
    failed = collections.Counter(first_failed_filter(t, thresholds) for t in texts)
    assert failed[""] >= 0.95 * len(texts), failed
    assert any("\n    return " in t for t in texts)  # indentation kept


def test_normalisation_unifies_unicode_form_line_endings_and_spacing():
    settings = NormalizeSettings()
    a = "Le café\u00a0est  ouvert.\r\nIl fait\tbeau.\n\n\n\nFin. "
    b = unicodedata.normalize("NFD", "Le café est ouvert.\nIl fait beau.\n\nFin.")
    assert normalize_text(a, settings) == normalize_text(b, settings) == "Le café est ouvert.\nIl fait beau.\n\nFin."
    assert normalize_text("\u200b\x00\x07 \n\t", settings) == ""
    code = NormalizeSettings(collapse_spaces=False)
    assert normalize_text("def f():\r\n    return 1   \r\n", code) == "def f():\n    return 1"
    assert normalize_text("ﬁne", NormalizeSettings(unicode_form="NFKC")) == "fine"


@pytest.mark.parametrize(
    "name, text, value",
    [
        ("words", "one two  three", 3),
        ("mean_word_length", "ab abcd", 3.0),
        ("symbol_word_ratio", "#a #b c d", 0.5),
        ("symbol_word_ratio", "wait... what… now then", 0.5),
        ("bullet_lines_fraction", "• a\n- b\nc\n* d", 0.75),
        ("ellipsis_lines_fraction", "a...\nb\nc…\nd", 0.5),
        ("alpha_words_fraction", "abc 123 a1 ---", 0.5),
        ("non_alnum_chars_fraction", "ab!! cd", 2 / 6),
        ("duplicate_lines_fraction", "x y\nz\nx y\nx y", 0.5),
        ("duplicate_line_chars_fraction", "aaaa\nbb\naaaa", 4 / 10),
        ("top_2gram_chars_fraction", "ab cd ab cd ef", 8 / 10),
        ("top_2gram_chars_fraction", "ab cd ef gh", 0.0),  # nothing repeats
        ("duplicate_5gram_chars_fraction", "a b c d e a b c d e f", 10 / 11),
        ("duplicate_5gram_chars_fraction", "a b c d e f", 0.0),
    ],
)
def test_quality_measures(name, text, value):
    assert measure(name, Document(text)) == pytest.approx(value)


def test_first_failed_filter_checks_in_order_and_skips_disabled_ones():
    thresholds = FilterSettings().thresholds()
    assert first_failed_filter("too short", thresholds) == "min_words"
    assert first_failed_filter("too short", FilterSettings(min_words=None).thresholds()) != "min_words"
    assert FilterSettings(enabled=False).thresholds() == {}
    rng = random.Random(3)
    assert all(first_failed_filter(prose(rng), thresholds) == "" for _ in range(50))


def test_minhash_estimates_jaccard_and_clusters_keep_the_lowest_id():
    rng = random.Random(5)
    a = prose(rng)
    b = change_words(a, rng, 3)
    hasher = MinHasher(num_perm=256, ngram=5, seed=0)
    sa, sb = hasher.shingles(a), hasher.shingles(b)
    true = len(np.intersect1d(sa, sb)) / len(np.union1d(sa, sb))
    estimate = float(estimated_jaccard(hasher.signature(a), hasher.signature(b)))
    assert abs(estimate - true) < 0.1 and true > 0.7
    assert float(estimated_jaccard(hasher.signature(a), hasher.signature(prose(rng)))) < 0.1
    pairs = np.array([[5, 9], [9, 2], [7, 8]])
    assert non_lowest_of_clusters(pairs).tolist() == [5, 8, 9]


def test_document_ids_round_trip():
    assert split_id(document_id(3, 17)) == (3, 17)


def _train_config(data_path: str, run_dir: Path, *extra: str):
    from helpers import TEST_MODEL

    from rayllm import TrainConfig

    overrides = [*TEST_MODEL, f"data.train={data_path}", "data.val=null", f"run.dir={run_dir}", *extra]
    return TrainConfig.from_yaml("configs/tiny.yaml", overrides=[*overrides, "data.demo_corpus=false"])


def test_trainer_streams_pre_tokenised_shards_exactly_as_the_text_they_came_from(local_run, tokenizer_path, tmp_path):
    """The token folder needs no data.tokenizer (prepare leaves ``_tokenizer.json`` beside it),
    the text folder's ``_report.json`` is not taken for a shard, and both give the same sequences."""
    from rayllm.data.discover import prepare_data

    config, _, _ = local_run
    text_cfg = _train_config(config.output.path, tmp_path / "text", f"data.tokenizer={tokenizer_path}")
    token_cfg = _train_config(config.tokens_output, tmp_path / "tokens")
    text_plan = prepare_data(text_cfg, log=lambda *_: None)
    token_plan = prepare_data(token_cfg, log=lambda *_: None)
    assert token_plan.tokenizer_uri.endswith("_tokenizer.json")
    assert (tmp_path / "tokens" / "tokenizer.json").read_text() == Path(tokenizer_path).read_text()  # run copy
    assert len(text_plan.train.sources[0].shards) == len(token_plan.train.sources[0].shards) == 3
    # The same sequences under the same ids; the order within a group of shards may differ, as
    # the interleave paces shards by their bytes, and a parquet shard's bytes are not its text's.
    text_epoch, token_epoch = _first_epoch(text_plan.train), _first_epoch(token_plan.train)
    assert len(text_epoch) > 40 and text_epoch.keys() == token_epoch.keys()
    assert all(np.array_equal(text_epoch[k], token_epoch[k]) for k in text_epoch)


def _first_epoch(plan) -> dict:
    """Tokens by (epoch, shard, index) of every sequence of epoch 0 (read unshuffled, so it ends in order)."""
    import dataclasses

    from rayllm.data.order import local_stream

    out = {}
    for rows, _ in local_stream(dataclasses.replace(plan, window=1), global_batch=8):
        for r in rows[rows["epoch"] == 0]:
            out[(int(r["epoch"]), int(r["shard"]), int(r["index"]))] = r["tokens"]
        if (rows["epoch"] > 0).all():
            return out
    return out


def test_pre_tokenised_shards_without_their_tokenizer_are_a_clear_error(local_run, tmp_path):
    import shutil

    from rayllm.data.discover import prepare_data

    config, _, _ = local_run
    copy = tmp_path / "tokens"
    shutil.copytree(config.tokens_output, copy, ignore=shutil.ignore_patterns("_*"))
    with pytest.raises(DataError, match=r"pre-tokenised .* set data.tokenizer"):
        prepare_data(_train_config(str(copy), tmp_path / "run"), log=lambda *_: None)


def test_training_runs_on_pre_tokenised_shards(local_run, tmp_path):
    from rayllm import train

    config, _, _ = local_run
    cfg = _train_config(
        config.tokens_output, tmp_path / "run", "train.max_steps=3", "cluster.num_workers=1", "tracking.enabled=false"
    )
    result = train(cfg, quiet=True)
    assert result.step == 3
    assert result.tokens == 3 * 8 * 64
    assert np.isfinite(result.loss)
