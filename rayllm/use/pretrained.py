"""A trained model outside training: a checkpoint loaded whole onto one device.

DCP reshards on load, so a checkpoint written by any number of ranks loads here without a
process group. The checkpoint carries the model's shape and the run's tokenizer
(``rayllm.checkpoint``); a path may name one checkpoint or a run dir (its latest checkpoint),
on local disk or object storage.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, fields

import torch
import torch.distributed.checkpoint as dcp
from tokenizers import Tokenizer

from rayllm.checkpoint import STATE_FILE, TOKENIZER_FILE, check_model_shapes, find_checkpoint, hf
from rayllm.data import tokenizer as tokenizers
from rayllm.errors import CheckpointError
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import filesystem, is_remote
from rayllm.model import Llama, ModelArgs
from rayllm.model.generate import Sampling, generate


@dataclass
class Pretrained:
    """A model with its tokenizer, ready for generation and evaluation."""

    model: Llama
    tokenizer: Tokenizer
    source: str
    step: int | None = None

    @property
    def args(self) -> ModelArgs:
        return self.model.args

    @property
    def eos_id(self) -> int:
        return tokenizers.eos_id(self.tokenizer)

    def generate(
        self,
        prompt: str,
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_at_eos: bool = True,
    ) -> str:
        """The continuation of ``prompt`` (without it) as text; greedy at temperature 0."""
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        stop = (self.eos_id,) if stop_at_eos else ()
        out = generate(self.model, ids, max_new_tokens, sampling, stop_ids=stop)
        if out and out[-1] in stop:
            out = out[:-1]
        return self.tokenizer.decode(out)


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def load_checkpoint(
    path: str,
    *,
    storage: StorageSettings | None = None,
    device: str | torch.device | None = "auto",
    tokenizer: str | None = None,
) -> Pretrained:
    """The model of checkpoint ``path`` (or of a run dir's latest checkpoint), in fp32 on ``device``.

    ``tokenizer`` (a tokenizer.json) replaces the one the checkpoint carries.
    """
    storage = storage or StorageSettings()
    with local_checkpoint(path, storage) as (local, uri):
        state = _read_state(local, uri)
        args = model_args_of(state, uri)
        model = Llama(args)
        model_state = model.state_dict()
        check_model_shapes(dcp.FileSystemReader(local), uri, model_state, what="the shape in its train_state.json")
        with warnings.catch_warnings():  # "no process group: loading in one process" is the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": model_state}, checkpoint_id=local)  # in place, into the model's own tensors
        tokenizer_text = _tokenizer_text(local, uri, tokenizer, storage)
    model.to(resolve_device(device)).eval()
    tok = tokenizers.load(tokenizer_text, f"of checkpoint {uri}")
    return Pretrained(model=model, tokenizer=tok, source=uri, step=state.get("step"))


def load(
    path: str,
    *,
    storage: StorageSettings | None = None,
    device: str | torch.device | None = "auto",
    tokenizer: str | None = None,
) -> Pretrained:
    """A checkpoint, a run dir's latest checkpoint, or a local Hugging Face Llama folder."""
    if not is_remote(path) and os.path.exists(os.path.join(path, "config.json")):
        loaded = load_hf(path, device=device)
        if tokenizer:
            loaded.tokenizer = tokenizers.load(_read_tokenizer(tokenizer, storage or StorageSettings()), tokenizer)
        return loaded
    return load_checkpoint(path, storage=storage, device=device, tokenizer=tokenizer)


def model_args_of(state: dict, uri: str) -> ModelArgs:
    raw = state.get("model")
    if not raw:
        raise CheckpointError(
            f"checkpoint {uri} does not say its model's shape (it predates rayllm 0.1's model record in "
            f"{STATE_FILE}); resume the run for one step to write a new checkpoint"
        )
    known = {f.name for f in fields(ModelArgs)}
    return ModelArgs(**{k: v for k, v in raw.items() if k in known})


def _read_state(local: str, uri: str) -> dict:
    try:
        with open(os.path.join(local, STATE_FILE)) as f:
            return json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {uri} has no {STATE_FILE}: it is incomplete or not a rayllm checkpoint"
        ) from None


def _tokenizer_text(local: str, uri: str, override: str | None, storage: StorageSettings) -> str:
    if override:
        return _read_tokenizer(override, storage)
    try:
        with open(os.path.join(local, TOKENIZER_FILE)) as f:
            return f.read()
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {uri} carries no {TOKENIZER_FILE}; pass the run's tokenizer (--tokenizer PATH)"
        ) from None


def _read_tokenizer(path: str, storage: StorageSettings) -> str:
    fs, p = filesystem(path, storage)
    if not fs.exists(p):
        raise CheckpointError(f"tokenizer {path} does not exist; give a tokenizer.json path")
    return fs.cat_file(p).decode()


@contextlib.contextmanager
def local_checkpoint(path: str, storage: StorageSettings) -> Iterator[tuple[str, str]]:
    """(a local folder holding the checkpoint, its URI): object storage is copied to a temporary folder."""
    uri = find_checkpoint(path, storage)
    if not is_remote(uri):
        yield uri, uri
        return
    fs, p = filesystem(uri, storage)
    with tempfile.TemporaryDirectory(prefix="rayllm-checkpoint-") as tmp:
        fs.get(p.rstrip("/") + "/", tmp + "/", recursive=True)
        yield tmp, uri


def load_hf(folder: str, *, device: str | torch.device | None = "auto"):
    """A transformers Llama folder as a ``Pretrained`` (model and the tokenizer it ships)."""
    args = hf.model_args_from_hf(hf.read_config(folder), folder)
    model = Llama(args)
    model.load_state_dict(hf.read_model_state(folder, args), strict=True)
    tokenizer_path = os.path.join(folder, hf.TOKENIZER_FILE)
    if not os.path.exists(tokenizer_path):
        raise CheckpointError(f"{folder} has no {hf.TOKENIZER_FILE}; rayllm needs the fast tokenizer file")
    with open(tokenizer_path) as f:
        tok = tokenizers.load(f.read(), tokenizer_path)
    return Pretrained(model=model.to(resolve_device(device)).eval(), tokenizer=tok, source=folder)


def export_checkpoint(checkpoint: str, out_dir: str, *, storage=None, tokenizer: str | None = None) -> str:
    """A rayllm checkpoint (local or object storage, any world size) as a transformers Llama folder."""
    if os.path.exists(os.path.join(out_dir, hf.CONFIG_FILE)):
        raise CheckpointError(f"{out_dir} already holds a model ({hf.CONFIG_FILE}); export to a new folder")
    loaded = load_checkpoint(checkpoint, storage=storage, device="cpu", tokenizer=tokenizer)
    eos = loaded.eos_id
    return hf.save_hf(loaded.model, loaded.tokenizer.to_str(), out_dir, loaded.tokenizer.id_to_token(eos), eos)
