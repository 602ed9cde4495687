"""`hookcli calib … -o FILE.imatrix`: llama.cpp's importance matrix, from calib's sums.

llama-imatrix collects, for each weight matrix `W` of a GGUF model, the sum over every token of
each input channel's x² and the number of tokens; `llama-quantize --imatrix FILE` weighs each
column's rounding error by their ratio (the mean x²). The file is a GGUF file:
`general.type = "imatrix"`, `imatrix.datasets` (the data's names), `imatrix.chunk_count` and
`imatrix.chunk_size`, and per weight two F32 tensors, `NAME.in_sum2` (ne = [columns,
matrices]) and `NAME.counts` (ne = [1, matrices]), NAME the weight's GGUF name
(`blk.0.attn_q.weight`; a dense weight is one matrix, `blk.0.ffn_down_exps.weight` one per
expert).

calib already merges each layer's input channels exactly over the passes (count, mean and
population std per channel, padding never counted): Σx² = count · (std² + mean²), in float64,
written as float32 as llama.cpp writes it. The GGUF names come from the `gguf` package's tensor
name map of the model's architecture (as transformers' GGUF loading maps them back); a
calibrated layer with no GGUF name (a vision tower, a custom head) is counted, not written.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hookcli.errors import UsageError
from hookcli.records import CalibLayer, CalibReport

# transformers' model types whose GGUF architecture has another name (as transformers maps them)
_ARCH_ALIASES = {
    "mistral": "llama",  # llama.cpp converts Mistral and Mixtral as llama
    "mixtral": "llama",
    "cohere": "command-r",
    "qwen2_moe": "qwen2moe",
    "qwen3_moe": "qwen3moe",
    "gemma3_text": "gemma3",
    "gemma4_text": "gemma4",
    "minimax_m2": "minimax-m2",
    "gpt_oss": "gpt-oss",
}


def _gguf() -> Any:
    from hookcli.sources.base import import_extra

    return import_extra("gguf", "quant", "calib -o FILE.imatrix (llama.cpp's importance matrix)")


def check_imatrix_model(spec: str) -> None:
    """Before calibrating: the gguf package is here and the model is a transformers one (only
    those have GGUF tensor names)."""
    gguf = _gguf()
    if not spec.startswith("hf:"):
        raise UsageError(
            f"an imatrix names tensors as llama.cpp's GGUF files do; {spec or 'the model'} is "
            "not a transformers language model (hf:PATH or hf:ORG/NAME).",
            "write the scales with -o FILE.safetensors instead.",
        )
    import json

    config = Path(spec[3:]).expanduser() / "config.json"  # a local folder: its type, now
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return  # (a hub name, or no config: the load says what is wrong)
    if isinstance(model_type, str) and _arch_of(gguf, model_type) is None:
        raise UsageError(
            f"the gguf package knows no GGUF architecture for {model_type} models, so their "
            "tensors have no llama.cpp names.",
            "update the gguf package (pip install -U gguf), or write -o FILE.safetensors.",
        )


def _arch_of(gguf: Any, model_type: str) -> Any:
    """The gguf package's architecture for a transformers model type, or None."""
    wanted = _ARCH_ALIASES.get(model_type, model_type)
    return next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == wanted), None)


def _name_map(report: CalibReport) -> tuple[Any, str]:
    """The gguf package's tensor name map for the calibrated model, and its architecture."""
    gguf = _gguf()
    if report.model_type is None or report.blocks is None:
        raise UsageError(
            f"an imatrix names tensors as llama.cpp's GGUF files do; {report.model.spec} is not "
            "a transformers language model with a GGUF architecture.",
            "write the scales with -o FILE.safetensors instead.",
        )
    wanted = _ARCH_ALIASES.get(report.model_type, report.model_type)
    arch = _arch_of(gguf, report.model_type)
    if arch is None:
        raise UsageError(
            f"the gguf package knows no GGUF architecture for {report.model_type} models, so "
            "their tensors have no llama.cpp names.",
            "update the gguf package (pip install -U gguf), or write -o FILE.safetensors.",
        )
    return gguf.get_tensor_name_map(arch, report.blocks), str(wanted)


Entries = dict[str, tuple["np.ndarray[Any, Any]", "np.ndarray[Any, Any]"]]


def _sums(layer: CalibLayer) -> tuple[np.ndarray[Any, Any], int]:
    """Σx² of each input channel (count · (std² + mean²), float64) and the tokens."""
    ch = layer.channels
    sums = np.array(
        [
            n * ((s or 0.0) ** 2 + (m or 0.0) ** 2)
            for n, m, s in zip(ch.count, ch.mean, ch.std, strict=True)
        ],
        dtype=np.float64,
    )
    return sums, max(ch.count, default=0)


def _expert(name: str) -> tuple[str, int, str] | None:
    """(experts module, expert, projection) of calib's name for a routed expert's projection
    (EXPERTS.E.PROJ), or None."""
    owner, _, rest = name.rpartition(".")
    owner, _, expert = owner.rpartition(".")
    return (owner, int(expert), rest) if owner and expert.isdigit() else None


def imatrix_entries(report: CalibReport) -> tuple[Entries, list[str]]:
    """GGUF weight name → (Σx² per input channel per matrix, float64, (matrices, columns);
    tokens per matrix), and the calibrated layers with no GGUF name. A dense weight is one
    matrix; a fused MoE block's experts are one 3-D weight per projection in llama.cpp
    (`blk.N.ffn_down_exps`: a matrix per expert, an expert no token reached all zeros), the
    fused gate_up projection's input that of both ffn_gate_exps and ffn_up_exps."""
    names, _ = _name_map(report)
    entries: Entries = {}
    unnamed: list[str] = []
    experts: dict[tuple[str, str], dict[int, tuple[np.ndarray[Any, Any], int]]] = {}

    def put(key: str, value: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]], who: str) -> None:
        if key in entries:
            raise UsageError(
                f"two calibrated layers have the GGUF name {key} (the second {who}).",
                "calibrate one of them (-l), or write -o FILE.safetensors.",
            )
        entries[key] = value

    for layer in report.layers:
        gguf_name = names.get_name(layer.name)
        found = _expert(layer.name) if gguf_name is None else None
        if found is not None:
            owner, e, projection = found
            experts.setdefault((owner, projection), {})[e] = _sums(layer)
        elif gguf_name is None:
            unnamed.append(layer.name)
        else:
            sums, count = _sums(layer)
            put(f"{gguf_name}.weight", (sums[None, :], np.array([count])), layer.name)
    for (owner, projection), per in experts.items():
        parts = ["gate_proj", "up_proj"] if projection == "gate_up_proj" else [projection]
        targets = [names.get_name(f"{owner}.{p}") for p in parts]
        if any(t is None for t in targets):
            unnamed += [f"{owner}.{e}.{projection}" for e in sorted(per)]
            continue
        n = max(report.experts or 0, max(per) + 1)
        width = len(next(iter(per.values()))[0])
        sums = np.zeros((n, width))
        counts = np.zeros(n)
        for e, (s, c) in per.items():
            sums[e], counts[e] = s, c
        for t in targets:
            put(f"{t}.weight", (sums, counts), f"{owner}.{projection}")
    return entries, unnamed


def imatrix_bytes(report: CalibReport, dataset: str) -> tuple[bytes, int, list[str]]:
    """The imatrix file's bytes, the matrices in it, and the calibrated layers left out (no
    GGUF name)."""
    gguf = _gguf()
    entries, unnamed = imatrix_entries(report)
    if not entries:
        raise UsageError(
            f"none of the {len(report.layers)} calibrated layers has a GGUF tensor name "
            f"(first {report.layers[0].name if report.layers else '-'}): no imatrix to write.",
            "calibrate the model's Linear layers (no -l), or write -o FILE.safetensors.",
        )
    _, arch = _name_map(report)
    tokens = int(max(float(counts.max()) for _, counts in entries.values()))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.imatrix"
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_string("general.type", "imatrix")
        writer.add_array("imatrix.datasets", [dataset])
        writer.add_uint32("imatrix.chunk_count", max(report.sequences, 1))
        writer.add_uint32("imatrix.chunk_size", math.ceil(tokens / max(report.sequences, 1)))
        for name in sorted(entries):
            sums, counts = entries[name]  # (matrices, columns) and (matrices,)
            writer.add_tensor(f"{name}.in_sum2", np.ascontiguousarray(sums, dtype=np.float32))
            writer.add_tensor(f"{name}.counts", counts.astype(np.float32).reshape(-1, 1))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path.read_bytes(), len(entries), unnamed
