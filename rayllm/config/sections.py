"""The sections of a run's config tree (train.py joins them): the only place defaults live."""

from __future__ import annotations

from dataclasses import dataclass, field

from rayllm.model.shape import ModelShape


@dataclass
class RunSettings:
    """Where a run lives: ``dir`` (local path or s3:// URI) holds checkpoints and files."""

    name: str = "tiny"
    dir: str = "runs/tiny"
    # A run owns its dir through a lease whose heartbeat the driver renews; a lease without a
    # heartbeat for this long belongs to a run that is gone, and the next run takes it over.
    lease_timeout_s: float = 60.0


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
    # Shards of a source read at once and interleaved, so each batch mixes many shards
    # (1: one shard after another, the order of rayllm before mixing).
    mix_shards: int = 32
    # Save the ids (epoch, shard, index) of the sequences trained on with each checkpoint.
    record_ids: bool = False
    # Prepare the bundled demo corpus when `train` points at the missing demo folder.
    demo_corpus: bool = True
    # At most this many tokenize tasks per reading task (Ray path); how many run follows from
    # the tokens/s the run consumes and the measured per-core rate (docs/data.md). 0: none, the
    # reading task tokenizes alone.
    tokenize_tasks: int = 8
    # A shard that cannot be read: "error" stops the run naming it; "skip" skips it and counts it.
    on_bad_shard: str = "error"
    # A resume whose data differs from its checkpoint's (tokenizer, seq_len, seed, a source's shards,
    # weights or the sources themselves): "refuse" stops naming what changed; "restart" starts a new
    # data order there (the changed sources from their beginning) and says so (docs/data.md).
    on_change: str = "refuse"
    # The most bytes one document may take: a jsonl line (after decompression) or a whole .txt shard.
    # A longer one, such as a newline-less file or a compressed bomb, is stopped there, never read
    # whole: an error naming the shard, or with on_bad_shard: skip left out and counted.
    max_document_bytes: int = 64 << 20
    # How long a rank waits for its next batch from the data stream before the attempt fails
    # with an error naming the wait (a stalled or lost stream server); the run then restarts
    # from its latest checkpoint.
    wait_timeout_s: float = 300.0


@dataclass
class ModelSettings(ModelShape):
    """Llama-style decoder shape (rayllm.model.shape, the one definition), and where to start from.

    Not frozen, unlike the shape it extends: model.init_from's config.json fills it in on the driver.
    """

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
    # Also checkpoint into Ray's object store every this many steps (Ray runs; null: off): each
    # rank's shards are held by a keeper actor on its node and on another node, outliving the
    # worker group. A restart after a lost worker or node resumes from the newest one whole on
    # the surviving nodes, else from storage, which stays the durable record.
    memory_checkpoint_every: int | None = None
    # Also keep every checkpoint at a multiple of this many steps, in run.dir/kept/ (null: none).
    keep_checkpoint_every: int | None = None
    # Write checkpoints in the background (DCP async_save, then an async upload): the step loop
    # waits only for the copy to CPU memory. Off: every save blocks until it is stored.
    async_checkpoint: bool = True
    # "auto": bf16 compute on GPU, fp32 on CPU.
    precision: str = "auto"
    # Recompute activations in backward: true (full: each block keeps only its input, for about a
    # third more compute), selective (each block keeps its matmuls' and attention's outputs and
    # recomputes only the element-wise ops: half to three quarters of the memory, almost no
    # compute), or false.
    activation_checkpointing: bool | str = False
    # FSDP keeps parameters, gradients and optimizer state in CPU memory between uses (GPU only):
    # the largest model per GPU, at the cost of host-device copies and a CPU optimizer step.
    cpu_offload: bool = False
    # torch.compile each transformer block. "auto": on GPU; on CPU it needs a C++ compiler and
    # pays off only on long runs (it takes seconds to minutes before the first step).
    compile: bool | str = "auto"
    # The blocks' matmuls in float8 through torchao (pip install 'rayllm[float8]'), dynamic
    # tensorwise scaling, FSDP all-gathers in float8: GPUs of compute capability 8.9 or newer
    # (H100, H200, L40S) only. Weights, gradients and optimizer stay fp32; checkpoints load either way.
    float8: bool = False
    # A step whose loss or gradient norm is NaN or infinite is skipped (no update, no checkpoint);
    # after this many in a row the run stops with its message (null: skip them all, never stop).
    max_nonfinite_steps: int | None = 3
    # A rank with no finished step for this long is hung: its stacks go to run.dir/hangs/, the
    # rank that did not reach the step's end is named, and the attempt restarts from the latest
    # checkpoint. null: max(hang_min_s, hang_factor x the median step time).
    hang_timeout_s: float | None = None
    # The end of a run (the last commit, the milestone copy to kept/) is no hang, but must end
    # within this many seconds; a copy cut off is finished when the run next starts.
    close_timeout_s: float = 3600.0
    hang_factor: float = 10.0
    hang_min_s: float = 120.0
    # A rank whose own step time (less data and end-of-step waits) is above straggler_factor x the
    # median in straggler_windows log windows in a row is named on the progress line.
    straggler_factor: float = 1.5
    straggler_windows: int = 3


@dataclass
class ParallelSettings:
    """How the ranks are laid out: pp x dp_replicate x dp_shard x tp = the world (rayllm.parallel.mesh).

    FSDP shards over dp_shard ranks; dp_replicate > 1 is HSDP (shard inside a group, usually a
    node, replicate across groups: all-gathers stay inside the node); tp > 1 splits every block's
    matmuls over that many neighbouring ranks (keep it inside a node). Each degree is a number
    or "auto" (see rayllm.parallel.mesh.resolve_shape)."""

    dp_shard: int | str = "auto"  # auto: what the other degrees leave of the world
    # auto: one replica per node when a GPU run spans whole nodes (HSDP), else 1; with a fixed
    # dp_shard, what the world leaves (an elastic run then grows by whole dp_shard x tp groups).
    dp_replicate: int | str = "auto"
    tp: int | str = 1  # auto: 1, or the GPUs of a node for models too large to shard by FSDP alone
    # Pipeline stages, the outermost axis (rayllm.parallel.pipeline): each stage holds contiguous
    # layers (balanced by FLOPs) and world / pp ranks laid out by the degrees above.
    pp: int = 1
    # torch.distributed.pipelining's schedule by name: 1F1B, GPipe, Interleaved1F1B, LoopedBFS,
    # InterleavedZeroBubble, ZBVZeroBubble or DualPipeV. Micro-batches per step: the accumulation
    # steps the global batch implies (global / (micro x data-parallel ranks)).
    pp_schedule: str = "1F1B"
    # Stages each rank holds: auto is 1 for one-stage schedules (1F1B, GPipe), 2 for the others.
    pp_stages_per_rank: int | str = "auto"
    # Context parallelism (rayllm.parallel.cp): ranks that split every sequence for attention
    # (ring attention, causal load-balanced), next to tp; for contexts past what one GPU holds.
    cp: int = 1


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
    # Attempts in a row that may end without a new checkpoint (a crash at the same step, a process
    # killed before its failure could be recorded) before the run stops, naming the step; attempts
    # ended by a storage outage (storage.retry_deadline_s) do not count.
    max_attempts_without_progress: int = 5
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
    # Which interruption notice each training node watches (runtime/interruption.py): aws, gcp,
    # file (a preStop hook's), or off; null: each node's RAYLLM_INTERRUPTION_NOTICE (the cluster
    # configs set it on their spot nodes), none where unset.
    interruption_notice: str | None = None
    # The metadata service's address (null: the cloud's own); a node's RAYLLM_METADATA_ENDPOINT wins.
    interruption_endpoint: str | None = None


@dataclass
class TrackingSettings:
    """Aim tracking: ``repo`` defaults to ``<run.dir>/aim`` (~/.rayllm/aim for a run.dir on object storage)."""

    enabled: bool = True
    repo: str | None = None
    experiment: str | None = None
    # With an ``aim://`` repo: how long the end of a run waits for an unreachable server to come
    # back and take what Aim buffered, before it gives that up (it stays in metrics.jsonl).
    flush_timeout_s: float = 60.0
