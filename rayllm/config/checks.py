"""The valid range of every config key, and the checks that span keys.

``TrainConfig.validate`` runs them; each refusal is one line naming the key, the value, the
valid range and the fix. Nothing here reads a file.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Any

from rayllm.config.sections import (
    ClusterSettings,
    DataSettings,
    ModelSettings,
    ParallelSettings,
    RunSettings,
    SourceSettings,
    TrackingSettings,
    TrainingSettings,
)
from rayllm.errors import ConfigError
from rayllm.io.credentials import redact_url
from rayllm.io.settings import StorageSettings
from rayllm.parallel.layout import check_model_split, checkpoint_mode, compiles, resolve_layout
from rayllm.parallel.pp import plan_pipeline


def check_batch_split(global_batch: int, micro_batch: int, data_ranks: int) -> int:
    """Gradient-accumulation steps that keep ``global_batch`` fixed over ``data_ranks`` slices
    (the workers, or workers / parallel.tp: the ranks of a TP group share one slice)."""
    per_step = micro_batch * data_ranks
    if global_batch % per_step:
        raise ConfigError(
            f"train.global_batch_size ({global_batch}) must be divisible by train.micro_batch_size "
            f"({micro_batch}) x data-parallel ranks ({data_ranks}: workers / parallel.tp); pick a global batch "
            f"that is a multiple of {per_step} or a smaller micro batch"
        )
    return global_batch // per_step


@dataclass(frozen=True)
class Range:
    """Where a number may lie: bounds (None: unbounded), each closed unless open, and whether null may stand in."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    null: bool = False

    def holds(self, value: Any) -> bool:
        if value is None:
            return self.null
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def __str__(self) -> str:
        low, high = _number(self.low), _number(self.high)
        if self.low is not None and self.high is not None:
            text = f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {low}"
        else:
            text = f"{'<' if self.high_open else '<='} {high}"
        return text + (" or null" if self.null else "")


def _number(x: float | None) -> str:
    if x is None:
        return ""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


_COUNT, _SECONDS = Range(1), Range(0, low_open=True)
INTERRUPTION_NOTICES = ("aws", "gcp", "file", "off")  # runtime/interruption.py's KINDS
_COUNT_OR_NULL, _SECONDS_OR_NULL = Range(1, null=True), Range(0, low_open=True, null=True)

# Every number in the tree: its range, and the fix a message gives with it. A key added to the
# tree without an entry here fails tests/unit/test_config.py.
RANGES: dict[str, tuple[Range, str]] = {
    "run.lease_timeout_s": (_SECONDS, "set seconds after which a silent run's lease is taken over, for example 60"),
    "data.seq_len": (_COUNT, "set the tokens per training sequence, for example data.seq_len=256"),
    "data.tokenizer_sample_docs": (_COUNT, "set the documents a new tokenizer learns from, for example 4000"),
    "data.shuffle_window": (_COUNT, "set sequences per shuffle window, for example 4096 (1 turns shuffling off)"),
    "data.mix_shards": (_COUNT, "set shards read at once per source, for example 32 (1 reads one at a time)"),
    "data.tokenize_tasks": (Range(0), "set the most tokenize tasks per reading task, for example 8 (0: none)"),
    "data.max_document_bytes": (
        Range(1024),
        "set the most bytes one document (a jsonl line, a .txt shard) may take, for example 67108864 (64 MiB)",
    ),
    "data.wait_timeout_s": (_SECONDS, "set how long a rank waits for its next batch, for example 300"),
    "model.dim": (_COUNT, "set the model width, for example 256"),
    "model.n_layers": (_COUNT, "set the number of transformer blocks, for example 4"),
    "parallel.pp": (_COUNT, "set the pipeline stages, for example 1 (no pipeline) or 4"),
    "parallel.cp": (_COUNT, "set the ranks that split every sequence, for example 1 (none) or 2"),
    "model.n_heads": (_COUNT, "set the attention heads, for example 8"),
    "model.n_kv_heads": (_COUNT, "set the key/value heads (model.n_heads for no grouping), for example 4"),
    "model.vocab_size": (Range(2), "set at least the tokenizer's size (EOS and one more token), for example 4096"),
    "model.ffn_hidden": (_COUNT_OR_NULL, "set the feed-forward width, or null to size it from model.dim"),
    "model.ffn_multiple_of": (_COUNT, "set what the default feed-forward width rounds up to, for example 64"),
    "model.norm_eps": (Range(0, low_open=True), "set RMSNorm's epsilon, for example 1e-5"),
    "model.rope_theta": (Range(0, low_open=True), "set the rotary base, for example 10000 (Llama 3: 500000)"),
    "model.rope_scaling_factor": (Range(0, low_open=True), "set 1 for no rotary scaling (Llama 3.1 uses 8)"),
    "model.rope_low_freq_factor": (Range(0, low_open=True), "set Llama 3.1's value, 1"),
    "model.rope_high_freq_factor": (Range(0, low_open=True), "set Llama 3.1's value, 4"),
    "model.rope_original_max_len": (_COUNT, "set the context the scaled model was trained at (Llama 3.1: 8192)"),
    "train.global_batch_size": (_COUNT, "set sequences per optimizer step, for example 16"),
    "train.micro_batch_size": (_COUNT, "set sequences per forward/backward, for example 8"),
    "train.max_steps": (_COUNT, "set the optimizer steps of the whole run, for example 300"),
    "train.stop_at_step": (_COUNT_OR_NULL, "set a step to stop this invocation at, or null to run to max_steps"),
    "train.lr": (Range(0, low_open=True), "set the peak learning rate, for example 3e-4"),
    "train.min_lr_ratio": (Range(0, 1), "set the final learning rate as a fraction of train.lr, for example 0.1"),
    "train.warmup_steps": (Range(0), "set 0 for no warmup, for example 20"),
    "train.weight_decay": (Range(0), "set 0 to turn it off, for example 0.1"),
    "train.beta1": (Range(0, 1, high_open=True), "set AdamW's first-moment decay, for example 0.9"),
    "train.beta2": (Range(0, 1, high_open=True), "set AdamW's second-moment decay, for example 0.95"),
    "train.grad_clip": (Range(0), "set the gradient-norm limit, for example 1.0 (0 turns clipping off)"),
    "train.seed": (Range(0, 2**32 - 1), "set a seed such as 0"),
    "train.log_every": (_COUNT, "set steps between logged metrics, for example 10"),
    "train.val_every": (_COUNT, "set steps between validations, for example 100 (data.val=null turns it off)"),
    "train.val_batches": (_COUNT, "set global batches per validation, for example 4 (data.val=null turns it off)"),
    "train.sample_tokens": (Range(0), "set tokens per sample, for example 32 (0 turns samples off)"),
    "train.checkpoint_every": (_COUNT, "set steps between checkpoints, for example 100"),
    "train.checkpoint_every_s": (_SECONDS_OR_NULL, "set seconds between checkpoints, or null for steps only"),
    "train.keep_checkpoints": (_COUNT, "set how many latest checkpoints to keep, for example 2"),
    "train.memory_checkpoint_every": (_COUNT_OR_NULL, "set steps between in-memory checkpoints, or null for none"),
    "train.keep_checkpoint_every": (_COUNT_OR_NULL, "set a step multiple to keep, or null to keep none"),
    "train.max_nonfinite_steps": (_COUNT_OR_NULL, "set skipped steps in a row before stopping, or null to never stop"),
    "train.hang_timeout_s": (_SECONDS_OR_NULL, "set seconds without a finished step, or null to derive them"),
    "train.close_timeout_s": (_SECONDS, "set seconds the end of a run may take, for example 3600"),
    "train.hang_factor": (Range(1), "set a multiple of the median step time, for example 10"),
    "train.hang_min_s": (_SECONDS, "set the least seconds a derived hang deadline may be, for example 120"),
    "train.straggler_factor": (Range(1, low_open=True), "set a multiple of the median step time above 1, e.g. 1.5"),
    "train.straggler_windows": (_COUNT, "set log windows in a row before a rank is named, for example 3"),
    "cluster.cpus_per_worker": (Range(0, low_open=True), "set CPUs per worker, for example 1"),
    "cluster.max_failures": (Range(-1), "set restarts after failures, for example 3 (-1: without limit, 0: none)"),
    "cluster.max_attempts_without_progress": (
        Range(1, 1000),
        "set attempts in a row that may end without a new checkpoint before the run stops, for example 5",
    ),
    "storage.retry_deadline_s": (_SECONDS, "set seconds to retry a storage or network error, for example 90"),
    "cluster.resize_interval_s": (_SECONDS, "set seconds between checks for room to grow, for example 60"),
    "cluster.health_check_interval_s": (_SECONDS_OR_NULL, "set seconds between polls, or null to derive them"),
    "cluster.resource_wait_s": (_SECONDS, "set seconds to wait for room for the workers, for example 300"),
    "tracking.flush_timeout_s": (Range(0), "set seconds to wait for an Aim server at the end, for example 60"),
}


def check_range(key: str, value: Any) -> None:
    """One line naming the key, the value, its range and the fix; NaN and infinity lie in no range."""
    valid, fix = RANGES[key]
    if valid.holds(value):
        return
    finite = "a finite number " if isinstance(value, float) and not math.isfinite(value) else ""
    raise ConfigError(f"{key} must be {finite}{valid}, got {value!r}; {fix}")


def check_ranges(config: Any, keys: list[str]) -> None:
    """``section.key`` of a config tree, each against its range."""
    for key in keys:
        section, name = key.split(".")
        check_range(key, getattr(getattr(config, section), name))


def _text(key: str, value: Any, fix: str, null: bool = False) -> None:
    """A name or path: a non-empty string (or null where that means "unset")."""
    if value is None and null:
        return
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key} must be a non-empty string{' or null' if null else ''}, got {value!r}; {fix}")


def check_names(run: RunSettings) -> None:
    _text("run.name", run.name, "name the run, for example run.name=tiny")
    _text("run.dir", run.dir, "give a local path or s3:// URI for the run's files, for example runs/tiny")


def check_paths(key: str, value: str | list[str], fix: str) -> None:
    """A path, glob or folder, or a non-empty list of them."""
    if isinstance(value, list):
        if not value:
            raise ConfigError(f"{key} must name at least one path, got []; {fix}")
        for i, path in enumerate(value):
            _text(f"{key}[{i}]", path, fix)
    else:
        _text(key, value, fix)


def check_data(d: DataSettings) -> None:
    fix = "give a path, glob or folder of shards, local or s3://"
    if isinstance(d.train, list) and any(dataclasses.is_dataclass(s) for s in d.train):
        for i, source in enumerate(d.train):
            check_source(f"data.train[{i}]", source)
    else:
        check_paths("data.train", d.train, fix)
    if d.val is not None:
        check_paths("data.val", d.val, fix + ", or data.val=null for no validation")
    _text("data.text_field", d.text_field, "name the jsonl field or parquet column with the text, for example text")
    _text("data.tokenizer", d.tokenizer, "give a tokenizer.json path, or null to train one", null=True)
    if d.on_bad_shard not in ("error", "skip"):
        raise ConfigError(f"data.on_bad_shard must be error or skip, got {d.on_bad_shard!r}; set one of them")
    if d.on_change not in ("refuse", "restart"):
        raise ConfigError(f"data.on_change must be refuse or restart, got {d.on_change!r}; set one of them")


def check_storage(s: StorageSettings) -> None:
    url = s.endpoint_url
    if url is not None and not re.match(r"https?://[^/\s]", url):
        raise ConfigError(
            f"storage.endpoint_url must be an http:// or https:// URL or null, got {redact_url(url)!r}; "
            "write the scheme, for example http://127.0.0.1:9000"
        )
    _text("storage.region", s.region, "name the region, for example us-east-1, or null", null=True)


def check_source(key: str, source: SourceSettings) -> None:
    if not source.path:
        raise ConfigError(f"{key}.path is empty; give the source's path, glob or folder")
    check_paths(f"{key}.path", source.path, "give the source's path, glob or folder")
    if not Range(0, low_open=True).holds(source.weight):
        raise ConfigError(f"{key}.weight must be > 0, got {source.weight!r}; give the source's share, for example 0.3")
    _text(f"{key}.name", source.name, "name the source, or null for its path's last part", null=True)
    _text(f"{key}.text_field", source.text_field, "name the field, or null for data.text_field", null=True)


def hf_shape_keys(model_settings) -> tuple[str, ...]:
    """The model keys that model.init_from's config.json sets (rayllm.config.resolve); the others stay the YAML's."""
    return tuple(
        f"model.{f.name}" for f in dataclasses.fields(model_settings) if f.name not in ("ffn_multiple_of", "init_from")
    )


def check_model(m: ModelSettings, shape: bool = True) -> None:
    """The model section; ``shape=False`` skips the keys model.init_from's folder will set."""
    _text("model.init_from", m.init_from, "give a Hugging Face Llama folder (local or s3://), or null", null=True)
    for key in (k for k in RANGES if k.startswith("model.")):
        if shape or key not in hf_shape_keys(m):
            check_range(key, getattr(m, key.split(".")[1]))
    if not shape:
        return
    if m.dim % m.n_heads:
        raise ConfigError(
            f"model.dim ({m.dim}) must be divisible by model.n_heads ({m.n_heads}); pick a width that is a multiple"
        )
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(
            f"model.dim / model.n_heads must be even for rotary embeddings, got {m.dim // m.n_heads}; "
            "pick a width and head count whose head size is even"
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.n_kv_heads}); "
            "pick key/value heads that divide the heads"
        )
    if m.rope_scaling_factor != 1.0 and m.rope_low_freq_factor >= m.rope_high_freq_factor:
        raise ConfigError(
            f"model.rope_low_freq_factor ({m.rope_low_freq_factor:g}) must be below model.rope_high_freq_factor "
            f"({m.rope_high_freq_factor:g}) when rotary scaling is on; use Llama 3.1's 1 and 4"
        )


def check_train(t: TrainingSettings, c: ClusterSettings) -> None:
    if t.precision not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"train.precision must be one of auto, fp32, bf16, got {t.precision!r}; set one of them")
    if t.compile not in ("auto", True, False):
        raise ConfigError(f"train.compile must be auto, true or false; got {t.compile!r}")
    checkpoint_mode(t.activation_checkpointing)
    if t.float8 not in (True, False):
        raise ConfigError(f"train.float8 must be true or false; got {t.float8!r}")
    if t.float8 and not c.use_gpu:
        raise ConfigError(
            "train.float8 needs GPUs with float8 matmuls (H100, H200, L40S): set cluster.use_gpu: true, "
            "or train.float8: false on CPU"
        )
    if t.cpu_offload and not c.use_gpu:
        raise ConfigError(
            "train.cpu_offload moves GPU state to CPU memory and needs cluster.use_gpu: true; "
            "on CPU the model already lives in CPU memory (set train.cpu_offload: false)"
        )


def check_cluster(c: ClusterSettings) -> None:
    if isinstance(c.num_workers, list):
        if len(c.num_workers) != 2 or not 1 <= c.num_workers[0] <= c.num_workers[1]:
            raise ConfigError(
                f"cluster.num_workers as a list must be [min, max] with 1 <= min <= max, got {c.num_workers}; "
                "for example [1, 4], or an int for a fixed size"
            )
    elif c.num_workers < 1:
        raise ConfigError(f"cluster.num_workers must be >= 1, got {c.num_workers}; for example 2")
    for name, amount in c.worker_resources.items():
        key = f"cluster.worker_resources.{name}"
        if not name.strip() or name in ("CPU", "GPU"):
            raise ConfigError(
                f"{key}: {name!r} is not a custom resource name; set CPUs with cluster.cpus_per_worker and GPUs "
                "with cluster.use_gpu, and name custom resources as the Ray nodes do, for example trainer"
            )
        if not Range(0).holds(amount):
            raise ConfigError(f"{key} must be a finite number >= 0, got {amount!r}; for example 1")
    _text("cluster.address", c.address, "give a Ray address such as ray://head:10001, or null", null=True)
    if c.interruption_notice not in (None, *INTERRUPTION_NOTICES):
        raise ConfigError(
            f"cluster.interruption_notice must be one of {', '.join(INTERRUPTION_NOTICES)} or null (each node's "
            f"RAYLLM_INTERRUPTION_NOTICE), got {c.interruption_notice!r}; for example aws on EC2 spot nodes"
        )
    endpoint = c.interruption_endpoint
    if endpoint is not None and not re.fullmatch(r"https?://[^\s/]+/?\S*", str(endpoint)):
        raise ConfigError(
            f"cluster.interruption_endpoint must be an http:// URL or null (the cloud's own), got "
            f"{redact_url(str(endpoint))!r}; for example http://169.254.169.254"
        )


def check_parallel(
    p: ParallelSettings,
    t: TrainingSettings,
    m: ModelSettings,
    seq_len: int,
    worker_range: tuple[int, int],
    use_gpu: bool = False,
) -> None:
    """The layout must fit the smallest and the largest world, and split the batch and the model
    (and, under parallel.pp, make a pipeline torch's schedule runs)."""
    if p.cp > 1 and use_gpu and t.precision == "fp32":
        raise ConfigError(
            "parallel.cp > 1 with train.precision fp32 on GPUs: CUDA's fp32 attention with grouped-query heads is the "
            "math kernel, which torch's ring attention does not take; set train.precision: bf16 (or auto)"
        )
    lo, hi = worker_range
    for n in sorted({lo, hi}):
        layout = resolve_layout(p, n)
        accum = check_batch_split(t.global_batch_size, t.micro_batch_size, layout.dp)
        if layout.pp > 1:
            plan_pipeline(p, accum, m.n_layers, compiles(t.compile, use_gpu))
        check_model_split(
            layout,
            n_heads=m.n_heads,
            n_kv_heads=m.n_kv_heads,
            hidden=m.ffn_hidden,
            seq_len=seq_len,
            tied=m.tie_embeddings,
        )


def check_tracking(k: TrackingSettings) -> None:
    _text("tracking.repo", k.repo, "give an Aim repo folder or aim://HOST:PORT, or null for the default", null=True)
    _text("tracking.experiment", k.experiment, "name the experiment, or null for run.name", null=True)
    repo = k.repo or ""
    if not repo.startswith("aim://"):
        return
    found = re.fullmatch(r"aim://[^/:\s]+:(\d+)/?", repo)
    if not found:
        raise ConfigError(
            f"tracking.repo {redact_url(repo)!r} is not an Aim server address; write aim://HOST:PORT, "
            "for example aim://127.0.0.1:53800 (the port `aim server` listens on)"
        )
    if not 1 <= int(found.group(1)) <= 65535:
        raise ConfigError(
            f"tracking.repo {redact_url(repo)!r} has port {int(found.group(1))}, outside 1..65535; write "
            "aim://HOST:PORT with the port `aim server` listens on, for example aim://127.0.0.1:53800"
        )


# The model keys that model.init_from's config.json sets (rayllm.config.resolve); the others stay the YAML's.
HF_SHAPE_KEYS = hf_shape_keys(ModelSettings)
