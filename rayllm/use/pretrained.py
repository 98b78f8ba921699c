"""A trained model outside training: a checkpoint loaded whole onto one device.

DCP reshards on load, so a checkpoint written by any number of ranks loads here without a
process group. The checkpoint carries the model's shape and the run's tokenizer
(``rayllm.checkpoint``); a path may name one checkpoint or a run dir (its latest checkpoint),
on local disk or object storage.
"""

from __future__ import annotations

import os
import posixpath
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from rayllm.checkpoint import TOKENIZER_FILE, find_checkpoint, hf, load_whole_model, read_state
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
    uri = find_checkpoint(path, storage)
    state = read_state(uri, storage)
    model = Llama(state.model_args(uri))
    load_whole_model(uri, storage, model, what="the shape in its train_state.json")
    tokenizer_text = _read_tokenizer(tokenizer, storage) if tokenizer else _checkpoint_tokenizer(uri, storage)
    model.to(resolve_device(device)).eval()
    tok = tokenizers.load(tokenizer_text, f"of checkpoint {uri}")
    return Pretrained(model=model, tokenizer=tok, source=uri, step=state.step)


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


def _checkpoint_tokenizer(uri: str, storage: StorageSettings) -> str:
    fs, p = filesystem(uri, storage)
    try:
        return fs.cat_file(posixpath.join(p.rstrip("/"), TOKENIZER_FILE)).decode()
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {uri} carries no {TOKENIZER_FILE}; pass the run's tokenizer (--tokenizer PATH)"
        ) from None


def _read_tokenizer(path: str, storage: StorageSettings) -> str:
    fs, p = filesystem(path, storage)
    if not fs.exists(p):
        raise CheckpointError(f"tokenizer {path} does not exist; give a tokenizer.json path")
    return fs.cat_file(p).decode()


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
