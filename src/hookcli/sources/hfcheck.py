"""What a Hugging Face model folder and config must be before anything is built from them: a
config.json naming a type transformers ships (never remote code), safetensors weights (never a
pickle), a preprocessor_config.json and a generation_config.json whose values can be used, and
sizes that fit this machine. Each refusal is one line naming the file and the value."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hookcli.errors import UsageError
from hookcli.sources.hfbase import (
    json_file,
)
from hookcli.sources.skeleton import META


def size_fields(size: Any) -> dict[str, Any]:
    """An image processor's `size` (a dict, or transformers 5's SizeDict) as a dict of the
    fields that are set."""
    if isinstance(size, Mapping):
        items = dict(size)
    elif hasattr(size, "__dataclass_fields__"):
        items = {f: getattr(size, f) for f in size.__dataclass_fields__}
    else:
        items = {}
    return {k: v for k, v in items.items() if v is not None}


def auto_module(name: str) -> Any:
    """transformers.models.auto.NAME (its name tables are not re-exported)."""
    import importlib

    return importlib.import_module(f"transformers.models.auto.{name}")


# weights transformers would unpickle (or that need another framework): never loaded here
_PICKLED = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.h5", "*.msgpack")


def check_folder(tf: Any, spec: str, folder: Path, building: str = "") -> None:
    """A saved model folder hookcli can load without running anything from it: config.json a
    JSON object naming a model type this transformers ships (no auto_map: that is remote
    code), preprocessor_config.json (when present) a JSON object, and safetensors weights
    (pickled .bin weights are never loaded: unpickling can run code). Every file in it is
    the run's input: no output may replace one (issue 49)."""
    from hookcli.io.output import MODEL_FOLDER, note_read

    note_read(f"{MODEL_FOLDER}{folder}")
    config = json_file(spec, folder / "config.json") or {}
    json_file(spec, folder / "preprocessor_config.json")
    generation = json_file(spec, folder / "generation_config.json")
    if generation is not None:
        problem = generation_problem(generation)
        if problem is not None:
            raise UsageError(
                f"{spec}: generation_config.json {problem}.",
                "fix the file (save_pretrained writes it), or remove it for the defaults.",
            )
    model_type = config.get("model_type")
    if config.get("auto_map") or not isinstance(model_type, str) or not model_type:
        raise UsageError(
            f"{spec} needs code of its own to build (its config.json has "
            f"{'auto_map' if config.get('auto_map') else 'no model_type'}): hookcli never runs "
            "a model folder's code (trust_remote_code).",
            "build the model in Python and pass it to hookcli's API (hookcli.inspect(model, …)).",
        )
    if model_type not in auto_module("configuration_auto").CONFIG_MAPPING_NAMES:
        raise UsageError(
            f"{spec}: model type {model_type!r} is not one transformers {tf.__version__} ships; "
            "its code would have to come from the folder, which hookcli never runs.",
            "upgrade transformers if a newer one has it, or pass the model to hookcli's API.",
        )
    if any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file():
        return
    if building == META:  # config.json is all --meta reads
        return
    pickled = sorted({p.name for pattern in _PICKLED for p in folder.glob(pattern)})
    if pickled:
        raise UsageError(
            f"{spec} holds its weights only as {', '.join(pickled[:3])}: hookcli does not "
            "unpickle a model folder's files (a pickle can run code).",
            "convert them where you trust them: model.save_pretrained(DIR) writes "
            "model.safetensors.",
        )
    raise UsageError(
        f"{spec} holds no weights (no model.safetensors in {folder}).",
        "give the folder save_pretrained wrote, or hf:TYPE for a randomly initialised model.",
    )


def _whole(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


# generation_config.json's fields generate() reads, and what each must be
_GENERATION: dict[str, tuple[Any, str]] = {
    "max_new_tokens": (lambda v: _whole(v) and v > 0, "a whole number above 0"),
    "max_length": (lambda v: _whole(v) and v > 0, "a whole number above 0"),
    "min_new_tokens": (lambda v: _whole(v) and v >= 0, "a whole number, 0 or more"),
    "min_length": (lambda v: _whole(v) and v >= 0, "a whole number, 0 or more"),
    "num_beams": (lambda v: _whole(v) and v >= 1, "a whole number, 1 or more"),
    "num_return_sequences": (lambda v: _whole(v) and v >= 1, "a whole number, 1 or more"),
    "top_k": (lambda v: _whole(v) and v >= 0, "a whole number, 0 or more"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "temperature": (lambda v: _number(v) and v > 0, "a number above 0"),
    "repetition_penalty": (lambda v: _number(v) and v > 0, "a number above 0"),
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    "use_cache": (lambda v: isinstance(v, bool), "true or false"),
    **{
        name: (
            lambda v: (
                (_whole(v) and v >= 0)
                or (isinstance(v, list) and all(_whole(x) and x >= 0 for x in v))
            ),
            "a token id (a whole number, 0 or more) or a list of them",
        )
        for name in ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id")
    },
}


def generation_problem(settings: Mapping[str, Any]) -> str | None:
    """What in generation_config.json generate() could not use (a max_new_tokens of "abc",
    a temperature of -1, an end-of-sequence id "x"), or None. null is a field left unset."""
    for name, (fits, what) in _GENERATION.items():
        value = settings.get(name)
        if value is not None and not fits(value):
            return f"gives {name} {value!r}, not {what}"
    return None


# config fields that are sizes: a positive whole number (or a list of them) when present
_SIZES = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "image_size", "patch_size", "num_channels",
    "max_position_embeddings", "n_embd", "n_layer", "n_head", "d_model", "num_layers",
    "embed_dim", "encoder_layers", "decoder_layers",
)  # fmt: skip


def check_config(config: Any, spec: str, building: str = "") -> None:
    """Sizes that cannot build a model (a negative image size, zero layers) or would not fit
    this machine (a hidden size of 10^8) are the user's input, refused in one line before
    anything is allocated."""
    for name in _SIZES:
        value = getattr(config, name, None)
        if value is None:
            continue
        items = value if isinstance(value, list | tuple) else [value]
        if not items or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in items):
            raise UsageError(
                f"{spec}: config field {name} is {value!r}, not a positive whole number.",
                "fix config.json or the --model-arg value.",
            )
    hidden = getattr(config, "hidden_size", None) or getattr(config, "d_model", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "num_layers", None)
    if building:  # --meta, --offload: the weights are never all in memory, but each block
        # is modules built one by one: absurd depths are refused as absurd sizes are (issue 49)
        if isinstance(layers, int) and layers > MAX_BUILT_LAYERS:
            raise UsageError(
                f"{spec} has {layers} layers; building that many blocks would take longer than "
                f"any model needs (the deepest ones have a few hundred; hookcli stops at "
                f"{MAX_BUILT_LAYERS}).",
                "check config.json or the --model-arg values.",
            )
        return
    if not isinstance(hidden, int) or not isinstance(layers, int):
        return
    inner = getattr(config, "intermediate_size", None)
    inner = inner if isinstance(inner, int) else 4 * hidden
    vocab = getattr(config, "vocab_size", None)
    vocab = vocab if isinstance(vocab, int) else 0
    need = 4 * (layers * (4 * hidden * hidden + 3 * hidden * inner) + vocab * hidden)
    have = _memory()
    if have and need > have:
        raise UsageError(
            f"{spec} would need about {need / 2**30:.0f} GiB for its float32 parameters "
            f"(hidden_size {hidden}, {layers} layers), more than this machine's "
            f"{have / 2**30:.0f} GiB.",
            "check config.json or the --model-arg values.",
        )


MAX_BUILT_LAYERS = 4096  # --meta/--offload: more blocks than any model has (Llama-405B: 126)


def _memory() -> int | None:
    """This machine's physical memory in bytes, where it can be told."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


MAX_PROCESSOR_SIDE = 8192  # pixels a saved processor may resize or crop an image's side to


def processor_problem(processor: Any) -> str | None:
    """What in an image processor's settings cannot preprocess an image, or None: sizes that
    are not whole numbers in 1…8192, a mean or std that is not numbers (one per channel, a
    std of 0), a rescale factor that is not a number."""
    for field in ("size", "crop_size"):
        for key, value in size_fields(getattr(processor, field, None)).items():
            if isinstance(value, bool) or not isinstance(value, int):
                return f"gives {field} {key} {value!r}, not a whole number of pixels"
            if not 1 <= value <= MAX_PROCESSOR_SIDE:
                return f"gives {field} {key} {value}, outside 1…{MAX_PROCESSOR_SIDE} pixels"
    for field in ("image_mean", "image_std"):
        value = getattr(processor, field, None)
        if value is None:
            continue
        items = list(value) if isinstance(value, list | tuple) else [value]
        if not items or any(isinstance(v, bool) or not isinstance(v, int | float) for v in items):
            return f"gives {field} {value!r}, not numbers (one per channel)"
        if field == "image_std" and any(v == 0 for v in items):
            return f"gives {field} {value!r}: a std of 0 divides by zero"
    factor = getattr(processor, "rescale_factor", None)
    if factor is not None and (isinstance(factor, bool) or not isinstance(factor, int | float)):
        return f"gives rescale_factor {factor!r}, not a number"
    return None
