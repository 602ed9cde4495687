"""hookcli's command line with --tp under torchrun (gloo, CPU): each rank runs the same commands
in-process (Typer's CliRunner) inside the process group this script starts, as `torchrun -m
hookcli … --tp` would run them one by one. Without --tp, the same commands in one process are
the oracle (`commands`).

    python -m torch.distributed.run --nproc_per_node 2 tp_cli.py FOLDER OUT

FOLDER holds the checkpoints `checkpoints` writes. Rank 0 writes each run's report as
OUT/<run>.json (-o); every rank writes OUT/rank<R>.json: per run, its exit code, stdout and
stderr.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TEXT = "The cat sat on the mat."
TEXTS = "The cat sat on the mat.\nA dog ran.\n"


def checkpoints(folder: Path) -> None:
    """A tiny Llama and Qwen3 (per-head norms between the sharded projections) with their
    tokenizer; GPT-2, which transformers has no tensor-parallel plan for; a Llama of 3 heads,
    which 2 processes cannot share; and a text file of two lines of different lengths."""
    import torch
    import transformers

    from tests.support.llm import VOCAB, make_tokenizer, save

    save(folder / "llama", "llama")
    save(folder / "gpt2", "gpt2")
    for name, model in (
        (
            "qwen3",
            transformers.Qwen3ForCausalLM(
                transformers.Qwen3Config(
                    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    max_position_embeddings=64,
                )
            ),
        ),
        (
            "odd",
            transformers.LlamaForCausalLM(
                transformers.LlamaConfig(
                    vocab_size=VOCAB, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                    num_attention_heads=3, num_key_value_heads=3, max_position_embeddings=64,
                )
            ),
        ),
    ):  # fmt: skip
        torch.manual_seed(0)
        model.eval().save_pretrained(folder / name)
        make_tokenizer().save_pretrained(folder / name)
    (folder / "two.txt").write_text(TEXTS)


def commands(folder: Path) -> dict[str, list[str]]:
    """Each run's command line, without --tp and -o."""
    llama, qwen = f"hf:{folder / 'llama'}", f"hf:{folder / 'qwen3'}"
    every = ["--depth", "9"]
    return {
        "inspect": ["inspect", llama, "--text", TEXT, *every],
        "grads": ["grads", llama, "--text", TEXT, *every],
        "qwen3": ["grads", qwen, "--text", TEXT, *every],
        "texts": ["inspect", llama, "--text-file", str(folder / "two.txt"), *every],
        "generate": ["inspect", llama, "--text", "The cat sat", "--generate", "3", *every],
        "lens": ["lens", llama, "--text", TEXT],
        "check": ["check", llama, "--text", TEXT, "--fail-on", "nonfinite", "--backward"],
        "eager": [
            "inspect",
            llama,
            "--text",
            TEXT,
            "-l",
            "*self_attn",
            "--model-arg",
            "attn_implementation=eager",
        ],
    }


def watched(folder: Path, log: Path, tp: bool) -> None:
    """Three steps of SGD on the Llama (its plan with `tp`) under `hookcli.watch`, each step's
    layers and parameters logged (under torchrun: a log per rank)."""
    import torch
    import transformers

    import hookcli

    kw = {"tp_plan": "auto"} if tp else {}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder / "llama", **kw)
    ids = torch.tensor([[5, 17, 42, 9, 33, 71, 8]])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    layers = ["model.layers.*", "model.layers.0.*"]  # blocks, and one block's every module
    with hookcli.watch(model, optimizer=opt, layers=layers, log=log):
        for _ in range(3):
            opt.zero_grad()
            model(ids, labels=ids).loss.backward()
            opt.step()


REFUSED = {  # run → (checkpoint, what the one line says)
    "no-plan": ("gpt2", "no tensor-parallel plan"),
    "heads": ("odd", "3 attention heads do not divide over 2 processes"),
}


def main() -> None:
    import torch.distributed as dist
    from typer.testing import CliRunner

    from hookcli.cli import app

    folder, out = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    runner = CliRunner()
    seen: dict[str, dict[str, object]] = {}
    runs = {
        name: [*args, "--tp", "-o", str(out / f"{name}.json")]
        for name, args in commands(folder).items()
    }
    runs["stdout"] = [
        "inspect",
        f"hf:{folder / 'llama'}",
        "--text",
        TEXT,
        "--format",
        "json",
        "--tp",
    ]
    for name, (model, _) in REFUSED.items():
        runs[name] = ["inspect", f"hf:{folder / model}", "--text", TEXT, "--tp"]
    for name, args in runs.items():
        res = runner.invoke(app, args)
        seen[name] = {"code": res.exit_code, "stdout": res.stdout, "stderr": res.stderr}
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    watched(folder, out / "watch.jsonl", tp=True)
    dist.barrier()  # every rank here before any takes the group down (sharded_run._leave)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
