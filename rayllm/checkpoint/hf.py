"""Hugging Face Llama folders: export a rayllm model to one, and start training from one.

The folder format is transformers' ``LlamaForCausalLM``: ``config.json``, safetensors
weights and the tokenizer files. Only the weight names and one layout differ from rayllm's:
rayllm rotates adjacent channel pairs of each head (Meta's layout), transformers rotates the
first half of a head against the second, so q and k projections are permuted on the way out
and back on the way in (as transformers' own Llama conversion script does). Written by hand
because transformers is not a runtime dependency: exporting and importing need only
safetensors.
"""

from __future__ import annotations

import json
import os

import torch

from rayllm.errors import CheckpointError
from rayllm.io.settings import StorageSettings
from rayllm.io.storage import filesystem, is_remote, join, read_text
from rayllm.model import Llama, ModelArgs

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"


# -- layout -----------------------------------------------------------------------------------
def _to_half_split(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a q/k projection from adjacent-pair rotary layout to transformers' half-split one."""
    out_dim, in_dim = w.shape
    return w.view(heads, out_dim // heads // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of ``_to_half_split``."""
    out_dim, in_dim = w.shape
    return w.view(heads, 2, out_dim // heads // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _layer_names(i: int) -> dict[str, str]:
    """rayllm name -> transformers name, for block ``i``."""
    r, h = f"layers.{i}.", f"model.layers.{i}."
    return {
        r + "attention.wq.weight": h + "self_attn.q_proj.weight",
        r + "attention.wk.weight": h + "self_attn.k_proj.weight",
        r + "attention.wv.weight": h + "self_attn.v_proj.weight",
        r + "attention.wo.weight": h + "self_attn.o_proj.weight",
        r + "feed_forward.w1.weight": h + "mlp.gate_proj.weight",
        r + "feed_forward.w3.weight": h + "mlp.up_proj.weight",
        r + "feed_forward.w2.weight": h + "mlp.down_proj.weight",
        r + "attention_norm.weight": h + "input_layernorm.weight",
        r + "ffn_norm.weight": h + "post_attention_layernorm.weight",
    }


def weight_names(args: ModelArgs) -> dict[str, str]:
    names = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    for i in range(args.n_layers):
        names.update(_layer_names(i))
    if not args.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    return names


def _rotary_heads(name: str, args: ModelArgs) -> int | None:
    """Heads of a q or k projection, whose rows the two rotary layouts order differently; else None."""
    if name.endswith("attention.wq.weight"):
        return args.n_heads
    if name.endswith("attention.wk.weight"):
        return args.n_kv_heads
    return None


def to_hf_state(model: Llama) -> dict[str, torch.Tensor]:
    args, state = model.args, model.state_dict()
    out = {}
    for ours, theirs in weight_names(args).items():
        w = state[ours].detach().to("cpu", torch.float32)
        heads = _rotary_heads(ours, args)
        out[theirs] = (w if heads is None else _to_half_split(w, heads)).contiguous()
    return out


def from_hf_state(hf: dict[str, torch.Tensor], args: ModelArgs, folder: str) -> dict[str, torch.Tensor]:
    out = {}
    for ours, theirs in weight_names(args).items():
        if theirs not in hf:
            raise CheckpointError(f"{folder} has no weight {theirs!r}: its weights do not match its {CONFIG_FILE}")
        w = hf[theirs].to(torch.float32)
        heads = _rotary_heads(ours, args)
        out[ours] = w if heads is None else _to_pairs(w, heads)
    if args.tie_embeddings:
        out["output.weight"] = out["tok_embeddings.weight"]
    return out


# -- config -----------------------------------------------------------------------------------
def _rope_scaling(args: ModelArgs) -> dict:
    if args.rope_scaling_factor == 1.0:
        return {"rope_type": "default"}
    return {
        "rope_type": "llama3",
        "factor": args.rope_scaling_factor,
        "low_freq_factor": args.rope_low_freq_factor,
        "high_freq_factor": args.rope_high_freq_factor,
        "original_max_position_embeddings": args.rope_original_max_len,
    }


def hf_config(args: ModelArgs, eos_id: int | None) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        # transformers 5 reads rope_parameters; 4.x reads rope_theta and rope_scaling.
        "rope_parameters": {"rope_theta": args.rope_theta, **_rope_scaling(args)},
        "rope_scaling": _rope_scaling(args) if args.rope_scaling_factor != 1.0 else None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": eos_id,
    }


def read_config(folder: str, storage: StorageSettings | None = None) -> dict:
    """The folder's config.json; the folder is local or on object storage (``s3://``)."""
    fs, path = filesystem(folder, storage or StorageSettings())
    if not fs.isdir(path):
        raise CheckpointError(f"Hugging Face model folder {folder} does not exist; give a local or s3:// folder")
    text = read_text(join(folder, CONFIG_FILE), storage or StorageSettings())
    if text is None:
        raise CheckpointError(f"{folder} has no {CONFIG_FILE}: it is not a Hugging Face model folder")
    return json.loads(text)


def model_args_from_hf(config: dict, folder: str, max_seq_len: int | None = None) -> ModelArgs:
    """rayllm's ModelArgs for a transformers Llama config; anything rayllm's Llama cannot compute is refused."""
    kind = config.get("model_type")
    architectures = config.get("architectures") or []
    if kind != "llama" or (architectures and "LlamaForCausalLM" not in architectures):
        raise CheckpointError(
            f"{folder} holds a {kind or 'model of unknown type'} model ({', '.join(architectures) or 'no architectures'}), "
            "not a Llama: rayllm imports LlamaForCausalLM folders (model_type 'llama') only"
        )
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise CheckpointError(
            f"{folder} uses rotary scaling {rope_type!r}, which rayllm's Llama does not compute; "
            "it imports plain rotary embeddings (rope_type 'default') and Llama 3.1's ('llama3')"
        )
    scaling = {}
    if rope_type == "llama3":
        scaling = {
            "rope_scaling_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_max_len": int(rope["original_max_position_embeddings"]),
        }
    for key, expected in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if config.get(key, expected) != expected:
            raise CheckpointError(
                f"{folder} has {key}={config[key]!r}; rayllm's Llama supports {key}={expected!r} only"
            )
    heads = config["num_attention_heads"]
    dim = config["hidden_size"]
    if config.get("head_dim") not in (None, dim // heads):
        raise CheckpointError(f"{folder} has head_dim {config['head_dim']} != hidden_size / num_attention_heads")
    return ModelArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        vocab_size=config["vocab_size"],
        ffn_hidden=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_seq_len=max_seq_len or config.get("max_position_embeddings", 2048),
        **scaling,
    )


# -- export -----------------------------------------------------------------------------------
def save_hf(model: Llama, tokenizer_json: str | None, out_dir: str, eos_token: str | None, eos_id: int | None) -> str:
    """Write ``model`` (and its tokenizer) as a transformers Llama folder; returns the folder."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(to_hf_state(model), os.path.join(out_dir, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(hf_config(model.args, eos_id), f, indent=2)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos_id, "do_sample": False}, f, indent=2)
    if tokenizer_json is not None:
        with open(os.path.join(out_dir, TOKENIZER_FILE), "w") as f:
            f.write(tokenizer_json)
        with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
            json.dump(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "eos_token": eos_token,
                    "model_max_length": model.args.max_seq_len,
                    "clean_up_tokenization_spaces": False,
                },
                f,
                indent=2,
            )
    return out_dir


# -- import -----------------------------------------------------------------------------------
def weight_files(folder: str, storage: StorageSettings | None = None) -> list[str]:
    """The safetensors files of a folder, local or ``s3://``: one, or the shards its index lists."""
    storage = storage or StorageSettings()
    fs, path = filesystem(folder, storage)
    if fs.exists(join(path, WEIGHTS_FILE)):
        return [join(folder, WEIGHTS_FILE)]
    index = read_text(join(folder, WEIGHTS_INDEX_FILE), storage)
    if index is not None:
        return [join(folder, name) for name in sorted(set(json.loads(index)["weight_map"].values()))]
    other = [n for n in fs.ls(path, detail=False) if n.endswith((".bin", ".pt", ".pth"))]
    hint = f" (it has {os.path.basename(other[0])}: convert it to safetensors with transformers' save_pretrained)"
    raise CheckpointError(f"{folder} has no {WEIGHTS_FILE} or {WEIGHTS_INDEX_FILE}{hint if other else ''}")


def _load_safetensors(path: str, storage: StorageSettings) -> dict[str, torch.Tensor]:
    """A local file is memory-mapped; a remote one is read whole (one file of a folder at a time)."""
    from safetensors.torch import load, load_file

    if not is_remote(path):
        return load_file(path)
    fs, stripped = filesystem(path, storage)
    with fs.open(stripped, "rb") as f:
        return load(f.read())


def read_weights(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors folder, whole (loading a model onto one device)."""
    weights: dict[str, torch.Tensor] = {}
    for path in weight_files(folder):
        weights.update(_load_safetensors(path, StorageSettings()))
    return weights


def from_hf_file(path: str, args: ModelArgs, folder: str, storage: StorageSettings) -> dict[str, torch.Tensor]:
    """The rayllm tensors one safetensors file of ``folder`` holds, converted and shape-checked
    (a folder converted file by file never needs all its weights in memory at once)."""
    theirs = _load_safetensors(path, storage)
    ours_of = {t: o for o, t in weight_names(args).items()}
    expected = _expected_shapes(args)
    out = {}
    for name, w in theirs.items():
        ours = ours_of.get(name)
        if ours is None:
            continue  # rotary tables and other tensors rayllm derives
        heads = _rotary_heads(ours, args)
        w = w.to(torch.float32)
        out[ours] = w if heads is None else _to_pairs(w, heads)
        _check_shape(folder, ours, out[ours], expected)
    return out


def _expected_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):  # shapes only: nothing allocated
        return {k: tuple(v.shape) for k, v in Llama(args).state_dict().items()}


def _check_shape(folder: str, name: str, tensor: torch.Tensor, expected: dict[str, tuple[int, ...]]) -> None:
    if tuple(tensor.shape) != expected[name]:
        raise CheckpointError(f"{folder}: weight for {name} is {tuple(tensor.shape)}, the model needs {expected[name]}")


def read_model_state(folder: str, args: ModelArgs) -> dict[str, torch.Tensor]:
    """The folder's weights under rayllm's names and layout, checked against the shapes ``args`` gives."""
    state = from_hf_state(read_weights(folder), args, folder)
    expected = _expected_shapes(args)
    for name, tensor in state.items():
        _check_shape(folder, name, tensor, expected)
    return state
