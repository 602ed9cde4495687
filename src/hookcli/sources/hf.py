"""Hugging Face transformers models, offline and never with `trust_remote_code`:

    hf:TYPE        a randomly initialised model from AutoConfig.for_model(TYPE), with the
                   type's own head: a causal LM for decoder types (llama, gpt2), a seq2seq LM
                   for encoder-decoder ones (t5, bart), image classification for vision types,
                   sequence classification for other text types; --model-arg key=value sets
                   config fields (hidden_size=64, num_labels=10)
    hf:PATH        a model directory saved with save_pretrained (its weights), built as the class
                   its config.json names (`architectures`)
    hf:ORG/NAME    a model in the local hub cache (its weights; never downloaded), likewise

--head causal-lm|seq2seq-lm|seq-cls|image-cls|base builds another head; weights that do not
fit the head built (missing, unexpected or mis-shaped keys) are an error, never a head
initialised at random in silence (`base` may drop the checkpoint's head, and says so).

The output is a ModelOutput: `logits` drive predictions and backward targets. Images go through
the model's image processor into `pixel_values`; token ids (`--input randint:0:1000:1x16`)
become `input_ids` with an all-ones `attention_mask`; text (`--text`) goes through the
checkpoint's tokenizer (sources/lm.py).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hookcli.errors import ModelError, UsageError, not_a_file, one_line
from hookcli.io.output import user_path
from hookcli.sources.base import Source, hf_cache_path, import_extra, kwargs_text, quiet_warnings
from hookcli.sources.hfbase import (
    HFOther,
    HFText,
    HFVision,
    quiet_transformers,
    transformers_module,
)
from hookcli.sources.hfcheck import (
    auto_module,
    check_config,
    check_folder,
    processor_problem,
    size_fields,
)
from hookcli.sources.model import LoadedModel
from hookcli.sources.skeleton import META, OFFLOAD, TP
from hookcli.sources.statedict import load_state_dict_file
from hookcli.sources.tasks import Task
from hookcli.text import few

# --head: the Auto class each head is built with
HEADS: dict[str, str] = {
    "causal-lm": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "seq-cls": "AutoModelForSequenceClassification",
    "image-cls": "AutoModelForImageClassification",
    "base": "AutoModel",
}
# the mappings that tell which head a model class is (first match wins)
_HEAD_MAPPINGS = (
    ("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    ("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"),
    ("image-cls", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"),
    ("seq-cls", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"),
)


class HFSource(Source):
    """`hf:TYPE`, `hf:PATH`, `hf:ORG/NAME`."""

    name = "hf"
    prefix = "hf"
    builds = frozenset({"meta", "offload", "tp"})

    def load(
        self,
        spec: str,
        *,
        weights: str,
        seed: int,
        model_args: dict[str, Any],
        head: str | None = None,
        building: str = "",
    ) -> LoadedModel:
        rest = spec.removeprefix("hf:").strip()
        if not rest:
            raise UsageError(
                "hf: needs a model type, a saved model folder or ORG/NAME.",
                "for example hf:vit, hf:./my-model or hf:google/vit-base-patch16-224",
            )
        return load_hf(
            spec, rest, weights, seed, model_args, head=check_head(head), building=building
        )


class ImageProcessor:
    """An HF image processor as a PIL image → (C, H, W) tensor preprocessing."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        short = size_fields(getattr(processor, "size", None)).get("shortest_edge")
        # inputs.short_side_resize reads this to refuse images a resize would blow up
        self.resize_size = [int(short)] if isinstance(short, int) else None

    def __call__(self, image: Any) -> torch.Tensor:
        out = self.processor(images=image, return_tensors="pt")
        return out["pixel_values"][0]  # type: ignore[no-any-return]

    def describe(self) -> str:
        p = self.processor
        parts = [type(p).__name__ + ":"]
        size = size_fields(getattr(p, "size", None))
        if getattr(p, "do_resize", True) and size:
            shown = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in size.items())
            pct = getattr(p, "crop_pct", None)
            parts.append(f"resize ({shown}{f', crop_pct {pct:g}' if pct else ''}),")
        crop = size_fields(getattr(p, "crop_size", None))
        if getattr(p, "do_center_crop", False) and crop:
            parts.append(f"center crop {crop.get('height')}x{crop.get('width')},")
        if getattr(p, "do_normalize", False):
            mean = ", ".join(f"{v:g}" for v in p.image_mean)
            std = ", ".join(f"{v:g}" for v in p.image_std)
            parts.append(f"mean ({mean}), std ({std})")
        return " ".join(parts).rstrip(",")


def _mapping(which: str) -> Mapping[str, Any]:
    return getattr(auto_module("modeling_auto"), which)  # type: ignore[no-any-return]


def model_types(kind: str) -> list[str]:
    """Model types with an image-classification (`image`) or sequence-classification
    (`text`) head."""
    transformers_module()  # a missing extra is named before the tables are read
    which = (
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"
        if kind == "image"
        else "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"
    )
    return sorted(_mapping(which))


def type_head(model_type: str) -> str:
    """The head a bare hf:TYPE gets: image classification for vision types, a seq2seq LM for
    encoder-decoder text types, a causal LM for decoder types (an encoder such as bert, which
    also has a masked-LM head, is not one), sequence classification for other text types,
    else the bare model."""
    if model_type in _mapping("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES"):
        return "image-cls"
    if model_type in _mapping("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES"):
        return "seq2seq-lm"
    if model_type in _mapping("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES") and model_type not in _mapping(
        "MODEL_FOR_MASKED_LM_MAPPING_NAMES"
    ):
        return "causal-lm"
    if model_type in _mapping("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES"):
        return "seq-cls"
    return "base"


def class_head(model: nn.Module) -> str:
    """Which head a built model is, by its class name in transformers' mappings."""
    name = type(model).__name__
    for head, which in _HEAD_MAPPINGS:
        for found in _mapping(which).values():
            if name == found or (isinstance(found, tuple | list) and name in found):
                return head
    return "base"


def check_head(head: str | None) -> str | None:
    if head is None or head in HEADS:
        return head
    close = difflib.get_close_matches(head, list(HEADS), n=1, cutoff=0.5)
    near = f" Did you mean {close[0]}?" if close else ""
    raise UsageError(
        f"--head {head!r} is not a head hookcli builds.{near}",
        f"use one of {', '.join(HEADS)}.",
    )


def _auto(tf: Any, head: str) -> Any:
    return getattr(tf, HEADS[head])


def _config_for_type(tf: Any, model_type: str, overrides: dict[str, Any]) -> Any:
    known = auto_module("configuration_auto").CONFIG_MAPPING_NAMES
    if model_type not in known:
        close = difflib.get_close_matches(model_type, list(known), n=4, cutoff=0.6)
        near = f" Did you mean {', '.join(close)}?" if close else ""
        raise UsageError(
            f"transformers has no model type {model_type!r}.{near}",
            "give a model type (hf:vit, hf:bert), a saved model folder, or ORG/NAME.",
        )
    try:
        return tf.AutoConfig.for_model(model_type, **overrides)
    except Exception as exc:  # a type or value the typed config refuses: the user's input
        if not isinstance(exc, TypeError | ValueError) and not _refused_value(exc):
            raise
        text = one_line(exc, whole=_refused_value(exc))
        raise UsageError(
            f"cannot make a {model_type} config ({kwargs_text(overrides)}): {text}",
            "check --model-arg names and values against the model's config fields.",
        ) from exc


def _processor_for_type(tf: Any, model_type: str, config: Any) -> Any | None:
    found = auto_module("image_processing_auto").IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type)
    if not found:
        return None
    names: list[str | None]
    if isinstance(found, Mapping):  # transformers 5: {"pil": …, "torchvision": …}
        names = [found.get("pil"), found.get("torchvision")]
    elif isinstance(found, str):
        names = [found]
    else:  # transformers 4: (slow, fast)
        names = list(found)
    for class_name in names:
        cls = getattr(tf, class_name, None) if class_name else None
        if cls is None:
            continue
        made = _processor_args(model_type, config)
        try:
            with quiet_warnings():
                processor = cls(**made)
                size = getattr(config, "image_size", None)
                current = size_fields(getattr(processor, "size", None))
                if isinstance(size, int):  # the size the config was built for
                    if "height" in current:
                        processor = cls(**made, size={"height": size, "width": size})
                    elif "shortest_edge" in current:
                        processor = cls(**made, size={"shortest_edge": size})
        except Exception as exc:  # a processor that needs a checkpoint's own settings
            raise ModelError(
                f"cannot make hf:{model_type}'s image processor {class_name} without a saved "
                f"model: {one_line(exc)}",
                "give the input as tensors (--input pixel_values=randn:1x3x224x224), or load "
                "a saved model folder (hf:PATH) with its preprocessor_config.json.",
            ) from exc
        return processor
    return None


def _processor_args(model_type: str, config: Any) -> dict[str, Any]:
    """What a type's image processor needs that its defaults do not give: timm_wrapper's
    is timm's pretrained config of the wrapped architecture."""
    arch = getattr(config, "architecture", None)
    if model_type != "timm_wrapper" or not isinstance(arch, str):
        return {}
    timm = import_extra("timm", "timm", "hf:timm_wrapper models")
    cfg = timm.models.get_pretrained_cfg(arch)
    return {"pretrained_cfg": cfg.to_dict() if cfg is not None else {}, "architecture": arch}


def load_hf(
    spec: str,
    rest: str,
    weights: str,
    seed: int,
    overrides: dict[str, Any],
    *,
    head: str | None = None,
    building: str = "",
) -> LoadedModel:
    """An hf: model; `building` "meta" or "offload" (sources/skeleton.py) builds it without
    its weights in memory."""
    tf = transformers_module()
    local = user_path(rest, "hf: model folder")
    torch.manual_seed(seed)
    processor = None
    notes: list[str] = []
    tokenizer_from: str | None = None
    if local.is_dir() or rest.startswith((".", "/", "~")) or os.sep + os.sep in rest:
        model, processor, label = _from_saved(
            tf, rest, local, overrides, head=head, notes=notes, building=building
        )
        tokenizer_from = str(local)
    elif "/" in rest:
        model, processor, label = _from_cache(
            tf, rest, overrides, head=head, notes=notes, building=building
        )
        tokenizer_from = rest
    elif building in (OFFLOAD, TP):
        how = "block by block" if building == OFFLOAD else "spread over the processes"
        raise UsageError(
            f"--{building} reads a saved checkpoint ({how}); {spec} is a model type (random "
            "weights, nothing to read).",
            "give hf:FOLDER written by save_pretrained, or hf:ORG/NAME from the cache.",
        )
    else:
        config = _config_for_type(tf, rest, overrides)
        check_config(config, spec, building)
        built = head or type_head(rest)
        auto = _auto(tf, built)
        if (
            getattr(config, "is_encoder_decoder", False)
            and getattr(config, "decoder_start_token_id", None) is None
            and isinstance(getattr(config, "pad_token_id", None), int)
        ):  # t5: its checkpoints start the decoder at <pad>; its default config does not say
            config.decoder_start_token_id = config.pad_token_id
        if getattr(config, "architectures", None) is None:
            # a type with several head classes (deit, levit, perceiver) iterates over this in
            # from_config; empty picks the mapping's first class, as transformers documents
            config.architectures = []
        model = _build(lambda: auto.from_config(config), spec, overrides, built)
        processor = _processor_for_type(tf, rest, config)
        label = f"none (random init from AutoConfig.for_model({rest!r}), seed {seed})"
    raw = weights.strip()
    pretrained = not label.startswith("none")
    if raw.lower() not in ("", "none") and building in (OFFLOAD, TP):
        raise UsageError(
            f"--{building} reads the checkpoint's own weights; --weights would replace them.",
            f"drop --weights, or --{building}.",
        )
    if raw.lower() not in ("", "none"):
        path = user_path(raw, "--weights")
        if not path.is_file():
            raise UsageError(
                f"weights file {raw} {not_a_file(path)}.",
                "hf: models take --weights PATH to a state dict, or none.",
            )
        load_state_dict_file(model, path, spec)
        label, pretrained = str(path), True
    model.eval()
    config = model.config
    built_head = class_head(model)
    kind: Task
    if built_head in ("causal-lm", "seq2seq-lm"):
        from hookcli.sources.lm import lm_task

        processor = None
        kind = lm_task(model, built_head)
    elif built_head == "seq-cls" or getattr(model, "main_input_name", "") == "input_ids":
        # (imagegpt classifies images given as colour-cluster ids: token ids, not pixels)
        processor = None
        eos = getattr(config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, list) and eos else eos
        kind = HFText(
            int(getattr(config, "vocab_size", 0) or 1000), eos if isinstance(eos, int) else None
        )
    else:
        kind = HFVision() if built_head == "image-cls" else HFOther()
    preprocess = ImageProcessor(processor) if processor is not None else None
    size = getattr(config, "image_size", None)
    input_size = (size, size) if isinstance(size, int) else (224, 224)
    from hookcli.sources.lm import max_tokens

    return LoadedModel(
        module=model,
        name=spec.removeprefix("hf:"),
        spec=spec,
        kind=kind,
        weights_label=label,
        pretrained=pretrained,
        categories=_labels(config),
        preprocess=preprocess,
        preprocess_label=preprocess.describe() if preprocess is not None else "",
        input_size=input_size,
        notes=notes,
        tokenizer_from=tokenizer_from,
        max_tokens=max_tokens(config),
    )


def _build(make: Any, spec: str, overrides: dict[str, Any], head: str = "") -> Any:
    """make() (a model, a config, a model and its loading info), its failures in one line."""
    tf = transformers_module()
    try:
        with quiet_transformers(tf):
            return make()
    except Exception as exc:
        if not isinstance(exc, TypeError | ValueError) and not _refused_value(exc):
            raise ModelError(
                f"building {spec}({kwargs_text(overrides)}) failed: {one_line(exc)}",
                "this model cannot be built offline as it is.",
            ) from exc
        text = one_line(exc, whole=_refused_value(exc))
        if "Unrecognized configuration class" in text and head:
            raise UsageError(
                f"{spec} has no {head} head in transformers {tf.__version__}.",
                f"choose another with --head ({', '.join(HEADS)}).",
            ) from exc
        what = f"{spec}({kwargs_text(overrides)})" if overrides else spec
        raise UsageError(
            f"cannot build {what}: {text}",
            "check --model-arg values against the model's config fields."
            if overrides
            else "fix the value in the model folder's config.json.",
        ) from exc


def unreadable(exc: BaseException) -> bool:
    """A checkpoint's weights files that cannot be read: missing (a dangling link of an
    interrupted download), corrupt or cut short (safetensors' own error), an index without
    its fields."""
    if isinstance(exc, KeyError):  # (only an index's missing fields: a model's own is its)
        return exc.args[:1] in (("metadata",), ("weight_map",))
    return isinstance(exc, OSError) or type(exc).__name__ == "SafetensorError"


def _refused_value(exc: BaseException) -> bool:
    """A config value transformers' typed configs refuse (huggingface_hub's strict
    dataclasses): the user's input, not the model's failure."""
    return any(c.__name__ == "StrictDataclassError" for c in type(exc).__mro__)


def _saved_class(tf: Any, config: Any, head: str | None, notes: list[str]) -> tuple[Any, str]:
    """The class a checkpoint is built as, and the head it is: --head's Auto class; else the
    class config.json's `architectures` names (one transformers ships, never remote code);
    else the type's own head, said in a note."""
    if head is not None:
        return _auto(tf, head), head
    archs = getattr(config, "architectures", None) or []
    model_type = str(getattr(config, "model_type", ""))
    for name in archs[:1]:
        cls = getattr(tf, str(name), None) if str(name).isidentifier() else None
        if isinstance(cls, type) and issubclass(cls, tf.PreTrainedModel):
            return cls, ""
        notes.append(
            f"config.json names the architecture {name!r}, which transformers "
            f"{tf.__version__} does not ship; built the {model_type} type's own head"
        )
        break
    else:
        notes.append(
            f"config.json names no architecture; built the {model_type} type's own head "
            f"({type_head(model_type)}; --head chooses another)"
        )
    built = type_head(model_type)
    return _auto(tf, built), built


def _pretrained(
    tf: Any,
    where: Any,
    saved: Any,
    spec: str,
    overrides: dict[str, Any],
    *,
    head: str | None,
    notes: list[str],
    building: str = "",
    **found: Any,
) -> nn.Module:
    """The checkpoint at `where` (a folder, or ORG/NAME with `found`'s cache arguments) built
    as _saved_class says, from safetensors, never remote code. Weights the class does not
    take, or parameters the checkpoint does not hold (which would start random), are an error
    naming them. The bare model (--head base) may leave the checkpoint's head out, and says
    so."""
    cls, built = _saved_class(tf, saved, head, notes)
    if building in (META, OFFLOAD):  # the class, built from the config with no weights
        return _without_weights(
            cls, where, saved, spec, overrides=overrides, built=built, notes=notes, found=found,
            meta=building == META,
        )  # fmt: skip
    # (weights of another shape come back in the loading info, named below, not raised)
    load_args = {
        "trust_remote_code": False, "use_safetensors": True, "ignore_mismatched_sizes": True,
        **found,
    }  # fmt: skip
    if building == TP:
        load_args["tp_plan"] = "auto"
        notes.append(tensor_parallel_note(saved, spec))
    model: nn.Module
    try:
        model, info = _build(
            lambda: cls.from_pretrained(where, config=saved, output_loading_info=True, **load_args),
            spec,
            overrides,
            built,
        )
    except ModelError as exc:
        cause = exc.__cause__
        if cause is None or not unreadable(cause):
            raise
        raise UsageError(
            f"{spec}: its weights cannot be read: {one_line(cause)}",
            "write the folder again with save_pretrained (or fetch the model again): its "
            "model*.safetensors files and their index are the weights.",
        ) from cause
    parts = misfits(info)
    if built == "base" and unused_only(info):
        unexpected = sorted(info["unexpected_keys"])
        notes.append(f"--head base: the checkpoint's {few(unexpected, 4)} left out")
        return model
    if not parts:
        return model
    archs = getattr(saved, "architectures", None) or []
    hint = (
        f"build the head it was saved with (drop --head; config.json: {archs[0]}), or --head "
        "base for the model without a head"
        if archs
        else "choose the head it was saved with (--head causal-lm, seq-cls, …), or --head base"
    )
    raise UsageError(
        f"{spec}'s weights do not fit {type(model).__name__}: {'; '.join(parts)}.", hint + "."
    )


def _without_weights(
    cls: Any,
    where: Any,
    saved: Any,
    spec: str,
    *,
    overrides: dict[str, Any],
    built: str,
    notes: list[str],
    found: dict[str, Any],
    meta: bool,
) -> nn.Module:
    """--meta: the checkpoint's class built from its config on the meta device (no weight
    read). --offload: the same with real buffers, each parameter in the dtype from_pretrained
    would load it in, made to read each block's weights from the checkpoint as it runs."""
    make = cls._from_config if hasattr(cls, "_from_config") else cls.from_config
    if meta:
        model: nn.Module = _build(
            lambda: make(saved, dtype=saved_dtype(saved)), spec, overrides, built
        )
        notes.append("--meta: built on the meta device from config.json; no weight read")
        for m in model.modules():  # (hookcli's own model: nothing of the user's changed)
            if callable(getattr(m, "warn_if_padding_and_no_attention_mask", None)):
                # a warning that reads the ids' values (GPT-2 with a pad token): meta has none
                object.__setattr__(m, "warn_if_padding_and_no_attention_mask", _no_padding_warning)
        return model
    folder = Path(where) if Path(str(where)).is_dir() else None
    if folder is None:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(str(where), "config.json", cache_dir=found.get("cache_dir"))
        folder = Path(hit).parent if isinstance(hit, str) else None
    if folder is None:
        raise UsageError(f"{spec}: no checkpoint folder found for --offload.", "give hf:FOLDER.")
    from hookcli.sources.offload import Checkpoint, attach

    checkpoint = Checkpoint(folder, spec)
    dtype = _load_dtype(saved, checkpoint)
    model = _build(lambda: make(saved, dtype=dtype), spec, overrides, built)
    _keep_in_float32(model, dtype)
    off = attach(model, checkpoint)
    notes.append(
        f"--offload: weights read from {folder} unit by unit as the model runs "
        f"({len(off.units)} units: the blocks of the largest layer list, and each other module "
        "owning weights), then freed"
    )
    return model


def _no_padding_warning(*_args: Any, **_kwargs: Any) -> None:
    """transformers' warning of padding without an attention mask, left out on meta."""


def _load_dtype(config: Any, checkpoint: Any) -> torch.dtype:
    """The dtype from_pretrained gives a checkpoint by default. transformers 5 ("auto"): the
    config's, else the index's metadata's, else the first floating-point tensor's (in name
    order); before 5: torch's default (float32)."""
    tf = transformers_module()
    if int(str(tf.__version__).split(".")[0]) < 5:
        return torch.get_default_dtype()
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    value = value or checkpoint.metadata_dtype
    if isinstance(value, str):
        value = getattr(torch, value, None)
    if isinstance(value, torch.dtype):
        return value
    kinds = [checkpoint.entries[k].dtype for k in sorted(checkpoint.first_file_keys)]
    floats = [d for d in kinds if d.is_floating_point and "float8" not in str(d)]
    return floats[0] if floats else (kinds[0] if kinds else torch.float32)


def _keep_in_float32(model: nn.Module, dtype: torch.dtype) -> None:
    """The parameters from_pretrained keeps in float32 whatever the dtype (the model's
    `_keep_in_fp32_modules`, matched as transformers matches them), made float32 here too."""
    plan_of = getattr(model, "_get_dtype_plan", None)
    plan = plan_of(dtype) if callable(plan_of) else {}
    if not plan:
        return
    try:
        from transformers.core_model_loading import build_glob_alternation

        pattern = build_glob_alternation(list(plan))[0]
    except (ImportError, AttributeError, TypeError):
        import re

        pattern = re.compile("|".join(str(k).replace("*", ".*") for k in plan))
    for module_name, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            full = f"{module_name}.{name}" if module_name else name
            if p is not None and pattern.search(full) and p.dtype != torch.float32:
                module._parameters[name] = nn.Parameter(
                    p.to(torch.float32), requires_grad=p.requires_grad
                )


def saved_dtype(config: Any) -> torch.dtype:
    """The dtype a config names (a model built from it for --meta), else float32."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else torch.float32


def unused_only(info: dict[str, Any]) -> bool:
    """Whether the only misfit in from_pretrained's loading info is weights the class has no
    place for (a head, for the bare model): every parameter got its weight."""
    return bool(info.get("unexpected_keys")) and not (
        info.get("missing_keys") or info.get("mismatched_keys")
    )


def misfits(info: dict[str, Any]) -> list[str]:
    """What from_pretrained's loading info says did not fit: parameters the checkpoint
    does not hold (they would start random), weights the class does not take, weights of
    another shape; [] when every weight went where it belongs."""
    missing = sorted(info.get("missing_keys") or ())
    unexpected = sorted(info.get("unexpected_keys") or ())
    mismatched = sorted(
        str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or ()
    )
    return [
        f"{what} {few(keys, 4)}"
        for what, keys in (
            ("missing (would start random)", missing),
            ("not taken", unexpected),
            ("of another shape", mismatched),
        )
        if keys
    ]


def _from_saved(
    tf: Any,
    rest: str,
    path: Path,
    overrides: dict[str, Any],
    *,
    head: str | None = None,
    notes: list[str] | None = None,
    building: str = "",
) -> tuple[nn.Module, Any, str]:
    notes = notes if notes is not None else []
    if not (path / "config.json").is_file():
        raise UsageError(
            f"hf:{rest} is not a saved model folder (no config.json in {path}).",
            "give a folder written by save_pretrained, a model type (hf:vit) or ORG/NAME.",
        )
    check_folder(tf, f"hf:{rest}", path, building)
    config = _build(
        lambda: tf.AutoConfig.from_pretrained(path, trust_remote_code=False, **overrides),
        f"hf:{rest}",
        overrides,
    )
    check_config(config, f"hf:{rest}", building)
    model = _pretrained(
        tf, path, config, f"hf:{rest}", overrides, head=head, notes=notes, building=building
    )
    processor = _saved_processor(tf, path, config, f"hf:{rest}", path)
    return model, processor, f"saved model {path}"


def _saved_processor(
    tf: Any, where: Any, config: Any, spec: str, folder: Path | None, **kw: Any
) -> Any | None:
    """The checkpoint's own image processor (its preprocessor_config.json); without that
    file, the type's default. A file that is there but cannot make a processor, or makes one
    that cannot preprocess an image (a size of -32, a mean of "x"), is refused in one line:
    never replaced by the default without a word."""
    saved = folder is not None and (folder / "preprocessor_config.json").is_file()
    try:
        with quiet_warnings():
            processor = tf.AutoImageProcessor.from_pretrained(where, trust_remote_code=False, **kw)
    except Exception as exc:
        if saved:
            raise UsageError(
                f"{spec}: preprocessor_config.json cannot make an image processor: "
                f"{one_line(exc)}.",
                "fix the file (save_pretrained of the model's image processor writes it), or "
                "remove it for the model type's default preprocessing.",
            ) from exc
        # no preprocessor_config.json: the type's default processor
        return _processor_for_type(tf, str(getattr(config, "model_type", "")), config)
    problem = processor_problem(processor)
    if problem is not None:
        raise UsageError(
            f"{spec}: preprocessor_config.json {problem}.",
            "fix the file (save_pretrained of the model's image processor writes it).",
        )
    return processor


def _from_cache(
    tf: Any,
    repo: str,
    overrides: dict[str, Any],
    *,
    head: str | None = None,
    notes: list[str] | None = None,
    building: str = "",
) -> tuple[nn.Module, Any, str]:
    from hookcli.sources.base import hf_cache_dir

    notes = notes if notes is not None else []
    cache = str(hf_cache_dir())
    try:
        with quiet_transformers(tf):
            config = tf.AutoConfig.from_pretrained(
                repo, local_files_only=True, cache_dir=cache, trust_remote_code=False, **overrides
            )
    except OSError as exc:
        raise UsageError(
            f"hf:{repo} is not in the local Hugging Face cache (expected "
            f"{hf_cache_path(repo)}/<revision>/config.json); hookcli does not download.",
            f"fetch it once with `huggingface-cli download {repo}` (or set HF_HOME), or give "
            "a saved model folder.",
        ) from exc
    except ValueError as exc:
        raise UsageError(f"hf:{repo}: {one_line(exc)}", "give a model transformers knows.") from exc
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, "config.json", cache_dir=cache)
    if isinstance(found, str):  # the snapshot folder: the same checks as a saved folder's
        check_folder(tf, f"hf:{repo}", Path(found).parent, building)
    check_config(config, f"hf:{repo}", building)
    model = _pretrained(
        tf, repo, config, f"hf:{repo}", overrides, head=head, notes=notes, building=building,
        local_files_only=True, cache_dir=cache,
    )  # fmt: skip
    folder = Path(found).parent if isinstance(found, str) else None
    processor = _saved_processor(
        tf, repo, config, f"hf:{repo}", folder, local_files_only=True, cache_dir=cache
    )
    return model, processor, f"hf:{repo} from the local cache"


def _labels(config: Any) -> list[str] | None:
    """The config's id2label, unless it is the placeholder LABEL_0, LABEL_1, …"""
    id2label = getattr(config, "id2label", None) or {}
    names = [str(id2label.get(i, id2label.get(str(i), ""))) for i in range(len(id2label))]
    if not names or all(n == f"LABEL_{i}" for i, n in enumerate(names)):
        return None
    return names


def tensor_parallel_note(config: Any, spec: str) -> str:
    """--tp: the model spread over torchrun's processes by its tensor-parallel plan, or one line
    saying why it cannot be (no process group, no plan, heads that do not divide)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        raise UsageError(
            "--tp spreads the model over torchrun's processes; this is one process.",
            "run under torchrun: torchrun --nproc-per-node 2 -m hookcli … --tp",
        )
    world = dist.get_world_size()
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kind = str(getattr(config, "model_type", "?"))
    if not (
        getattr(text, "base_model_tp_plan", None) or getattr(config, "base_model_tp_plan", None)
    ):
        raise UsageError(
            f"{spec}: transformers has no tensor-parallel plan for {kind} models (its config "
            "names no base_model_tp_plan).",
            "run it without --tp, or shard it with parallelize_module from Python.",
        )
    counts = {
        what: heads
        for field, what in (
            ("num_attention_heads", "attention heads"),
            ("num_key_value_heads", "key/value heads"),
        )
        if isinstance(heads := getattr(text, field, None), int) and heads > 0
    }
    for what, heads in counts.items():
        if heads % world:
            most = min(counts.values())
            fits = [n for n in range(2, most + 1) if all(h % n == 0 for h in counts.values())]
            raise UsageError(
                f"{spec}: its {heads} {what} do not divide over {world} processes (each takes "
                "whole heads).",
                f"run with --nproc-per-node {' or '.join(map(str, fits[:4]))}."
                if fits
                else "run it without --tp.",
            )
    return (
        f"--tp: spread over {world} processes by {kind}'s tensor-parallel plan; every row is "
        "the whole model's, merged over the processes, unless its note says otherwise"
    )
