"""The driver's one look at the folders a config names, before any worker starts.

``TrainConfig.validate()`` reads nothing but the YAML, so a config loads anywhere (a worker,
a machine without the folder). What ``model.init_from``'s folder decides (the model shape,
the tokenizer, the longest context) is filled in here, once, on the driver; workers get and
runs record the resolved tree.
"""

from __future__ import annotations

import os

from rayllm.config import HF_SHAPE_KEYS, TrainConfig
from rayllm.config.checks import check_model
from rayllm.errors import CheckpointError, ConfigError
from rayllm.io.redact import display_uri
from rayllm.io.storage import filesystem, is_remote, join


def resolve(config: TrainConfig) -> TrainConfig:
    """``config`` with model.init_from's folder read in and a local run.dir made absolute; changed in
    place, so every holder of the tree sees it."""
    if not is_remote(config.run.dir):  # Ray Train's workers run in a folder of their own
        config.run.dir = os.path.abspath(os.path.expanduser(config.run.dir.removeprefix("file://")))
    folder = config.model.init_from
    if folder:
        hf = _read_hf_config(folder, config)
        _set_shape(config, hf, folder)
        _check_context(config, hf, folder)
        _set_tokenizer(config, folder)
    return config


def _read_hf_config(folder: str, config: TrainConfig) -> dict:
    from rayllm.checkpoint.hf import (
        read_config,  # rayllm.checkpoint.hf imports torch: only a run from a folder pays for it
    )

    try:
        return read_config(folder, config.storage)
    except CheckpointError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    except ValueError as e:  # not JSON
        raise ConfigError(
            f"model.init_from: {display_uri(folder)}'s config.json is not valid JSON ({e}); re-export it"
        ) from None


def _set_shape(config: TrainConfig, hf: dict, folder: str) -> None:
    """The model section from the folder's config.json, checked as a YAML's would be."""
    from rayllm.checkpoint.hf import model_args_from_hf

    try:
        args = model_args_from_hf(hf, folder)
    except CheckpointError as e:
        raise ConfigError(f"model.init_from: {e}") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            f"model.init_from: {display_uri(folder)}'s config.json lacks or mistypes {e}; it is not a transformers Llama config"
        ) from None
    for key in HF_SHAPE_KEYS:
        name = key.split(".", 1)[1]
        setattr(config.model, name, args.hidden_dim if name == "ffn_hidden" else getattr(args, name))
    try:
        check_model(config.model)
    except ConfigError as e:
        raise ConfigError(
            f"model.init_from: the shape {display_uri(folder)}'s config.json gives is refused: {e}"
        ) from None


def _check_context(config: TrainConfig, hf: dict, folder: str) -> None:
    """Positions past the folder's max_position_embeddings were never trained: refuse a longer data.seq_len."""
    limit = hf.get("max_position_embeddings")
    if isinstance(limit, int) and config.data.seq_len > limit:
        raise ConfigError(
            f"data.seq_len {config.data.seq_len} is above the {limit} positions model.init_from {display_uri(folder)} was trained "
            f"for (max_position_embeddings in its config.json); set data.seq_len to at most {limit}"
        )


def _set_tokenizer(config: TrainConfig, folder: str) -> None:
    """Unless data.tokenizer is set, the folder's tokenizer.json: the one its weights were trained with."""
    from rayllm.checkpoint.hf import TOKENIZER_FILE

    path = join(folder, TOKENIZER_FILE)
    fs, stripped = filesystem(path, config.storage)
    if config.data.tokenizer is None and fs.exists(stripped):
        config.data.tokenizer = path
