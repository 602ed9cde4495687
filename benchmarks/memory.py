"""--memory, --offload and --meta, measured (issue 39).

1. One training step's memory, side by side: hookcli's saved-for-backward bytes and predicted
   step (parameters + buffers + gradients + saved, `grads --memory`), torchinfo's estimate
   (its "forward/backward pass size" and "estimated total size"), and torch's MemTracker (the
   peak of live tensors over the same forward and backward, tracked by storage); on a CUDA
   device also `torch.cuda.max_memory_allocated` of the same step without hooks.
2. What --memory costs: `grads` with and without it, interleaved in one process.
3. --offload: peak RSS of `inspect` on a ~1.2 GB saved Llama, in memory and offloaded (each in
   a fresh process), and whether every number is equal.
4. --meta: `layers` on a Llama-70B-shaped config.json: seconds and peak RSS, in a fresh process.

Usage: python benchmarks/memory.py [--batch 8] [--device cpu|cuda] [--skip-offload]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from _common import PRECISE_MALLOC, interleaved

MIB = 2**20


def _models(batch: int) -> list[tuple[str, Any, Any]]:
    import torchvision
    import transformers

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config())  # GPT-2 small, 124M
    gpt2.config.use_cache = False
    return [
        ("resnet18", torchvision.models.resnet18(), torch.randn(batch, 3, 224, 224)),
        ("resnet50", torchvision.models.resnet50(), torch.randn(batch, 3, 224, 224)),
        ("vit_b_16", torchvision.models.vit_b_16(), torch.randn(batch, 3, 224, 224)),
        ("gpt2 (124M)", gpt2, torch.randint(0, 50257, (batch, 256))),
    ]


def _step(model: Any, x: torch.Tensor) -> None:
    """Forward and backward, the output held until backward ends (as a loop's `out` is)."""
    out = model(x)
    out = getattr(out, "logits", out)
    out.sum().backward()
    del out


def _memtracker_peak(model: Any, x: torch.Tensor) -> int:
    """MemTracker's peak of live tensors over one forward and backward (gradients start
    absent), all kinds together."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model.zero_grad(set_to_none=True)
    mt = MemTracker()
    mt.track_external(model)
    with mt:
        _step(model, x)
    model.zero_grad(set_to_none=True)
    snap = mt.get_tracker_snapshot("peak")
    return max(int(d["Total"]) for d in snap.values())


def _cuda_peak(model: Any, x: torch.Tensor) -> int:
    """torch.cuda.max_memory_allocated over one unhooked forward and backward."""
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    _step(model, x)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    model.zero_grad(set_to_none=True)
    return int(peak)


def _top(report: Any) -> list[tuple[str, float]]:
    """The three calls that saved most, in MiB."""
    sizes = [(c.name, c.memory.saved_bytes or 0) for c in report.layers if c.memory is not None]
    sizes.sort(key=lambda s: -s[1])
    return [(name, n / MIB) for name, n in sizes[:3]]


def step_memory(batch: int, device: str) -> list[dict[str, Any]]:
    import torchinfo

    import hookcli

    rows = []
    for name, cpu_model, cpu_x in _models(batch):
        model = cpu_model.to(device).eval()
        x = cpu_x.to(device)
        report = hookcli.grads(model, x, memory=True, target="sum", layers=["*"], topk=0)
        mem = report.memory
        assert mem is not None
        assert mem.saved_bytes is not None
        info = torchinfo.summary(model, input_data=[x], verbose=0, device=device)
        fwd_bwd = int(info.total_output_bytes)
        estimated = int(info.total_input + fwd_bwd + info.total_param_bytes)
        row = {
            "model": name,
            "params_mib": mem.parameter_bytes / MIB,
            "saved_mib": mem.saved_bytes / MIB,
            "predicted_mib": (mem.predicted_peak or 0) / MIB,
            "torchinfo_fwd_bwd_mib": fwd_bwd / MIB,
            "torchinfo_total_mib": estimated / MIB,
            "memtracker_peak_mib": _memtracker_peak(model, x) / MIB,
            "top": _top(report),
        }
        if device == "cuda":
            row["cuda_peak_mib"] = _cuda_peak(model, x) / MIB
        rows.append(row)
        del model, x, report
    return rows


def overhead(rounds: int) -> dict[str, float]:
    import torchvision

    import hookcli

    model = torchvision.models.resnet18().eval()
    x = torch.randn(8, 3, 224, 224)
    times = interleaved(
        {
            "grads": lambda: hookcli.grads(model, x, target="sum", topk=0),
            "grads --memory": lambda: hookcli.grads(model, x, target="sum", topk=0, memory=True),
        },
        rounds,
    )
    return {**times, "ratio": times["grads --memory"] / times["grads"]}


CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
import hookcli
r = hookcli.inspect("hf:" + sys.argv[1], text=["The cat sat on the mat and looked at the dog."],
                    offload=sys.argv[2] == "1")
numbers = json.dumps([r.to_dict()[k] for k in ("layers", "outputs", "predictions")],
                     sort_keys=True)
import hashlib
def hwm():  # this process's peak RSS (ru_maxrss would carry the parent's across exec)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"rss_mib": hwm() / 1024,
                  "seconds": time.perf_counter() - t0,
                  "numbers": hashlib.sha256(numbers.encode()).hexdigest()}))
"""


def offload(tmp: Path) -> dict[str, Any]:
    import importlib
    import os
    import subprocess

    import transformers

    # the tests' tokenizer (imported by name: mypy checks benchmarks, not tests)
    make_tokenizer = importlib.import_module("tests.support.llm").make_tokenizer

    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=20,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=512,
    )  # fmt: skip
    folder = tmp / "llama-1.2g"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(folder)
    make_tokenizer().save_pretrained(folder)
    del model
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    env = {**os.environ, **PRECISE_MALLOC}
    out: dict[str, Any] = {"checkpoint_gb": size / 1e9}
    for label, flag in (("in memory", "0"), ("--offload", "1")):
        res = subprocess.run(
            [sys.executable, "-c", CHILD, str(folder), flag],
            capture_output=True, text=True, env=env, check=True, timeout=900,
        )  # fmt: skip
        out[label] = json.loads(res.stdout.strip().splitlines()[-1])
    out["equal"] = out["in memory"]["numbers"] == out["--offload"]["numbers"]
    out["rss_ratio"] = out["--offload"]["rss_mib"] / out["in memory"]["rss_mib"]
    return out


LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
    "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}  # fmt: skip
META_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from hookcli.commands.listing import layers_report
from hookcli.options import ModelOptions
r = layers_report(ModelOptions("hf:" + sys.argv[1], meta=True))
print(json.dumps({"seconds": time.perf_counter() - t0, "params": r.model.params,
                  "flops": r.flops, "modules": len(r.modules),
                  "rss_mib": next(int(l.split()[1]) for l in open("/proc/self/status")
                                  if l.startswith("VmHWM")) / 1024}))
"""


def meta(tmp: Path) -> dict[str, Any]:
    import subprocess

    folder = tmp / "llama-70b-config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_70B))
    res = subprocess.run(
        [sys.executable, "-c", META_CHILD, str(folder)],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    return dict(json.loads(res.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--skip-offload", action="store_true")
    args = ap.parse_args()
    t0 = time.perf_counter()
    print(f"## one training step's memory (batch {args.batch}, {args.device}), MiB")
    head = ["model", "params", "hookcli saved", "hookcli step", "torchinfo fwd/bwd",
            "torchinfo total", "MemTracker peak", "step ÷ MemTracker"]  # fmt: skip
    if args.device == "cuda":
        head += ["cuda max_memory_allocated", "step ÷ cuda"]
    print(" | ".join(head))
    for r in step_memory(args.batch, args.device):
        cells = [
            r["model"], f"{r['params_mib']:.1f}", f"{r['saved_mib']:.1f}",
            f"{r['predicted_mib']:.1f}", f"{r['torchinfo_fwd_bwd_mib']:.1f}",
            f"{r['torchinfo_total_mib']:.1f}", f"{r['memtracker_peak_mib']:.1f}",
            f"{r['predicted_mib'] / r['memtracker_peak_mib']:.3f}",
        ]  # fmt: skip
        if "cuda_peak_mib" in r:
            cells += [f"{r['cuda_peak_mib']:.1f}", f"{r['predicted_mib'] / r['cuda_peak_mib']:.3f}"]
        print(" | ".join(cells))
        top = ", ".join(f"{n} {mib:.1f}" for n, mib in r["top"])
        print(f"    most saved: {top}")
    o = overhead(args.rounds)
    print(f"## --memory's cost (resnet18, batch 8, {args.rounds} rounds interleaved)")
    print(f"grads {o['grads']:.3f} s, grads --memory {o['grads --memory']:.3f} s: "
          f"{o['ratio']:.3f}x")  # fmt: skip
    tmp = Path(tempfile.mkdtemp())
    try:
        m = meta(tmp)
        print("## layers --meta on a Llama-70B config.json")
        print(f"{m['params']:,} parameters, {m['flops'] / 1e12:.2f} TFLOPs, {m['modules']} "
              f"modules: {m['seconds']:.1f} s, peak RSS {m['rss_mib']:.0f} MiB")  # fmt: skip
        if not args.skip_offload:
            off = offload(tmp)
            print(f"## inspect of a {off['checkpoint_gb']:.2f} GB Llama checkpoint")
            for label in ("in memory", "--offload"):
                r = off[label]
                print(f"{label}: peak RSS {r['rss_mib']:.0f} MiB, {r['seconds']:.1f} s")
            print(f"peak RSS --offload ÷ in memory: {off['rss_ratio']:.3f}; "
                  f"every number equal: {off['equal']}")  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
