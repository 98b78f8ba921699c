"""One typed config tree for a run: the only place defaults live.

A YAML file gives the tree, dotted overrides (``train.max_steps=50``) patch it, and
validation rejects unknown keys (naming the nearest valid key) and wrong types before
any worker starts. The resolved tree is what a run records.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Union

import yaml

from rayllm import credentials
from rayllm.credentials import REDACTED, redact_url
from rayllm.errors import ConfigError


@dataclass
class RunSettings:
    """Where a run lives: ``dir`` (local path or s3:// URI) holds checkpoints and files."""

    name: str = "tiny"
    dir: str = "runs/tiny"


@dataclass(repr=False)
class StorageSettings:
    """Object-store access for s3:// paths; unset values fall back to the AWS defaults.

    Its repr never shows a credential, and once ``sealed`` it pickles with its secret values
    left in Ray's object store (rayllm.credentials): the one way they travel to other processes.
    """

    endpoint_url: str | None = None
    key: str | None = None
    secret: str | None = None
    region: str | None = None
    anon: bool = False

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def __repr__(self) -> str:
        shown = self._fields()
        for name in credentials.secret_values(shown):
            shown[name] = redact_url(shown[name]) if name == "endpoint_url" else REDACTED
        return "StorageSettings(" + ", ".join(f"{k}={v!r}" for k, v in shown.items()) + ")"

    def credentials(self) -> dict[str, str]:
        """The key, secret and endpoint URL as given, fetched from the object store when sealed."""
        values = credentials.secret_values(self._fields())
        ref = self.__dict__.get("_sealed")
        return {**values, **credentials.resolve(ref)} if ref is not None else values

    def sealed(self) -> StorageSettings:
        """A copy to hand to other processes: its secrets go into Ray's object store (driver, Ray up)."""
        copy = dataclasses.replace(self)
        values = credentials.secret_values(self._fields())
        if values:
            copy.__dict__["_sealed"] = credentials.seal(values)
        return copy

    def __getstate__(self) -> dict[str, Any]:
        state = self._fields()
        secret = credentials.secret_values(state)
        ref = self.__dict__.get("_sealed")
        if secret and ref is None and credentials.ray_running_here():
            raise RuntimeError(
                "StorageSettings with credentials pickled while Ray runs: hand other processes "
                "storage.sealed(), so the credentials travel only through Ray's object store"
            )
        if ref is not None:
            for name in secret:
                state[name] = redact_url(state[name]) if name == "endpoint_url" else None
            state["_sealed"] = ref
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


SECRET_KEYS = credentials.SECRET_FIELDS


@dataclass
class SourceSettings:
    """One source of a weighted mixture: ``data.train: [{path: ..., weight: 0.7}, ...]``."""

    path: str | list[str] = ""
    weight: float = 1.0
    name: str | None = None  # default: the path's last part
    text_field: str | None = None  # default: data.text_field


@dataclass
class DataSettings:
    """Shards to read and how they become packed token sequences."""

    # A path, glob, folder or list of them; or a list of weighted sources (SourceSettings).
    train: str | list[str] | list[SourceSettings] = "data/demo/train"
    val: str | list[str] | None = "data/demo/val"
    seq_len: int = 256
    text_field: str = "text"
    # A tokenizer.json to load; when unset, a byte-level BPE is trained on a sample.
    tokenizer: str | None = None
    tokenizer_sample_docs: int = 4000
    # Sequences per shuffle window of the global stream (1 turns shuffling off).
    shuffle_window: int = 4096
    # Save the ids (epoch, shard, index) of the sequences trained on with each checkpoint.
    record_ids: bool = False
    # Prepare the bundled demo corpus when `train` points at the missing demo folder.
    demo_corpus: bool = True
    # Concurrent tokenize-and-pack tasks in the Ray Data pipeline (per reading worker).
    tokenize_tasks: int = 2
    # A shard that cannot be read: "error" stops the run naming it; "skip" skips it and counts it.
    on_bad_shard: str = "error"
    # How long a rank waits for its next batch from the data stream before the attempt fails
    # with an error naming the wait (a stalled or lost stream server); the run then restarts
    # from its latest checkpoint.
    wait_timeout_s: float = 300.0
    storage: StorageSettings = field(default_factory=StorageSettings)


@dataclass
class ModelSettings:
    """Llama-style decoder shape."""

    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 4096
    ffn_hidden: int | None = None  # default: 8/3 * dim rounded up to ffn_multiple_of
    ffn_multiple_of: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3.1-style rotary scaling (transformers' rope_type "llama3"): 1.0 is none. Long
    # wavelengths are slowed by the factor, short ones kept, those between blended.
    rope_scaling_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    tie_embeddings: bool = False
    # A local Hugging Face Llama folder (config.json, safetensors, tokenizer.json) to start from:
    # continued pretraining. Its config.json sets the shape above, its tokenizer.json data.tokenizer
    # (unless set), and its weights replace the random initialisation.
    init_from: str | None = None


@dataclass
class TrainingSettings:
    """Optimisation: the global batch is sequences per optimizer step, whatever the world size."""

    global_batch_size: int = 16
    micro_batch_size: int = 8
    max_steps: int = 300
    # End this invocation at this step (with a checkpoint) without changing the schedule;
    # running again continues to max_steps.
    stop_at_step: int | None = None
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 10
    val_every: int = 100
    val_batches: int = 4
    # At each validation, greedy continuations of these prompts go to Aim as text (0 tokens: off).
    sample_prompts: list[str] = field(default_factory=lambda: ["The ", "def "])
    sample_tokens: int = 32
    checkpoint_every: int = 100
    # Also checkpoint when this many seconds have passed since the last one (null: steps only).
    checkpoint_every_s: float | None = None
    keep_checkpoints: int = 2
    # Also keep every checkpoint at a multiple of this many steps, in run.dir/kept/ (null: none).
    keep_checkpoint_every: int | None = None
    # Write checkpoints in the background (DCP async_save, then an async upload): the step loop
    # waits only for the copy to CPU memory. Off: every save blocks until it is stored.
    async_checkpoint: bool = True
    # "auto": bf16 compute on GPU, fp32 on CPU.
    precision: str = "auto"
    # Recompute each block's activations in backward: less memory for about a third more compute.
    activation_checkpointing: bool = False
    # FSDP keeps parameters, gradients and optimizer state in CPU memory between uses (GPU only):
    # the largest model per GPU, at the cost of host-device copies and a CPU optimizer step.
    cpu_offload: bool = False
    # torch.compile each transformer block. "auto": on GPU; on CPU it needs a C++ compiler and
    # pays off only on long runs (it takes seconds to minutes before the first step).
    compile: bool | str = "auto"
    # A step whose loss or gradient norm is NaN or infinite is skipped (no update, no checkpoint);
    # after this many in a row the run stops with its message (null: skip them all, never stop).
    max_nonfinite_steps: int | None = 3


@dataclass
class ClusterSettings:
    """Ray cluster use: ``num_workers`` is an int, or ``[min, max]`` for elastic."""

    num_workers: int | list[int] = 2
    use_gpu: bool = False
    cpus_per_worker: float = 1.0
    # Custom Ray resources each worker also needs, to pin workers to node types: {trainer: 1}.
    worker_resources: dict[str, float] = field(default_factory=dict)
    # Restarts from the latest checkpoint after a worker, node or rank failure (-1: without limit).
    max_failures: int = 3
    # With [min, max] workers: how often Ray Train checks for room to grow the worker group.
    resize_interval_s: float = 60.0
    # How often Ray Train's controller polls the workers: how soon a dead worker is noticed and a
    # reported checkpoint registered, so resumable (null: Ray's own default, 2 s).
    health_check_interval_s: float | None = None
    # How long to wait for room for the workers and the data tasks on a cluster that cannot grow
    # (no autoscaler) before the run ends naming the fix; with an autoscaler it waits, showing it.
    resource_wait_s: float = 300.0
    # Ray address; unset means RAY_ADDRESS when set, else a local Ray on 127.0.0.1.
    address: str | None = None


@dataclass
class TrackingSettings:
    """Aim tracking: ``repo`` defaults to ``<run.dir>/aim`` (or ./.aim for remote run dirs)."""

    enabled: bool = True
    repo: str | None = None
    experiment: str | None = None
    # With an ``aim://`` repo: how long the end of a run waits for an unreachable server to come
    # back and take what Aim buffered, before it gives that up (it stays in metrics.jsonl).
    flush_timeout_s: float = 60.0


@dataclass
class TrainConfig:
    """The whole run."""

    run: RunSettings = field(default_factory=RunSettings)
    data: DataSettings = field(default_factory=DataSettings)
    model: ModelSettings = field(default_factory=ModelSettings)
    train: TrainingSettings = field(default_factory=TrainingSettings)
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    tracking: TrackingSettings = field(default_factory=TrackingSettings)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, overrides: list[str] | None = None) -> TrainConfig:
        """Load a YAML file and apply dotted ``key=value`` overrides."""
        return cls.from_dict(read_yaml_mapping(path), overrides)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], overrides: list[str] | None = None) -> TrainConfig:
        config = build_config(cls, raw, overrides)
        config.validate()
        return config

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def redacted(self) -> dict[str, Any]:
        """The tree as a run records it: credentials replaced, so they never reach a log or tracker."""
        tree = self.to_dict()
        storage = tree["data"]["storage"]
        for name in credentials.secret_values(storage):
            storage[name] = redact_url(storage[name]) if name == "endpoint_url" else REDACTED
        if tree["tracking"].get("repo"):
            tree["tracking"]["repo"] = redact_url(tree["tracking"]["repo"])
        return tree

    def with_overrides(self, overrides: list[str]) -> TrainConfig:
        return TrainConfig.from_dict(self.to_dict(), overrides)

    @property
    def worker_range(self) -> tuple[int, int]:
        n = self.cluster.num_workers
        return (n, n) if isinstance(n, int) else (n[0], n[1])

    def _shape_from_hf(self, folder: str) -> None:
        """model.init_from: the model section (and, unless set, data.tokenizer) from the folder."""
        from rayllm.errors import CheckpointError
        from rayllm.hf import TOKENIZER_FILE, model_args_from_hf, read_config

        try:
            args = model_args_from_hf(read_config(folder), folder)
        except CheckpointError as e:
            raise ConfigError(f"model.init_from: {e}") from None
        for f in dataclasses.fields(ModelSettings):
            if f.name not in ("ffn_hidden", "ffn_multiple_of", "init_from"):  # every other key is ModelArgs'
                setattr(self.model, f.name, getattr(args, f.name))
        self.model.ffn_hidden = args.hidden_dim
        if self.data.tokenizer is None and os.path.exists(os.path.join(folder, TOKENIZER_FILE)):
            self.data.tokenizer = os.path.join(folder, TOKENIZER_FILE)

    def validate(self) -> None:
        """Cross-field checks that types alone cannot express."""
        m, t, c = self.model, self.train, self.cluster
        if m.init_from:
            self._shape_from_hf(m.init_from)
        _positive(
            self,
            [
                "data.seq_len",
                "model.dim",
                "model.n_layers",
                "model.n_heads",
                "model.n_kv_heads",
                "model.vocab_size",
                "train.global_batch_size",
                "train.micro_batch_size",
                "train.max_steps",
                "train.log_every",
                "train.val_every",
                "train.checkpoint_every",
                "train.keep_checkpoints",
                "data.tokenize_tasks",
                "data.shuffle_window",
            ],
        )
        if t.keep_checkpoint_every is not None and t.keep_checkpoint_every <= 0:
            raise ConfigError("train.keep_checkpoint_every must be a positive number of steps (or null)")
        if t.checkpoint_every_s is not None and t.checkpoint_every_s <= 0:
            raise ConfigError("train.checkpoint_every_s must be a positive number of seconds (or null for steps only)")
        if c.resize_interval_s <= 0:
            raise ConfigError("cluster.resize_interval_s must be a positive number of seconds")
        if c.health_check_interval_s is not None and c.health_check_interval_s <= 0:
            raise ConfigError("cluster.health_check_interval_s must be a positive number of seconds (or null)")
        if self.tracking.flush_timeout_s < 0:
            raise ConfigError("tracking.flush_timeout_s must be >= 0 seconds")
        repo = self.tracking.repo or ""
        if repo.startswith("aim://") and not re.fullmatch(r"aim://[^/:\s]+:\d+/?", repo):
            raise ConfigError(
                f"tracking.repo {redact_url(repo)!r} is not an Aim server address; write aim://HOST:PORT, "
                "for example aim://127.0.0.1:53800 (the port `aim server` listens on)"
            )
        if m.dim % m.n_heads:
            raise ConfigError(f"model.dim ({m.dim}) must be divisible by model.n_heads ({m.n_heads})")
        if (m.dim // m.n_heads) % 2:
            raise ConfigError("model.dim / model.n_heads must be even for rotary embeddings")
        if m.n_heads % m.n_kv_heads:
            raise ConfigError(f"model.n_heads ({m.n_heads}) must be a multiple of model.n_kv_heads ({m.n_kv_heads})")
        if t.lr <= 0:
            raise ConfigError(f"train.lr must be > 0, got {t.lr}")
        if self.data.on_bad_shard not in ("error", "skip"):
            raise ConfigError(f"data.on_bad_shard must be error or skip; got {self.data.on_bad_shard!r}")
        if isinstance(self.data.train, list) and any(isinstance(s, SourceSettings) for s in self.data.train):
            for i, source in enumerate(self.data.train):
                if not source.path:
                    raise ConfigError(f"data.train[{i}].path is empty; give the source's path, glob or folder")
                if source.weight <= 0:
                    raise ConfigError(f"data.train[{i}].weight must be > 0, got {source.weight}")
        if t.precision not in ("auto", "fp32", "bf16"):
            raise ConfigError(f"train.precision must be one of auto, fp32, bf16; got {t.precision!r}")
        if t.compile not in ("auto", True, False):
            raise ConfigError(f"train.compile must be auto, true or false; got {t.compile!r}")
        if t.cpu_offload and not c.use_gpu:
            raise ConfigError(
                "train.cpu_offload moves GPU state to CPU memory and needs cluster.use_gpu: true; "
                "on CPU the model already lives in CPU memory (set train.cpu_offload: false)"
            )
        if isinstance(c.num_workers, list):
            if len(c.num_workers) != 2 or not 1 <= c.num_workers[0] <= c.num_workers[1]:
                raise ConfigError(
                    f"cluster.num_workers as a list must be [min, max] with 1 <= min <= max, got {c.num_workers}"
                )
        elif c.num_workers < 1:
            raise ConfigError(f"cluster.num_workers must be >= 1, got {c.num_workers}")
        lo, hi = self.worker_range
        for n in {lo, hi}:
            check_batch_split(t.global_batch_size, t.micro_batch_size, n)


def read_yaml_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML config file's top-level mapping, or a ConfigError saying what is wrong with it."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(
            f"config file not found: {path!r}. Pass the path of a YAML file, for example configs/tiny.yaml."
        )
    with open(path) as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of sections, not {type(raw).__name__}")
    return raw


def build_config(cls: type, raw: dict[str, Any], overrides: list[str] | None = None) -> Any:
    """Any dataclass config tree from a mapping plus dotted overrides, with the same key and type checks."""
    raw = _deepcopy(raw)
    for item in overrides or []:
        _apply_override(raw, item, cls)
    return _build(cls, raw, prefix="")


def check_batch_split(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Gradient-accumulation steps that keep ``global_batch`` fixed on ``world_size`` ranks."""
    per_step = micro_batch * world_size
    if global_batch % per_step:
        raise ConfigError(
            f"train.global_batch_size ({global_batch}) must be divisible by train.micro_batch_size "
            f"({micro_batch}) x workers ({world_size}); pick a global batch that is a multiple of {per_step} "
            f"or a smaller micro batch"
        )
    return global_batch // per_step


def _positive(config: TrainConfig, keys: list[str]) -> None:
    for key in keys:
        section, name = key.split(".")
        value = getattr(getattr(config, section), name)
        if value <= 0:
            raise ConfigError(f"{key} must be > 0, got {value}")


def _deepcopy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deepcopy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deepcopy(v) for v in value]
    return value


def _apply_override(raw: dict[str, Any], item: str, root: type) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value, for example train.max_steps=50")
    key, _, text = item.partition("=")
    key = key.strip()
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    node: Any = raw
    parts = key.split(".")
    cls: Any = root
    for i, part in enumerate(parts[:-1]):
        hints = _fields(cls)
        if part not in hints:
            raise ConfigError(_unknown_key_message(".".join(parts[: i + 1]), part, hints))
        cls = _dataclass_of(hints[part])
        if cls is None:
            raise ConfigError(f"override {key!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {'.'.join(parts[: i + 1])} is not a section in the file")
    node[parts[-1]] = value


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _dataclass_of(tp: Any) -> type | None:
    return tp if dataclasses.is_dataclass(tp) else None


def _unknown_key_message(full_key: str, name: str, valid: dict[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    prefix = full_key.rsplit(".", 1)[0] + "." if "." in full_key else ""
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    return f"unknown config key '{full_key}'{hint} Valid keys here: {', '.join(sorted(valid))}"


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config section '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {raw!r}")
    hints = _fields(cls)
    for key in raw:
        if key not in hints:
            raise ConfigError(_unknown_key_message(prefix + str(key), str(key), hints))
    kwargs = {}
    for name, tp in hints.items():
        if name not in raw:
            continue
        full = prefix + name
        sub = _dataclass_of(tp)
        kwargs[name] = _build(sub, raw[name], full + ".") if sub else _coerce(raw[name], tp, full)
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` as type ``tp`` or raise a ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        if isinstance(value, list) and any(isinstance(v, dict) for v in value):
            for option in options:
                if typing.get_origin(option) is list and _dataclass_of(typing.get_args(option)[0]):
                    return _coerce(value, option, key)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
        return {_coerce(k, key_tp, key): _coerce(v, value_tp, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    sub = _dataclass_of(tp)
    if sub is not None:
        return _build(sub, value, key + ".")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(t) for t in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        return f"a mapping of {_type_name(key_tp)} to {_type_name(value_tp)}"
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))
