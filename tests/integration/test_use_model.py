"""A trained model outside training: generate (KV cache), evaluate (Ray workers), export to and
import from Hugging Face. One model is trained for the module on 2 torchrun ranks and loaded
in one process, so every test also shows the checkpoint loads without its world size.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import TEST_MODEL, read_records, s3_client, torchrun_cmd

import rayllm
import rayllm.checkpoint.hf
from rayllm import CheckpointError, ConfigError, TrainConfig
from rayllm.config.resolve import resolve
from rayllm.model.generate import Sampling, generate
from rayllm.model.sampling import greedy_continuations

transformers = pytest.importorskip("transformers")  # a test extra, never a runtime dependency

PROMPTS = ["def ", "import "]


def torchrun(nproc: int, overrides: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(nproc, overrides), capture_output=True, text=True, timeout=timeout)


def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rayllm.cli", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trained(corpus, tokenizer_file, tmp_path_factory):
    """A run dir whose latest checkpoint is a model trained for 200 steps on 2 ranks."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    overrides = [
        *TEST_MODEL,
        f"data.train={corpus / 'train'}",
        "data.val=null",
        f"data.tokenizer={tokenizer_file}",
        "data.demo_corpus=false",
        f"run.dir={run_dir}",
        "train.max_steps=200",
        "train.checkpoint_every=100",
        "train.log_every=1",
        "train.sample_tokens=0",
        "tracking.enabled=false",
    ]
    proc = torchrun(2, overrides)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def model(trained):
    return rayllm.load(str(trained), device="cpu")


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "hf"
    rayllm.export_hf(str(trained), str(out))
    return out


def test_a_run_dir_loads_its_latest_checkpoint_on_one_process(trained, model):
    assert model.step == 200 and model.source.endswith("checkpoint_00000200")
    assert model.args.dim == 64 and model.args.n_layers == 2 and model.args.max_seq_len == 64
    # Trained, not the random initialisation: its loss on training text is far below ln(vocab).
    ids = torch.tensor([model.tokenizer.encode(open(__file__).read()).ids[:65]])
    with torch.no_grad():
        loss = float(model.model(ids[:, :-1], ids[:, 1:]))
    assert loss < 0.8 * torch.log(torch.tensor(1024.0)).item(), loss


def test_kv_cache_greedy_equals_full_recompute_and_is_deterministic(model):
    for prompt in PROMPTS:
        ids = model.tokenizer.encode(prompt, add_special_tokens=False).ids
        cached = generate(model.model, ids, 40)
        recomputed = greedy_continuations(model.model, [ids], 40, model.args.max_seq_len, torch.device("cpu"))[0]
        assert cached == recomputed
        assert generate(model.model, ids, 40) == cached
    # Past the 64-token context the window slides; generation keeps going to the length asked.
    assert len(generate(model.model, [1, 2, 3], 150)) == 150


def test_sampling_follows_its_seed_and_its_limits(model):
    ids = model.tokenizer.encode("def ", add_special_tokens=False).ids
    greedy = generate(model.model, ids, 30)
    one = generate(model.model, ids, 30, Sampling(temperature=1.0, seed=1))
    assert one == generate(model.model, ids, 30, Sampling(temperature=1.0, seed=1))
    assert any(generate(model.model, ids, 30, Sampling(temperature=1.0, seed=s)) != one for s in range(2, 6))
    assert generate(model.model, ids, 30, Sampling(temperature=1.0, top_k=1, seed=3)) == greedy
    assert generate(model.model, ids, 30, Sampling(temperature=1.0, top_p=1e-6, seed=3)) == greedy
    with pytest.raises(ValueError, match="top_p"):
        Sampling(temperature=1.0, top_p=0.0)


def test_cli_generate_prints_what_the_python_api_generates(trained, model):
    proc = cli(
        "generate", "--checkpoint", str(trained), "--prompt", "def ", "--max-new-tokens", "24", "--device", "cpu"
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == ("def " + model.generate("def ", 24)).strip()
    assert len(proc.stdout.strip()) > len("def ") + 5


def test_export_loads_in_transformers_with_the_same_logits(model, exported):
    hf = transformers.LlamaForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    ids = torch.tensor([model.tokenizer.encode(open(__file__).read()).ids[:64]])
    with torch.no_grad():
        ours, theirs = model.model(ids), hf(ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-4
    # transformers' tokenizer from the exported files encodes as rayllm's does.
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(exported))
    text = "def main(argv):\n    return 0\n"
    assert hf_tok(text, add_special_tokens=False)["input_ids"] == model.tokenizer.encode(text).ids
    # transformers' own greedy decoding (its KV cache) picks the same tokens as rayllm's.
    prompt = model.tokenizer.encode("import ", add_special_tokens=False).ids
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert out[0, len(prompt) :].tolist() == generate(model.model, prompt, 20)


def test_greedy_text_from_the_export_equals_the_checkpoints(model, exported):
    from_export = rayllm.load(str(exported), device="cpu")
    for prompt in PROMPTS:
        assert from_export.generate(prompt, 40) == model.generate(prompt, 40)


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 20000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # short, so that 50 tokens reach the scaled range
}


@pytest.mark.parametrize(
    "rope", [{"rope_type": "default", "rope_theta": 20000.0}, LLAMA3_ROPE], ids=["plain", "llama3"]
)
def test_import_of_a_transformers_llama_gives_its_logits(tmp_path, tokenizer_file, rope):
    config = transformers.LlamaConfig(
        rope_parameters=rope,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a mapping mistake there shows
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    hf.save_pretrained(tmp_path / "hf")
    shutil.copy(tokenizer_file, tmp_path / "hf" / "tokenizer.json")
    loaded = rayllm.load(str(tmp_path / "hf"), device="cpu")
    ids = torch.randint(0, 1024, (2, 50))
    with torch.no_grad():
        assert (loaded.model(ids) - hf(ids).logits).abs().max().item() <= 1e-4
    assert loaded.args.rope_scaling_factor == rope.get("factor", 1.0)
    # And back out: the export of the import is the same model to transformers.
    rayllm.checkpoint.hf.save_hf(loaded.model, None, str(tmp_path / "again"), None, None)
    again = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "again"), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (again(ids).logits - hf(ids).logits).abs().max().item() <= 1e-4


def test_training_continues_from_an_imported_folder(model, exported, corpus, tmp_path):
    """model.init_from: the exported model's weights, shape and tokenizer; its first loss is the
    trained model's, not a random one's, and training lowers it further. Per-batch losses differ
    by more than a few steps of training change them, so the yardstick is the imported model
    held still (lr 1e-12) on the same batches."""

    def continued(name: str, lr: str, ranks: int) -> dict[int, float]:
        run_dir = tmp_path / name
        overrides = [
            *[o for o in TEST_MODEL if not o.startswith("model.")],
            "model.dim=999",  # replaced by the folder's shape
            f"model.init_from={exported}",
            f"data.train={corpus / 'train'}",
            "data.val=null",
            "data.demo_corpus=false",
            f"run.dir={run_dir}",
            "train.max_steps=8",
            "train.warmup_steps=0",
            f"train.lr={lr}",
            "train.log_every=1",
            "train.sample_tokens=0",
            "tracking.enabled=false",
        ]
        config = resolve(TrainConfig.from_yaml("configs/tiny.yaml", overrides=overrides))
        assert config.model.dim == 64 and config.data.tokenizer == str(exported / "tokenizer.json")
        proc = torchrun(ranks, overrides)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return {r["step"]: r["loss"] for r in read_records(run_dir, "train")}

    # A small lr: the model is near its optimum here, and fresh Adam moments at 1e-3 overshoot.
    losses = continued("continued", "1e-4", 2)  # two FSDP ranks: the folder's weights are sharded as they load
    still = continued("still", "1e-12", 1)
    scratch = torch.log(torch.tensor(1024.0)).item()
    assert losses[1] < 0.75 * scratch, losses  # a random model starts near ln(1024) = 6.93
    assert losses[1] == pytest.approx(still[1], rel=1e-4)  # same weights on 2 ranks as on 1
    assert all(losses[s] < still[s] for s in (6, 7, 8)), (losses, still)


def test_bad_paths_other_shapes_and_non_llama_folders_are_named(trained, tmp_path, corpus):
    with pytest.raises(CheckpointError, match="does not exist"):
        rayllm.load(str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a complete checkpoint"):
        rayllm.load(str(tmp_path / "empty"))
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="not a Llama"):
        rayllm.load(str(gpt2))
    with pytest.raises(ConfigError, match="model.init_from: .*not a Llama"):
        resolve(TrainConfig.from_yaml("configs/tiny.yaml", overrides=[f"model.init_from={gpt2}"]))
    proc = cli("generate", "--checkpoint", str(tmp_path / "nowhere"), "--prompt", "x")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "does not exist" in proc.stderr.strip().splitlines()[-1]

    # Resuming a run dir with another model shape: refused by name, and the checkpoint kept.
    run_dir = tmp_path / "resized"
    shutil.copytree(trained, run_dir)
    before = sorted(os.listdir(run_dir))
    proc = torchrun(
        1,
        [
            *TEST_MODEL,
            "model.dim=128",
            f"data.train={corpus / 'train'}",
            "data.val=null",
            "data.demo_corpus=false",
            f"run.dir={run_dir}",
            "train.max_steps=202",
            "tracking.enabled=false",
        ],
    )
    assert proc.returncode != 0
    assert "holds a model of another shape" in proc.stderr and "tok_embeddings.weight is (1024, 64)" in proc.stderr
    assert sorted(os.listdir(run_dir)) == before


def test_generate_from_a_checkpoint_on_s3(trained, model, s3_server, monkeypatch):
    from rayllm.io.settings import StorageSettings

    s3 = s3_client(s3_server)
    s3.create_bucket(Bucket="ckpts")
    source = model.source
    for name in os.listdir(source):
        s3.upload_file(os.path.join(source, name), "ckpts", f"run/{os.path.basename(source)}/{name}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    remote = rayllm.load("s3://ckpts/run", storage=StorageSettings(endpoint_url=s3_server), device="cpu")
    assert remote.source == f"s3://ckpts/run/{os.path.basename(source)}"
    assert remote.generate("def ", 30) == model.generate("def ", 30)


@pytest.mark.slow
def test_eval_on_ray_workers_equals_one_process(ray_local, trained, model, corpus, capsys):
    from rayllm.cli import main
    from rayllm.use.evaluate import evaluate, evaluate_local

    shards = str(corpus / "train")
    distributed = evaluate(str(trained), shards, workers=2)
    local = evaluate_local(model, shards)
    assert distributed.shards == local.shards == 3 and distributed.workers == 2
    assert distributed.tokens == local.tokens > 10_000
    assert abs(distributed.loss - local.loss) <= 1e-6 * local.loss
    assert distributed.perplexity < 0.5 * 1024  # it learned something: far better than uniform
    # The command, in this process: it joins the Ray already running rather than starting its own.
    assert main(["eval", "--checkpoint", str(trained), "--data", str(corpus / "val"), "--workers", "1"]) == 0
    assert "perplexity" in capsys.readouterr().out
