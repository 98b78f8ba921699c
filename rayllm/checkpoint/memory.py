"""In-memory checkpoints: checkpoint folders whose files live in Ray's object store, twice.

A ``Keeper`` actor per node holds files as objects it put itself (so it owns them: a dead
training worker takes none with it). A writer puts a file once, as an array (no Python bytes);
its node's keeper and a neighbour's fetch it as read-only arrays and put their own copies, both
at once. A file written on node A is stored by A's keeper and by
the keeper of another node (the next in the sorted list of nodes with keepers), so losing one
node loses no file. The keepers are created and owned by one ``KeeperRegistry`` actor that the
driver starts for the run: they outlive every worker group and die with the driver.

The files are reached through an fsspec filesystem, ``rayllm-mem://<registry>/<path>``, so
the checkpoint code does not change: DCP writes and reads shards through its fsspec writer
and reader (resharding when the world size changed), and store.py's commit protocol (state,
marker, retention) applies as to storage. Written by hand because nothing in Ray or fsspec
keeps files in the object store across processes (fsspec's ``memory://`` is per process).
"""

from __future__ import annotations

import io
import posixpath
import threading
from typing import Any

from fsspec import AbstractFileSystem

from rayllm.errors import ConfigError
from rayllm.ray_cluster import pinned_actor

PROTOCOL = "rayllm-mem"
CALL_TIMEOUT_S = 120.0  # any call to a keeper or the registry; a node lost mid-call ends it sooner
KEEPER_THREADS = 16  # a node's ranks (8 GPUs) and its neighbour's copies at once
STATE_BYTES_PER_PARAM = 12  # fp32 weights and AdamW's two fp32 moments


def memory_checkpoint_bytes_per_node(n_params: int, nodes: int) -> int:
    """Object store bytes one node needs for in-memory checkpoints: its share of the model and
    optimizer state and a neighbour's copy (no copy with one node), twice while the next
    checkpoint is written beside the kept one."""
    copies = 2 if nodes > 1 else 1
    return int(STATE_BYTES_PER_PARAM * n_params / nodes * copies * 2)


def check_memory_budget(n_params: int, train, max_nodes: int, nodes_and_store: tuple[int, int] | None = None) -> bool:
    """Refuse, before the run starts, in-memory checkpoints that the nodes' object stores cannot
    hold. ``nodes_and_store``: (nodes, the smallest node's object store bytes), else Ray's. False
    when no node for workers is up yet to check against (an autoscaling cluster that starts empty:
    rank 0 checks at the first attempt instead)."""
    nodes, store = nodes_and_store or _object_stores(max_nodes)
    if nodes == 0:
        return False
    need = memory_checkpoint_bytes_per_node(n_params, nodes)
    if need <= store:
        return True
    copies = " x 2 copies" if nodes > 1 else ""
    raise ConfigError(
        f"in-memory checkpoints (train.memory_checkpoint_every={train.memory_checkpoint_every}) need "
        f"{need / 2**30:.2f} GiB of object store per node ({n_params:,} parameters x {STATE_BYTES_PER_PARAM} bytes "
        f"/ {nodes} node{'s' if nodes > 1 else ''}{copies} x 2 while the next is written), but the smallest node's "
        f"object store holds {store / 2**30:.2f} GiB: set train.memory_checkpoint_every=null, run on "
        "more nodes, or give Ray a larger object store (ray start --object-store-memory)"
    )


def _object_stores(max_nodes: int) -> tuple[int, int]:
    """(nodes the workers may use, at most ``max_nodes``; the smallest one's object store bytes)."""
    import ray

    stores = [
        int(n["Resources"].get("object_store_memory", 0))
        for n in ray.nodes()
        if n.get("Alive") and (n["Resources"].get("CPU") or n["Resources"].get("GPU"))
    ]
    return min(len(stores), max_nodes), min(stores, default=0)


class Keeper:
    """One node's files: path -> object, each owned by this actor (a dead writer takes none with
    it). A threaded actor: the node's ranks hand it their files at once."""

    def __init__(self):
        self._files: dict[str, tuple[Any, int]] = {}  # path -> (object ref, bytes)
        self._lock = threading.Lock()

    def keep(self, path: str, refs: list, size: int) -> int:
        """A file its writer put in the object store (``refs``: in a list, so that Ray hands the
        reference): fetched into this node's store as a read-only array (no copy on the writer's
        node: a view of the object) and put again, owned here. (Ray 2.56 removed ``ray.put``'s
        ``_owner``, which would have spared the put on the writer's node.)"""
        import ray

        ref = ray.put(ray.get(refs[0], timeout=CALL_TIMEOUT_S))
        with self._lock:
            self._files[path] = (ref, size)
        return size

    # Every method holds the lock, reads too: calls run in threads at once, and iterating the
    # dict while another thread adds a file raised "dictionary changed size during iteration".
    def get(self, path: str) -> list:
        """[the file's object ref] (in a list, so that Ray hands back the reference), or []."""
        with self._lock:
            entry = self._files.get(path)
        return [entry[0]] if entry else []

    def ls(self, prefix: str) -> dict[str, int]:
        with self._lock:
            return self._under(prefix)

    def _under(self, prefix: str) -> dict[str, int]:
        """path -> bytes of the files at or under ``prefix``; the caller holds the lock."""
        folder = prefix.rstrip("/") + "/"
        return {p: n for p, (_, n) in self._files.items() if p == prefix or p.startswith(folder)}

    def rm(self, prefix: str) -> None:
        with self._lock:
            for path in self._under(prefix):
                del self._files[path]

    def rename(self, src: str, dst: str) -> None:
        with self._lock:
            for path in self._under(src):
                self._files[dst + path[len(src) :]] = self._files.pop(path)

    def usage(self) -> int:
        with self._lock:
            return sum(n for _, n in self._files.values())


class KeeperRegistry:
    """The run's keepers, one per node, created on first ask and owned here (see module doc)."""

    def __init__(self):
        self._keepers: dict[str, Any] = {}

    def keeper(self, node: str):
        """This node's keeper, created on first ask, pinned to the node."""
        if node not in self._keepers:
            self._keepers[node] = pinned_actor(Keeper, node, max_concurrency=KEEPER_THREADS).remote()
        return self._keepers[node]

    def keepers(self) -> dict[str, Any]:
        """Every keeper asked for so far, by node (some may have died with their node)."""
        return dict(self._keepers)

    def forget(self, node: str) -> None:
        self._keepers.pop(node, None)


def start_registry(name: str):
    """The driver's registry of keepers for one run, beside the driver; dies with it."""
    return pinned_actor(KeeperRegistry, name=name).remote()


def memory_uri(registry_name: str, run: str) -> str:
    return f"{PROTOCOL}://{registry_name}/{run.strip('/')}"


class _WriteBuffer(io.BytesIO):
    def __init__(self, fs: KeeperFileSystem, path: str):
        super().__init__()
        self._fs, self._path = fs, path

    def close(self) -> None:
        if not self.closed:
            view = self.getbuffer()  # the written bytes, not a copy of them
            try:
                self._fs.pipe_file(self._path, view)
            finally:
                view.release()
        super().close()


class KeeperFileSystem(AbstractFileSystem):
    """fsspec over the keepers of the registry named by a path's first part."""

    protocol = PROTOCOL
    root_marker = ""
    cachable = False  # keepers come and go with nodes: ask the registry afresh

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._registries: dict[str, Any] = {}

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        return path.removeprefix(f"{PROTOCOL}://").rstrip("/")

    # -- keepers ------------------------------------------------------------------------------
    def _registry(self, path: str):
        import ray

        name = self._strip_protocol(path).split("/", 1)[0]
        if name not in self._registries:
            self._registries[name] = ray.get_actor(name)
        return self._registries[name]

    def _keepers(self, path: str) -> dict[str, Any]:
        import ray

        return ray.get(self._registry(path).keepers.remote(), timeout=CALL_TIMEOUT_S)

    def _each(self, path: str, method: str, *args) -> list:
        """``method`` on every live keeper; the answers of those that replied (a lost node's do not)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        calls = [getattr(k, method).remote(*args) for k in self._keepers(path).values()]
        answers = []
        for call in calls:
            try:
                answers.append(ray.get(call, timeout=CALL_TIMEOUT_S))
            except (RayActorError, GetTimeoutError):
                pass  # a keeper lost with its node: the other copy answers
        return answers

    # -- fsspec -------------------------------------------------------------------------------
    def pipe_file(self, path: str, value: bytes | memoryview, **kwargs) -> None:
        """Stored by this node's keeper and by the first live keeper after it in node order, both
        at once, from one array this writer puts (a view of ``value``: no Python bytes copy)."""
        import numpy as np
        import ray
        from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

        path = self._strip_protocol(path)
        registry = self._registry(path)
        node = ray.get_runtime_context().get_node_id()
        own = ray.get(registry.keeper.remote(node), timeout=CALL_TIMEOUT_S)
        data = np.frombuffer(value, dtype=np.uint8)  # (bytes,): a view of the written buffer
        size = data.nbytes
        ref = ray.put(data)
        del data  # the view must go before its buffer is released
        kept = own.keep.remote(path, [ref], size)
        others = sorted(n for n in self._keepers(path) if n != node)
        for other in [n for n in others if n > node] + [n for n in others if n < node]:
            try:
                keeper = ray.get(registry.keeper.remote(other), timeout=CALL_TIMEOUT_S)
                ray.get(keeper.keep.remote(path, [ref], size), timeout=CALL_TIMEOUT_S)
                break
            except (RayActorError, GetTimeoutError) as e:
                # Forgetting a keeper drops the registry's handle, which ends it with every file it
                # holds: only for one that is really dead. A slow or briefly unreachable one keeps
                # its files; the next keeper takes this copy.
                if isinstance(e, ActorDiedError):
                    registry.forget.remote(other)  # lost with its node
        ray.get(kept, timeout=CALL_TIMEOUT_S)

    def cat_file(self, path: str, start=None, end=None, **kwargs) -> bytes:
        import ray
        from ray.exceptions import GetTimeoutError, ObjectLostError, RayActorError

        path = self._strip_protocol(path)
        for keeper in self._keepers(path).values():
            try:
                found = ray.get(keeper.get.remote(path), timeout=CALL_TIMEOUT_S)
                if found:
                    data = ray.get(found[0], timeout=CALL_TIMEOUT_S)  # a read-only array in the store
                    return data[start:end].tobytes()
            except (RayActorError, GetTimeoutError, ObjectLostError):
                continue
        raise FileNotFoundError(path)

    def _open(self, path: str, mode: str = "rb", **kwargs):
        if "r" in mode:
            return io.BytesIO(self.cat_file(path))
        return _WriteBuffer(self, self._strip_protocol(path))

    def _listing(self, path: str) -> dict[str, int]:
        found: dict[str, int] = {}
        for answer in self._each(path, "ls", path):
            found.update(answer)
        return found

    def ls(self, path: str, detail: bool = True, **kwargs):
        path = self._strip_protocol(path)
        entries: dict[str, dict] = {}
        for file, size in self._listing(path).items():
            if file == path:
                entries[file] = {"name": file, "size": size, "type": "file"}
                continue
            child = file[len(path) + 1 :].split("/", 1)
            name = f"{path}/{child[0]}"
            if len(child) == 1:
                entries[name] = {"name": name, "size": size, "type": "file"}
            else:
                entries.setdefault(name, {"name": name, "size": 0, "type": "directory"})
        if not entries:
            raise FileNotFoundError(path)
        listed = sorted(entries.values(), key=lambda e: e["name"])
        return listed if detail else [e["name"] for e in listed]

    def find(self, path: str, maxdepth=None, withdirs: bool = False, detail: bool = False, **kwargs):
        """Every file under ``path``, in one call to each keeper (fsspec's own walks folder by folder)."""
        if maxdepth is not None or withdirs:
            return super().find(path, maxdepth=maxdepth, withdirs=withdirs, detail=detail, **kwargs)
        listing = self._listing(self._strip_protocol(path))
        if detail:
            return {p: {"name": p, "size": n, "type": "file"} for p, n in sorted(listing.items())}
        return sorted(listing)

    def exists(self, path: str, **kwargs) -> bool:
        """fsspec's own answers False on any error: a keeper's failure must not read as a missing file."""
        try:
            self.info(path)
            return True
        except FileNotFoundError:
            return False

    def info(self, path: str, **kwargs) -> dict:
        path = self._strip_protocol(path)
        listing = self._listing(path)
        if path in listing:
            return {"name": path, "size": listing[path], "type": "file"}
        if listing:
            return {"name": path, "size": 0, "type": "directory"}
        raise FileNotFoundError(path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        pass  # folders are prefixes

    def mkdir(self, path: str, create_parents: bool = True, **kwargs) -> None:
        pass

    def rm(self, path, recursive: bool = False, maxdepth=None) -> None:
        for p in [path] if isinstance(path, str) else path:
            p = self._strip_protocol(p)
            self._each(p, "rm", p)

    def rm_file(self, path: str) -> None:
        self.rm(path)

    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth=None, **kwargs) -> None:
        src, dst = self._strip_protocol(path1), self._strip_protocol(path2)
        self._each(src, "rename", src, dst)

    rename = mv

    def usage(self, path: str) -> int:
        """Bytes the keepers hold for this registry, both copies counted."""
        return sum(self._each(path, "usage"))


def register() -> None:
    """Make ``rayllm-mem://`` known to fsspec in this process (idempotent)."""
    import fsspec

    fsspec.register_implementation(PROTOCOL, KeeperFileSystem, clobber=True)


def whole(uri: str) -> bool:
    """Whether every file of the in-memory checkpoint at ``uri`` is still held: its marker, the
    run state and each DCP file its metadata names (a file both of whose keepers died is gone)."""
    import fsspec
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    from rayllm.checkpoint.store import COMMIT_FILE, STATE_FILE

    fs, root = fsspec.core.url_to_fs(uri)
    held = set(fs.find(root))
    if not {f"{root}/{COMMIT_FILE}", f"{root}/{STATE_FILE}", f"{root}/.metadata"} <= held:
        return False
    try:
        files = {d.relative_path for d in FsspecReader(uri).read_metadata().storage_data.values()}
    except (FileNotFoundError, OSError):
        return False
    return all(posixpath.join(root, f) in held for f in files)
