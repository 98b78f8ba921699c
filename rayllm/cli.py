"""``rayllm``: a thin layer over the Python API; it does nothing the API cannot."""

from __future__ import annotations

import argparse
import os
import sys

from rayllm.bench.speed_args import HELP as SPEED_HELP
from rayllm.bench.speed_args import add_arguments as add_speed_arguments
from rayllm.errors import RayllmError
from rayllm.io.redact import display_uri


def build_parser() -> argparse.ArgumentParser:
    """The argument table of every command."""
    parser = argparse.ArgumentParser(prog="rayllm", description="Elastic, fault-tolerant LLM training on Ray.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a model as a config says")
    train.add_argument("config", help="YAML config, for example configs/tiny.yaml")
    train.add_argument("overrides", nargs="*", help="dotted overrides, for example train.max_steps=50 run.dir=/tmp/r")
    train.add_argument("-q", "--quiet", action="store_true", help="print only the summary")
    tokenizer = sub.add_parser("tokenizer", help="tokenizer tools")
    tok_sub = tokenizer.add_subparsers(dest="tokenizer_command", required=True)
    tok_train = tok_sub.add_parser("train", help="train a byte-level BPE on a sample of data.train")
    tok_train.add_argument("config", help="YAML config whose data section names the corpus")
    tok_train.add_argument("overrides", nargs="*", help="dotted overrides, for example data.train=s3://b/corpus")
    tok_train.add_argument("-o", "--output", required=True, help="where to write tokenizer.json (local or s3://)")
    tok_train.add_argument("--vocab-size", type=int, help="vocabulary size (default: model.vocab_size)")
    tok_train.add_argument("--special-tokens", nargs="*", default=[], help="extra special tokens after EOS")
    prep = sub.add_parser("prepare", help="clean, filter and deduplicate raw documents into parquet shards")
    prep.add_argument("config", help="YAML prepare config, for example configs/prepare-demo.yaml")
    prep.add_argument("overrides", nargs="*", help="dotted overrides, for example output.path=s3://b/clean")
    prep.add_argument("-q", "--quiet", action="store_true", help="print only the report")
    bench = sub.add_parser("bench", help="benchmarks that print measured ratios")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    bench_data = bench_sub.add_parser("data", help="data pipeline tokens/s against raw encode_batch, per core")
    bench_data.add_argument("config", nargs="?", default="configs/tiny.yaml", help="config whose data.train to read")
    bench_data.add_argument("overrides", nargs="*", help="dotted overrides, for example data.train=s3://b/corpus")
    bench_data.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs for the pipeline")
    bench_data.add_argument("--epochs", type=int, default=5, help="passes over data.train on each side")
    bench_data.add_argument("--repeats", type=int, default=2, help="runs of each side; the best is kept")
    bench_tok = bench_sub.add_parser("tokenize", help="data wait at set demands, tokenize tasks sized by the run")
    bench_tok.add_argument("config", nargs="?", default="configs/tiny.yaml", help="config whose data.train to read")
    bench_tok.add_argument("overrides", nargs="*", help="dotted overrides, for example data.train=s3://b/corpus")
    bench_tok.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs for Ray")
    bench_tok.add_argument("--demands", default="0.01,0.5,1.5", help="demands, as multiples of one core's rate")
    bench_tok.add_argument("--seconds", type=float, default=30.0, help="seconds each demand is consumed")
    bench_tok.add_argument("--tokenize-tasks", type=int, default=8, help="the ceiling (data.tokenize_tasks)")
    bench_ckpt = bench_sub.add_parser(
        "checkpoint", help="training stall of an async checkpoint against a synchronous one"
    )
    bench_ckpt.add_argument("config", nargs="?", default="configs/tiny.yaml", help="config (data, tokenizer)")
    bench_ckpt.add_argument("overrides", nargs="*", help="dotted overrides, for example model.n_layers=12")
    bench_ckpt.add_argument("--workers", type=int, default=2, help="ranks (torchrun processes)")
    bench_ckpt.add_argument("--steps", type=int, default=30, help="steps per run")
    bench_ckpt.add_argument("--every", type=int, default=6, help="steps between checkpoints")
    bench_ckpt.add_argument("--repeats", type=int, default=2, help="interleaved runs of each variant")
    bench_recovery = bench_sub.add_parser("recovery", help="time from a worker's SIGKILL to the next completed step")
    bench_recovery.add_argument("config", nargs="?", default="configs/tiny.yaml", help="config to train")
    bench_recovery.add_argument("overrides", nargs="*", help="dotted overrides, for example run.dir=/tmp/bench")
    bench_recovery.add_argument("--kill-after", type=int, default=12, help="kill a worker once this step is done")
    bench_recovery.add_argument(
        "--memory-every", type=int, default=1, help="the in-memory run's train.memory_checkpoint_every (0: skip it)"
    )
    bench_goodput = bench_sub.add_parser(
        "goodput", help="effective training time with a fault every N seconds, against the undisturbed run"
    )
    bench_goodput.add_argument("config", nargs="?", default="configs/tiny.yaml", help="config to train")
    bench_goodput.add_argument("overrides", nargs="*", help="dotted overrides, for example train.max_steps=1200")
    bench_goodput.add_argument("--every", type=float, default=120.0, help="seconds between faults")
    bench_goodput.add_argument("--seed", type=int, default=0, help="seed of the fault mix")
    bench_goodput.add_argument("--hang-timeout-s", type=float, default=15.0, help="train.hang_timeout_s of both runs")
    bench_goodput.add_argument("--faults", help="comma-separated kinds to draw from (default: the whole mix)")
    storage_help = "s3: shards, checkpoints and records in a bucket of moto's S3 server on 127.0.0.1 (needs "
    storage_help += "moto[server]), which the storage fault takes off the network; local: on disk, no storage fault"
    bench_goodput.add_argument("--storage", choices=("s3", "local"), default="s3", help=storage_help)
    bench_goodput.add_argument("--outage-s", type=float, default=20.0, help="how long a storage outage lasts")
    add_speed_arguments(bench_sub.add_parser("speed", help=SPEED_HELP))
    bench_gpu = bench_sub.add_parser("gpu", help="~1B Llama on one GPU: tokens/s, MFU, memory, mesh smoke (no Ray)")
    bench_gpu.add_argument("--tiny", action="store_true", help="a tiny model on CPU (gloo, fp32): what CI runs")
    bench_gpu.add_argument("--out", help="write every figure to this JSON file")
    bench_gpu.add_argument("--nproc-per-node", type=int, default=1, help="ranks; more than 1 runs under torchrun")
    bench_gpu.add_argument("--check", action="store_true", help="one GPU: each GPU-only item PASS or FAIL (< 8 min)")
    bench_serve = bench_sub.add_parser("serve", help="serving slices to 1..1024 simulated ranks, new vs old design")
    bench_serve.add_argument("--ranks", default="1,8,64,256,1024", help="rank counts, comma-separated")
    bench_serve.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    bench_serve.add_argument("--steps", type=int, default=20, help="steps each rank takes")
    bench_serve.add_argument("--consumers", type=int, default=4, help="processes the simulated ranks share")
    bench_serve.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs for Ray")
    bench_serve.add_argument("--sources", default="memory,shards", help="memory (serving alone), shards, or both")
    bench_memory = bench_sub.add_parser("memory", help="stream a corpus larger than the object store; peak memory")
    bench_memory.add_argument("config", nargs="?", default="configs/tiny.yaml", help="config for tokenizer and shapes")
    bench_memory.add_argument("overrides", nargs="*", help="dotted overrides")
    bench_memory.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs for the pipeline")
    bench_memory.add_argument("--gb", type=float, default=2.0, help="gigabytes of text to generate and stream")
    bench_memory.add_argument("--object-store-mb", type=int, default=500, help="Ray's object store cap")
    bench_memory.add_argument("--dir", default="data/bench-memory", help="where the generated corpus is kept")
    gen = sub.add_parser("generate", help="continue prompts with a trained model (KV cache; greedy or sampled)")
    gen.add_argument("--checkpoint", required=True, help="a checkpoint, a run dir (its latest) or a HF Llama folder")
    gen.add_argument("--prompt", action="append", required=True, help="text to continue; repeat for several")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    gen.add_argument("--top-p", type=float, default=1.0, help="sample among the most likely tokens holding p")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same text")
    gen.add_argument("--device", default="auto", help="auto (a GPU when there is one), cpu, cuda, cuda:1")
    evaluate = sub.add_parser("eval", help="perplexity over held-out shards, spread over Ray workers")
    evaluate.add_argument("--checkpoint", required=True, help="a checkpoint or a run dir (its latest)")
    evaluate.add_argument("--data", required=True, nargs="+", help="shards: paths, globs or folders, local or s3://")
    evaluate.add_argument("--workers", type=int, default=2, help="Ray actors scoring shards at once")
    evaluate.add_argument("--seq-len", type=int, help="tokens per window (default: the model's training length)")
    evaluate.add_argument("--text-field", default="text", help="jsonl field or parquet column with the text")
    evaluate.add_argument("--gpu", action="store_true", help="one GPU per worker")
    export = sub.add_parser("export", help="a checkpoint as a Hugging Face Llama folder (safetensors)")
    export.add_argument("--checkpoint", required=True, help="a checkpoint or a run dir (its latest)")
    export.add_argument("--output", "-o", required=True, help="a new local folder")
    for p in (gen, evaluate, export):
        p.add_argument("--tokenizer", help="a tokenizer.json instead of the one the checkpoint carries")
        p.add_argument("--endpoint-url", help="S3-compatible endpoint for s3:// paths (credentials: AWS_* variables)")
    plan = sub.add_parser("plan", help="memory per GPU of a config's step, and the mesh/micro-batch to use")
    plan.add_argument("config", help="YAML config, for example configs/llama-8b.yaml")
    plan.add_argument("overrides", nargs="*", help="dotted overrides, for example data.seq_len=4096")
    plan.add_argument(
        "--gpu", help="h100-80gb, h100-80gb-tcpx (GCP a3), h200, a100-80gb or l40s (default: CPU ranks, fp32)"
    )
    plan.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    plan.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8; CPU: cluster.num_workers)")
    plan.add_argument("--micro-batch", type=int, help="sequences per micro-batch (default: train.micro_batch_size)")
    plan.add_argument("--layout", help="parallel degrees, for example tp=8,dp_replicate=2 (default: parallel.*)")
    show = sub.add_parser("config", help="print the resolved config")
    show.add_argument("config")
    show.add_argument("overrides", nargs="*")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = f"bench {args.bench_command}" if args.command == "bench" else args.command
    if command in WITHOUT_CONFIG:
        return WITHOUT_CONFIG[command](args)
    from rayllm.config import TrainConfig
    from rayllm.config.resolve import resolve

    try:
        config = TrainConfig.from_yaml(args.config, overrides=args.overrides)
        if command not in RESOLVED_BY_TRAIN:
            # Here, on the driver, so every other command (and `rayllm config`'s printout) sees
            # model.init_from's shape; rayllm.train resolves its config itself, once.
            resolve(config)
        return WITH_CONFIG[command](config, args)
    except RayllmError as e:
        print(f"rayllm: error: {display_uri(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "rayllm: interrupted; the latest checkpoint in run.dir is kept and the next run resumes from it",
            file=sys.stderr,
        )
        return 130


# --- commands on a training config: (config, args) -> exit code -----------------------------


def _train(config, args: argparse.Namespace) -> int:
    from rayllm.runtime.launch import format_summary, train

    result = train(config, quiet=args.quiet)
    if args.quiet:
        print(format_summary(result))
    if result.stopped_by:
        import signal

        print(
            f"rayllm: stopped by {result.stopped_by} at step {result.step} with a checkpoint; "
            f"run the same command again to resume",
            file=sys.stderr,
        )
        return 128 + int(getattr(signal, result.stopped_by))  # as if killed by it, for schedulers
    return 0


def _show_config(config, args: argparse.Namespace) -> int:
    print(config.to_redacted_yaml(), end="")  # never a secret on a terminal or in a job log
    return 0


def _plan(config, args: argparse.Namespace) -> int:
    from rayllm.parallel import plan_choice

    print(
        plan_choice.report(
            config,
            gpu=args.gpu,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            micro_batch=args.micro_batch,
            layout=args.layout,
        )
    )
    return 0


def _train_tokenizer(config, args: argparse.Namespace) -> int:
    from rayllm.data.discover import train_tokenizer

    info = train_tokenizer(config, args.output, args.vocab_size, args.special_tokens)
    print(
        f"[rayllm] tokenizer with {info['vocab_size']} tokens trained on {info['documents']} documents "
        f"from {info['shards']} shard(s), saved to {info['output']}"
    )
    return 0


def _bench_checkpoint(config, args: argparse.Namespace) -> int:
    from rayllm.bench import checkpoint as bench_checkpoint

    result = bench_checkpoint.run(args.config, args.overrides, args.workers, args.steps, args.every, args.repeats)
    print(bench_checkpoint.format_result(result))
    return 0


def _bench_recovery(config, args: argparse.Namespace) -> int:
    from rayllm.bench import recovery as bench_recovery

    if not any(o.startswith("run.dir=") for o in args.overrides):
        import tempfile

        config.run.dir = tempfile.mkdtemp(prefix="rayllm-bench-recovery-")  # never resume a real run
    if args.memory_every:
        runs = bench_recovery.compare(config, args.kill_after, args.memory_every)
        print(bench_recovery.format_comparison(runs))
    else:
        print(bench_recovery.format_result(bench_recovery.run(config, args.kill_after)))
    return 0


def _bench_goodput(config, args: argparse.Namespace) -> int:
    import tempfile

    from rayllm.bench import goodput

    options = goodput.Options(
        every_s=args.every,
        seed=args.seed,
        faults=goodput.parse_faults(args.faults, args.storage),
        hang_timeout_s=args.hang_timeout_s,
        storage=args.storage,
        outage_s=args.outage_s,
    )
    root = config.run.dir if any(o.startswith("run.dir=") for o in args.overrides) else None
    root = root or tempfile.mkdtemp(prefix="rayllm-bench-goodput-")  # never resume a real run
    print(goodput.format_report(goodput.run(config, root, options), options))
    return 0


def _bench_speed(config, args: argparse.Namespace) -> int:
    from rayllm.bench import speed as bench_speed

    bench_speed.report(config, args)
    return 0


def _bench_memory(config, args: argparse.Namespace) -> int:
    from rayllm.bench import memory as bench_memory

    result = bench_memory.run(config, args.cpus, args.gb, args.object_store_mb, args.dir)
    print(bench_memory.format_result(result))
    return 0


def _bench_tokenize(config, args: argparse.Namespace) -> int:
    from rayllm.bench import tokenize as bench_tokenize

    demands = tuple(float(d) for d in args.demands.split(","))
    result = bench_tokenize.run(config, args.cpus, demands, args.seconds, args.tokenize_tasks)
    print(bench_tokenize.format_result(result))
    return 0


def _bench_data(config, args: argparse.Namespace) -> int:
    from rayllm.bench import data as bench_data

    print(bench_data.format_result(bench_data.run(config, args.cpus, args.epochs, args.repeats)))
    return 0


# --- commands without one: args -> exit code -----------------------------------------------


def _bench_serve(args: argparse.Namespace) -> int:
    from rayllm.bench import serve as bench_serve

    ranks = tuple(int(r) for r in args.ranks.split(","))
    sources = tuple(args.sources.split(","))
    bench_serve.run(ranks, args.seq_len, args.steps, args.consumers, cpus=args.cpus, sources=sources)
    return 0


def _bench_gpu(args: argparse.Namespace) -> int:
    from rayllm.bench.gpu_check import launch

    return launch(args.tiny, args.out, args.nproc_per_node, check=args.check)


def _use_model(args: argparse.Namespace) -> int:
    """generate, eval and export: a trained model, outside training."""
    from rayllm.io.settings import StorageSettings

    storage = StorageSettings(endpoint_url=args.endpoint_url)
    try:
        if args.command == "export":
            from rayllm.use.pretrained import export_checkpoint

            out = export_checkpoint(args.checkpoint, args.output, storage=storage, tokenizer=args.tokenizer)
            print(f"[rayllm] exported {args.checkpoint} to {out} (transformers LlamaForCausalLM)")
            return 0
        if args.command == "eval":
            from rayllm.use.evaluate import evaluate, format_result

            result = evaluate(
                args.checkpoint,
                args.data,
                workers=args.workers,
                seq_len=args.seq_len,
                text_field=args.text_field,
                storage=storage,
                use_gpu=args.gpu,
            )
            print(format_result(result))
            return 0
        from rayllm.use.pretrained import load

        pretrained = load(args.checkpoint, storage=storage, device=args.device, tokenizer=args.tokenizer)
        for prompt in args.prompt:
            text = pretrained.generate(
                prompt,
                args.max_new_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed,
            )
            print(prompt + text, flush=True)
            if len(args.prompt) > 1:
                print("---")
        return 0
    except (RayllmError, ValueError) as e:
        print(f"rayllm: error: {display_uri(str(e))}", file=sys.stderr)
        return 2


def _prepare(args: argparse.Namespace) -> int:
    from rayllm.prepare import PrepareConfig, prepare
    from rayllm.prepare.report import format_report

    try:
        report = prepare(PrepareConfig.from_yaml(args.config, overrides=args.overrides), quiet=args.quiet)
        if args.quiet:
            print(format_report(report))
        return 0
    except RayllmError as e:
        print(f"rayllm: error: {display_uri(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            "rayllm: interrupted; output.path may hold a partial result, which the next run replaces", file=sys.stderr
        )
        return 130


# Each command ("bench <name>" for a benchmark) and its handler.
WITHOUT_CONFIG = {
    "prepare": _prepare,
    "generate": _use_model,
    "eval": _use_model,
    "export": _use_model,
    "bench serve": _bench_serve,
    "bench gpu": _bench_gpu,
}
RESOLVED_BY_TRAIN = {"train", "bench recovery", "bench goodput"}  # they call rayllm.train, which resolves the config
WITH_CONFIG = {
    "train": _train,
    "config": _show_config,
    "plan": _plan,
    "tokenizer": _train_tokenizer,
    "bench checkpoint": _bench_checkpoint,
    "bench recovery": _bench_recovery,
    "bench goodput": _bench_goodput,
    "bench speed": _bench_speed,
    "bench memory": _bench_memory,
    "bench tokenize": _bench_tokenize,
    "bench data": _bench_data,
}


if __name__ == "__main__":
    sys.exit(main())
