"""Run hookcli over every causal-LM type transformers ships; write docs/models_llm.md.

Each type is built offline from its own default config shrunk (2 blocks of the real layer
pattern, hidden size 64, 4 heads, small MLPs and expert counts, a 512-token vocabulary), with
random weights, and inspected with `--text` through a byte-level BPE tokenizer trained here.
Two oracles decide a type's row:

- the residual stream entering every block (the first input of each block hookcli hooks)
  has the statistics of transformers' own `output_hidden_states` at that block;
- the logits are unchanged by the hooks: hookcli's statistics of the model's logits equal
  those of an unhooked forward, bit for bit.

Types run in child processes, a batch at a time (a crash or a hang is that type's row).

    python benchmarks/sweep_llm.py                 # every type (about 20 minutes on 2 cores)
    python benchmarks/sweep_llm.py --only 'llama*' --out /tmp/llm.md
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "models_llm.md"
VOCAB = 512
TEXT = "The cat sat on the mat. A dog ran in the park, and the cat saw it."
LINES = [TEXT, "hello world, the cat and the dog", "Once upon a time there was a model."]

# config fields set wherever a config has them (sub-configs too): small, consistent sizes
SIZES: dict[str, int] = {
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "n_embed": 64, "dim": 64, "embed_dim": 64,
    "intermediate_size": 128, "n_inner": 128, "ffn_dim": 128, "d_ff": 128, "ffn_hidden_size": 128,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4,
    "decoder_attention_heads": 4, "encoder_attention_heads": 4, "num_key_value_heads": 2,
    "multi_query_group_num": 2,
    "head_dim": 16, "kv_channels": 16, "d_kv": 16,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "top_k": 2, "n_shared_experts": 1,
    "vocab_size": VOCAB, "max_position_embeddings": 256, "n_positions": 256, "seq_length": 256,
    "n_ctx": 256, "max_seq_len": 256, "moe_k": 2, "attention_hidden_size": 64,
    "embedding_dim": 64, "rotary_dim": 8,
    # multi-head latent attention: rope and no-rope parts of a query/key head, low ranks
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 32,
    "q_lora_rank": 32, "num_experts_per_token": 2, "mamba_d_head": 16, "mamba_headdim": 16,
    "attention_head_dim": 16, "qk_head_dim": 16, "expert_ffn_hidden_size": 64,
    "zero_expert_num": 2, "num_layers_per_stack": 1, "num_dense_layers": 1,
}  # fmt: skip
# fields a default config leaves None where the model needs a number (hunyuan's head_dim)
UNSET = (
    "head_dim", "num_key_value_heads", "num_experts", "num_experts_per_tok", "n_routed_experts",
    "n_shared_experts",
)  # fmt: skip
# hybrid models: where the attention and expert layers sit among 2 blocks (the second)
PLACES: dict[str, Any] = {
    "attn_layer_indices": [1], "attn_layer_period": 2, "attn_layer_offset": 1,
    "expert_layer_period": 2, "expert_layer_offset": 1,
}  # fmt: skip
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers")


def _layer_types(config: Any, n: int) -> int:
    """Keep the real layer pattern: the first block of each distinct kind (at least n)."""
    for name in ("layer_types", "block_types", "layers_block_type", "hybrid_override_pattern"):
        pattern = vars(config).get(name)
        if isinstance(pattern, list | tuple) and pattern:
            kinds = list(dict.fromkeys(pattern))
            keep = [kinds[i % len(kinds)] for i in range(max(n, len(kinds)))]
            _set(config, name, type(pattern)(keep))
            return len(keep)
        if isinstance(pattern, str) and pattern:
            kinds = list(dict.fromkeys(pattern))
            text = "".join(kinds[i % len(kinds)] for i in range(max(n, len(kinds))))
            _set(config, name, text)
            return len(text)
    return n


def shrink(config: Any, seen: set[int] | None = None) -> Any:
    """The config with small sizes and 2 blocks (more when its layer pattern has more kinds)."""
    from transformers import PretrainedConfig

    seen = seen if seen is not None else set()
    if id(config) in seen:
        return config
    seen.add(id(config))
    own = vars(config)  # what the config sets (getattr may refuse per-layer fields)
    for key, value in SIZES.items():
        old = own.get(key)
        if (isinstance(old, int) and not isinstance(old, bool)) or (
            key in UNSET and key in own and old is None
        ):
            _set(config, key, value)
    hidden, attn = own.get("hidden_size"), own.get("attention_hidden_size")
    if isinstance(attn, int) and isinstance(hidden, int) and hidden and attn % hidden == 0:
        _set(config, "attention_hidden_size", SIZES["hidden_size"] * (attn // hidden))
    if "layer_types" in own and own["layer_types"] is None and "num_dense_layers" in own:
        _set(config, "layer_types", ["conv", "full_attention"])  # lfm2_moe: both kinds
    if isinstance(own.get("axial_pos_embds_dim"), list | tuple):  # reformer: sums to hidden
        _set(config, "axial_pos_embds_dim", (32, 32))
        _set(config, "axial_pos_shape", (16, 16))
    # gaps in transformers' own default configs, filled as their checkpoints fill them
    if type(config).__name__.endswith("AttentionConfig") and "rope_theta" not in own:
        _set(config, "rope_theta", 10000.0)  # dbrx's attn_config
        if "clip_qkv" in own and own["clip_qkv"] is None:
            _set(config, "clip_qkv", 8.0)  # (its modeling clamps by it)
    kinds = own.get("layer_types")
    if own.get("rope_parameters") == {} and isinstance(kinds, list | tuple):
        default = {"rope_theta": 10000.0, "rope_type": "default"}
        _set(config, "rope_parameters", {k: dict(default) for k in set(kinds)})
    if isinstance(kinds, list) and set(kinds) == {"linear_attention"}:
        _set(config, "layer_types", ["linear_attention", "full_attention"])  # a hybrid needs one
    if isinstance(own.get("kv_lora_rank"), int):  # MLA: as many key/value heads as queries
        _set(config, "num_key_value_heads", SIZES["num_attention_heads"])
    if isinstance(own.get("num_kv_shared_layers"), int):
        _set(config, "num_kv_shared_layers", 0)
    if isinstance(own.get("qk_rope_head_dim"), int) and "head_dim" in own:
        _set(config, "head_dim", SIZES["qk_rope_head_dim"])  # MLA: its rotary runs on that part
    for key, value in PLACES.items():
        if key in own and (own[key] is not None or key == "attn_layer_indices"):
            _set(config, key, value)  # (bamba's None: no attention layer at all)
    m_expand = own.get("mamba_expand")
    m_head = own.get("mamba_d_head") or own.get("mamba_headdim")
    for key in ("mamba_n_heads", "n_mamba_heads"):
        if key in own and isinstance(m_expand, int) and isinstance(m_head, int):
            _set(config, key, m_expand * SIZES["hidden_size"] // m_head)
    expand, head = own.get("expand"), own.get("head_dim") or own.get("mamba_head_dim")
    if isinstance(expand, int) and isinstance(head, int) and "num_heads" in own:
        _set(config, "num_heads", expand * SIZES["hidden_size"] // head)  # mamba2: heads x dim
    _set(config, "is_decoder", True)  # an encoder used as a causal LM (reformer, bert) is one
    layers = _layer_types(config, 2)
    for key in LAYERS:
        if isinstance(own.get(key), int):
            _set(config, key, layers)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = own.get(key)
        if isinstance(value, int) and value >= VOCAB:
            _set(config, key, {"pad_token_id": 0, "bos_token_id": 1}.get(key, 2))
        elif isinstance(value, list):
            _set(config, key, [v if isinstance(v, int) and v < VOCAB else 2 for v in value])
    for value in list(own.values()):
        for sub in value if isinstance(value, list | tuple) else [value]:
            if isinstance(sub, PretrainedConfig):
                shrink(sub, seen)
    return config


def _set(config: Any, key: str, value: Any) -> None:
    with contextlib.suppress(Exception):  # a field the config computes or validates: as it is
        setattr(config, key, value)


CHILD = """
import sys
sys.path.insert(0, {bench!r})
from sweep_llm import child
child(sys.argv[1], sys.argv[2:])
"""


def child(tokdir: str, types: list[str]) -> None:
    """In a child process: each type's row, a JSON line each."""
    import transformers as tf

    from hookcli.errors import HookcliError

    tf.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    tok = tf.AutoTokenizer.from_pretrained(tokdir)
    for t in types:
        t0 = time.perf_counter()
        out: dict[str, Any] = {"type": t}
        try:
            problem = one_type(t, tokdir, tok, out)
            out["status"] = "ok" if problem is None else "mismatch"
            if problem is not None:
                out["message"] = problem[:300]
        except HookcliError as exc:
            out.update(status=f"hookcli exit {exc.exit_code}", message=str(exc)[:300])
        except Exception as exc:
            msg = " ".join(str(exc).split())[:300]
            status = "build" if "class" not in out else "error"
            out.update(status=status, message=f"{type(exc).__name__}: {msg}")
        out["seconds"] = round(time.perf_counter() - t0, 2)
        print(json.dumps(out), flush=True)


def one_type(t: str, tokdir: str, tok: Any, out: dict[str, Any]) -> str | None:
    """Build type t shrunk, inspect it with --text, and check the oracles; the first
    disagreement, or None."""
    import torch
    import transformers as tf

    import hookcli
    from hookcli.commands.lens import find_blocks

    config = shrink(tf.AutoConfig.for_model(t))
    torch.manual_seed(0)
    try:
        model = tf.AutoModelForCausalLM.from_config(config).eval()  # type: ignore[no-untyped-call]
    except AttributeError:
        decoder = getattr(config, "decoder", None)  # musicgen: the causal LM is the decoder's
        if decoder is None:
            raise
        from transformers.models.auto import modeling_auto

        cls = getattr(tf, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t])
        model = cls(decoder).eval()
    out["class"] = type(model).__name__
    out["params"] = sum(p.numel() for p in model.parameters())
    blocks = [n for n, _ in find_blocks(model)]
    out["blocks"] = len(blocks)
    report = hookcli.inspect(
        model, text=TEXT, tokenizer=tokdir, device="cpu", layers=blocks, topk=1
    )
    enc = tok(TEXT, return_tensors="pt")
    with torch.no_grad():
        truth = model(**enc, output_hidden_states=True)
    problem = stream_problem(blocks, report, truth.hidden_states)
    if problem is not None:
        return problem
    logits = next((s for s in report.outputs if s.path.endswith('["logits"]')), None)
    lg = truth.logits.double()
    if logits is None:
        return "no logits in the output"
    if (logits.min, logits.max) != (float(lg.min()), float(lg.max())):
        return "logits changed by the hooks"
    return None


def stream_problem(blocks: list[str], report: Any, hidden: Any) -> str | None:
    """Where the residual stream entering a block differs from transformers' hidden states:
    hidden_states[i] is what enters block i (its documented meaning). A few models (mamba)
    list each block's output instead: for them block i's input is hidden_states[i - 1] and
    block 0's output hidden_states[0]; that convention is accepted when it holds throughout."""
    firsts = {c.name: c for c in reversed(report.layers)}  # each block's call 0
    if hidden is None:
        return "transformers gave no hidden states"
    entering = _stream_check(blocks, firsts, hidden, 0)
    if entering is None:
        return None
    first = firsts.get(blocks[0])
    if (
        first is not None
        and first.outputs
        and _same(first.outputs[0], hidden[0])
        and _stream_check(blocks[1:], firsts, hidden, 0) is None
    ):
        return None  # (hidden_states lists block outputs: hidden[i - 1] enters block i)
    return entering


def _stream_check(blocks: list[str], firsts: dict[str, Any], hidden: Any, at: int) -> str | None:
    for i, name in enumerate(blocks, at):
        call = firsts.get(name)
        if call is None:
            return f"{name} not called"
        if i >= len(hidden):
            return f"transformers gave {len(hidden)} hidden states"
        got = next((s for s in call.inputs if sorted(s.shape) == sorted(hidden[i].shape)), None)
        if got is None:  # (a model that runs tokens first, xlnet's (T, B, H), is the same data)
            return f"{name}: no input of the hidden states' shape {tuple(hidden[i].shape)}"
        if not _same(got, hidden[i]):
            return f"{name}: the entering stream's statistics differ from hidden_states[{i}]"
    return None


def _same(got: Any, tensor: Any) -> bool:
    """hookcli's statistics of a tensor against torch's on transformers' own (float64)."""
    want = tensor.double()
    if sorted(got.shape) != sorted(want.shape):
        return False
    ref = tuple(float(r) for r in (want.mean(), want.std(correction=0), want.min(), want.max()))
    mine = (got.mean, got.std, got.min, got.max)
    scale = max(abs(ref[0]), ref[1], 1e-30)
    return all(
        m is not None and abs(m - r) <= 1e-5 * max(scale, abs(r))
        for m, r in zip(mine, ref, strict=True)
    )


def causal_types() -> list[str]:
    from transformers.models.auto import modeling_auto

    return sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def make_tokenizer(folder: Path) -> None:
    """The tokenizer examples/tiny_llm.py trains, on this sweep's lines, saved in folder."""
    sys.path.insert(0, str(ROOT))
    from examples.tiny_llm import train_tokenizer

    train_tokenizer(LINES, VOCAB, repeat=20).save_pretrained(folder)


def run_batch(types: list[str], tokdir: str, timeout: float) -> list[dict[str, Any]]:
    """One child for the batch; a type the child never reported (a crash, a hang) is run
    alone, and if that fails too, its row says how."""
    code = CHILD.format(bench=str(Path(__file__).parent))
    try:
        res = subprocess.run(
            [sys.executable, "-c", code, tokdir, *types],
            capture_output=True,
            text=True,
            timeout=timeout * len(types),
            check=False,
        )
        stdout, stderr, code_rc = res.stdout, res.stderr, res.returncode
    except subprocess.TimeoutExpired as exc:
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr, code_rc = "timeout", -1
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    done = {r["type"] for r in rows}
    missing = [t for t in types if t not in done]
    if missing and len(types) == 1:
        tail = (stderr.strip().splitlines() or ["no output"])[-1][:200]
        why = "timeout" if stderr == "timeout" else f"crashed (exit {code_rc})"
        return [{"type": types[0], "status": why, "message": tail}]
    for t in missing:
        rows += run_batch([t], tokdir, timeout)
    return rows


def table(rows: list[dict[str, Any]], seconds: float) -> str:
    import torch
    import transformers

    ok = sum(r["status"] == "ok" for r in rows)
    lines = [
        "# Causal language models: hookcli over every causal-LM type of transformers",
        "",
        f"**{ok} of {len(rows)} causal-LM types ran** with the residual stream entering every "
        "block equal to transformers' `output_hidden_states` and the logits unchanged by the "
        "hooks.",
        "",
        f"transformers {transformers.__version__}, torch {torch.__version__}, CPU. Written by "
        f"`python benchmarks/sweep_llm.py` in {seconds / 60:.0f} minutes. Each type is built "
        "offline from its default config shrunk (2 blocks of its real layer pattern, hidden "
        f"size 64, 4 heads, small MLPs and expert counts, a {VOCAB}-token vocabulary) with random "
        "weights, and inspected with `--text` through a byte-level BPE tokenizer trained in the "
        "sweep. The oracles: each block's first input against `hidden_states[i]` (mean, std, "
        "min, max within 1e-5 of the scale), and the logits' statistics against an unhooked "
        "forward (min and max bit for bit).",
        "",
        "| type | class | params | blocks | status | seconds | why |",
        "|---|---|---:|---:|---|---:|---|",
    ]
    for r in sorted(rows, key=lambda r: r["type"]):
        why = str(r.get("message", "")).replace("|", "/")
        lines.append(
            f"| {r['type']} | {r.get('class', '')} | {r.get('params', '')} | "
            f"{r.get('blocks', '')} | {r['status']} | {r.get('seconds', '')} | {why} |"
        )
    return "\n".join(lines) + "\n"


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a table this script wrote."""
    keys = ("type", "class", "params", "blocks", "status", "seconds", "message")
    rows = []
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == len(keys) and line.startswith("| ") and cells[0] not in ("type", "---"):
            rows.append(dict(zip(keys, cells, strict=True)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", action="append", help="glob on types, repeatable")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per type")
    args = parser.parse_args()
    t0 = time.perf_counter()
    types = causal_types()
    if args.only:
        types = [t for t in types if any(fnmatch.fnmatchcase(t, g) for g in args.only)]
    with tempfile.TemporaryDirectory() as tmp:
        make_tokenizer(Path(tmp))
        batches = [types[i : i + args.batch] for i in range(0, len(types), args.batch)]
        rows: list[dict[str, Any]] = []
        with ThreadPoolExecutor(args.jobs) as pool:
            for got in pool.map(lambda b: run_batch(b, tmp, args.timeout), batches):
                rows += got
                ok = sum(r["status"] == "ok" for r in rows)
                print(f"{len(rows)}/{len(types)} done, {ok} ok", flush=True)
    seconds = time.perf_counter() - t0
    if args.only and args.out.exists():  # the other types' rows kept as they were
        done = {r["type"] for r in rows}
        rows += [r for r in read_rows(args.out) if r["type"] not in done]
    args.out.write_text(table(rows, seconds))
    ok = sum(r["status"] == "ok" for r in rows)
    print(f"{ok} of {len(rows)} causal-LM types ran; wrote {args.out}")


if __name__ == "__main__":
    main()
