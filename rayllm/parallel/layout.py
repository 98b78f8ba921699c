"""How a world of ranks splits into parallel axes: pure arithmetic, no torch.

Ranks are laid out row-major over (pp, dp_replicate, dp_shard, cp, tp), as ``init_device_mesh``
numbers them (torchtitan's order): the ``tp`` ranks of one group are neighbours (one node's
GPUs), and the pipeline's stages are the outermost axis, so its point-to-point sends are what
crosses the network while FSDP's gathers stay among nearer ranks. Every rank of a TP group is
fed the same rows, and so is every rank of a CP group (each takes its part of every sequence)
and every stage of one pipeline: the data stream is cut into ``dp`` slices (rayllm.data.order.DataSlicing, which the training loop builds from a Layout).
"""

from __future__ import annotations

from dataclasses import dataclass

from rayllm.errors import ConfigError
from rayllm.parallel.pp import microbatches_fit

AUTO = "auto"
# tp "auto" turns tensor parallelism on (a node's GPUs) from this model size up: below it,
# FSDP/HSDP alone fits a 80 GB GPU with activation checkpointing (see rayllm plan).
TP_AUTO_MIN_PARAMS = 30e9


@dataclass(frozen=True)
class Layout:
    """Degrees of each axis; their product is the world size."""

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1  # pipeline stages (rayllm.parallel.pipeline), the outermost axis
    cp: int = 1  # context parallelism (rayllm.parallel.cp): ranks that split every sequence

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: how many slices each global batch is cut into."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        parts = [f"PP {self.pp}"] if self.pp > 1 else []
        if self.dp_replicate > 1:
            parts.append(f"HSDP {self.dp_replicate}x{self.dp_shard}")
        elif self.dp_shard > 1:
            parts.append(f"FSDP {self.dp_shard}")
        if self.cp > 1:
            parts.append(f"CP {self.cp}")
        if self.tp > 1:
            parts.append(f"TP {self.tp}")
        return " x ".join(parts) or "1 rank"


def _degree(key: str, value: int | str) -> int | None:
    if value == AUTO:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"parallel.{key} must be a whole number >= 1 or auto, got {value!r}; for example 1")
    return value


def resolve_layout(
    settings,
    world_size: int,
    *,
    ranks_per_node: int | None = None,
    n_params: float | None = None,
    use_gpu: bool = False,
) -> Layout:
    """The degrees for ``world_size`` ranks from ``parallel.*`` (``ParallelSettings``).

    auto: tp is ``ranks_per_node`` (at most 8) for a GPU model of 30B parameters or more, else 1;
    dp_replicate is the number of nodes when a GPU run spans several whole nodes (HSDP: all-gathers
    stay inside a node), else 1; dp_shard is what the other two leave. ``parallel.pp`` and
    ``parallel.cp`` are never auto: each pipeline stage holds ``world_size / pp`` ranks, laid out
    as above, with ``cp x tp`` neighbouring ranks in place of ``tp``.
    """
    pp = _degree("pp", settings.pp)
    if pp is None or world_size % pp:
        raise ConfigError(
            f"parallel.pp {settings.pp} does not divide the {world_size} workers; pick a number of pipeline "
            "stages that divides the number of workers"
        )
    world_size //= pp  # the ranks of one stage: what the other axes lay out
    cp = _degree("cp", settings.cp) or 1  # a number: config.checks.RANGES
    tp = _degree("tp", settings.tp)
    replicate = _degree("dp_replicate", settings.dp_replicate)
    shard = _degree("dp_shard", settings.dp_shard)
    whole_nodes = bool(ranks_per_node) and world_size % ranks_per_node == 0 and world_size > ranks_per_node
    if tp is None:
        big = use_gpu and ranks_per_node and n_params is not None and n_params >= TP_AUTO_MIN_PARAMS
        tp = min(8, ranks_per_node) if big else 1
    inner = cp * tp  # neighbours that train on the same rows
    if replicate is None:
        replicate = world_size // ranks_per_node if use_gpu and whole_nodes else 1
        if shard is not None and replicate * shard * inner != world_size:
            replicate = max(1, world_size // max(1, shard * inner))
    if shard is None:
        shard = world_size // (replicate * inner) if world_size % (replicate * inner) == 0 else 0
    layout = Layout(replicate, shard, tp, pp, cp)
    if shard < 1 or layout.world_size != world_size * pp:
        raise ConfigError(
            f"parallel: pp {pp} x dp_replicate {settings.dp_replicate} x dp_shard {settings.dp_shard} x cp "
            f"{settings.cp} x tp {settings.tp} does not lay out {world_size * pp} ranks; pick degrees whose product "
            "is the number of workers (auto fills one in)"
        )
    return layout


def check_model_split(
    layout: Layout, *, n_heads: int, n_kv_heads: int, hidden: int | None, seq_len: int, tied: bool
) -> None:
    """Tensor parallelism splits heads, the feed-forward width (None: not known yet) and, sequence
    parallel, the sequence."""
    tp = layout.tp
    cp = layout.cp
    if cp > 1 and seq_len % (2 * cp * tp):
        raise ConfigError(
            f"parallel.cp {cp} needs data.seq_len ({seq_len}) to be a multiple of 2 x cp x tp ({2 * cp * tp}): each "
            "rank takes a head and a tail chunk of every sequence (causal attention's load balance), split by tp"
        )
    if tied and layout.pp > 1:
        raise ConfigError(
            "parallel.pp > 1 with model.tie_embeddings is not supported (the embedding and the output head live in "
            "different pipeline stages); set model.tie_embeddings: false, or parallel.pp: 1"
        )
    for name, value in (
        ("model.n_heads", n_heads),
        ("model.n_kv_heads", n_kv_heads),
        ("the feed-forward width", hidden),
        ("data.seq_len", seq_len),
    ):
        if tp > 1 and value is not None and value % tp:
            raise ConfigError(f"parallel.tp {tp} must divide {name} ({value}); pick a tp that divides it")
    if tied and tp > 1:
        raise ConfigError(
            "parallel.tp > 1 with model.tie_embeddings is not supported (the embedding and the output head would be "
            "split two ways); set parallel.tp: 1 (FSDP/HSDP alone), or model.tie_embeddings: false"
        )


def unit(settings) -> int:
    """Ranks the world grows and shrinks by: one whole (dp_shard x tp) group, or one TP group, in
    every pipeline stage (a whole pipeline replica)."""
    pp = settings.pp if isinstance(settings.pp, int) else 1
    tp = (settings.tp if isinstance(settings.tp, int) else 1) * (settings.cp if isinstance(settings.cp, int) else 1)
    shard = settings.dp_shard if isinstance(settings.dp_shard, int) else 1
    replicate = settings.dp_replicate if isinstance(settings.dp_replicate, int) else 1
    if settings.dp_shard == AUTO:
        return pp * replicate * tp
    return pp * shard * tp


def usable_world_sizes(settings, lo: int, hi: int, global_batch: int, micro_batch: int) -> list[int]:
    """World sizes in [lo, hi] the layout and the global batch both allow (elastic runs pick one),
    and under a pipeline, its schedule's micro-batches."""
    step = unit(settings)
    sizes = []
    for n in range(lo, hi + 1):
        if n % step:
            continue
        try:
            layout = resolve_layout(settings, n)
        except ConfigError:
            continue
        if global_batch % (micro_batch * layout.dp):
            continue
        microbatches = global_batch // (micro_batch * layout.dp)
        if layout.pp == 1 or microbatches_fit(str(settings.pp_schedule), layout.pp, microbatches):
            sizes.append(n)
    return sizes


def check_placement(layout: Layout, nodes: list[str]) -> None:
    """Refuse a placement whose fast groups cross the network: each TP group inside one node (its
    collectives run every layer), each CP group (with its TP ranks) and under HSDP each shard
    group inside one node or made of whole nodes (their ring and all-gathers run every block;
    the replicas' all-reduce is the one meant to cross nodes). ``nodes``: each rank's node, in
    rank order. Ranks run row-major over (pp, dp_replicate, dp_shard, cp, tp), so a group is a
    run of consecutive ranks (a pipeline's stages are meant to cross nodes)."""
    per_node: dict[str, int] = {}
    for node in nodes:
        per_node[node] = per_node.get(node, 0) + 1
    groups = [("TP", layout.tp, "parallel.tp")]
    if layout.cp > 1:  # its ring runs every block: inside a node, or over whole nodes
        groups.append(("CP", layout.cp * layout.tp, "parallel.cp"))
    if layout.dp_replicate > 1:
        groups.append(("HSDP shard", layout.dp_shard * layout.cp * layout.tp, "parallel.dp_shard"))
    for what, size, key in groups:
        for start in range(0, len(nodes), size) if size > 1 else []:
            members = nodes[start : start + size]
            spanned = list(dict.fromkeys(members))
            whole = what != "TP" and all(members.count(n) == per_node[n] for n in spanned)
            if len(spanned) > 1 and not whole:
                raise ConfigError(
                    f"the {what} group of ranks {start}-{start + size - 1} would span nodes {', '.join(spanned)} "
                    f"({', '.join(str(members.count(n)) for n in spanned)} ranks each), so its collectives would "
                    f"cross the network; give every node a multiple of {size} workers (its GPUs), or lower {key}"
                )


def compiles(setting: bool | str, on_gpu: bool) -> bool:
    """``train.compile``: "auto" compiles on GPU only (on CPU it needs a C++ compiler and long runs),
    under tensor parallelism too (rayllm.parallel.tp.settle_embedding_output)."""
    return on_gpu if setting == "auto" else bool(setting)


CHECKPOINT_MODES = ("off", "full", "selective")  # rayllm.parallel.checkpointing


def checkpoint_mode(setting: bool | str) -> str:
    """``train.activation_checkpointing`` as one of CHECKPOINT_MODES: false is off, true is full."""
    mode = ("full" if setting else "off") if isinstance(setting, bool) else setting
    if mode not in CHECKPOINT_MODES:
        raise ConfigError(f"train.activation_checkpointing must be false, true (full) or selective; got {setting!r}")
    return mode
