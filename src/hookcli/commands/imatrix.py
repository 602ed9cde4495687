"""`hookcli calib … -o FILE.imatrix`: llama.cpp's importance matrix, from calib's sums.

llama-imatrix collects, for each weight matrix `W` of a GGUF model, the sum over every token of
each input channel's x² and the number of tokens; `llama-quantize --imatrix FILE` weighs each
column's rounding error by their ratio (the mean x²). The file is a GGUF file:
`general.type = "imatrix"`, `imatrix.datasets` (the data's names), `imatrix.chunk_count` and
`imatrix.chunk_size`, and per matrix two F32 tensors, `NAME.in_sum2` (ne = [columns, 1]) and
`NAME.counts` (ne = [1, 1]), NAME the weight's GGUF name (`blk.0.attn_q.weight`).

calib already merges each layer's input channels exactly over the passes (count, mean and
population std per channel, padding never counted): Σx² = count · (std² + mean²), in float64,
written as float32 as llama.cpp writes it. The GGUF names come from the `gguf` package's tensor
name map of the model's architecture (as transformers' GGUF loading maps them back); a
calibrated layer with no GGUF name (a vision tower, a custom head, a fused MoE block's experts,
which llama.cpp keeps as one 3-D tensor per projection) is counted, not written.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from hookcli.errors import UsageError
from hookcli.records import CalibReport

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


def imatrix_entries(
    report: CalibReport,
) -> tuple[dict[str, tuple[np.ndarray[Any, Any], int]], list[str]]:
    """GGUF weight name → (Σx² per input channel, float64; tokens), and the calibrated layers
    with no GGUF name."""
    names, _ = _name_map(report)
    entries: dict[str, tuple[np.ndarray[Any, Any], int]] = {}
    unnamed: list[str] = []
    for layer in report.layers:
        gguf_name = names.get_name(layer.name)
        if gguf_name is None:
            unnamed.append(layer.name)
            continue
        key = f"{gguf_name}.weight"
        if key in entries:
            raise UsageError(
                f"two calibrated layers have the GGUF name {key} (the second {layer.name}).",
                "calibrate one of them (-l), or write -o FILE.safetensors.",
            )
        ch = layer.channels
        sums = np.array(
            [
                n * ((s or 0.0) ** 2 + (m or 0.0) ** 2)
                for n, m, s in zip(ch.count, ch.mean, ch.std, strict=True)
            ],
            dtype=np.float64,
        )
        entries[key] = (sums, max(ch.count, default=0))
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
    tokens = max(count for _, count in entries.values())
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "out.imatrix"
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_string("general.type", "imatrix")
        writer.add_array("imatrix.datasets", [dataset])
        writer.add_uint32("imatrix.chunk_count", max(report.sequences, 1))
        writer.add_uint32("imatrix.chunk_size", math.ceil(tokens / max(report.sequences, 1)))
        for name in sorted(entries):
            sums, count = entries[name]
            writer.add_tensor(f"{name}.in_sum2", sums.astype(np.float32).reshape(1, -1))
            writer.add_tensor(f"{name}.counts", np.array([[count]], dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path.read_bytes(), len(entries), unnamed
