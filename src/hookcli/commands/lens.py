"""`hookcli lens`: the logit lens. Each block's output goes through the model's own final norm
and unembedding (the very modules the model runs, found in its tree; --norm, --unembed
override), and the top-k tokens of every position of every block are reported. The last
block's lens is the model's own next-token distribution; where the model changes its logits
after the unembedding (a soft cap, a scale), the report says by how much they differ.

The lens is read inside the blocks' forward hooks, under no_grad, as each block returns:
only the top-k of each position is kept, never a (tokens x vocab) tensor per block.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from hookcli._version import __version__
from hookcli.commands.measured import statistics
from hookcli.errors import UsageError
from hookcli.options import InputOptions, LensOptions, ModelOptions
from hookcli.records import LensCell, LensReport, LensToken


def find_blocks(model: nn.Module, pattern: str | None = None) -> list[tuple[str, nn.Module]]:
    """The model's blocks: those --blocks names, else the shallowest ModuleList of modules (a
    multimodal or seq2seq model's: its text decoder's), in order."""
    named = dict(model.named_modules())
    if pattern is not None:
        picked = [(n, m) for n, m in named.items() if n and fnmatch.fnmatchcase(n, pattern)]
        # a glob's * reaches inside the blocks too (model.layers.0.mlp): the outermost only
        matched = {n for n, _ in picked}
        picked = [(n, m) for n, m in picked if not any(a in matched for a in _ancestors(n))]
        if not picked:
            raise UsageError(
                f"--blocks {pattern!r} matches no module.",
                "give a glob on dotted names (model.layers.*); `hookcli layers MODEL` lists them.",
            )
        return picked
    lists = [
        (name, m)
        for name, m in named.items()
        if isinstance(m, nn.ModuleList)
        and len(m) > 0
        and not any(isinstance(c, nn.ModuleList | nn.Linear | nn.Embedding) for c in m)
    ]  # (a hybrid model's blocks are of several classes: attention, mamba, …)
    if not lists:
        raise UsageError(
            "no blocks found: the model holds no ModuleList of blocks.",
            "name them with --blocks GLOB (model.layers.*).",
        )
    within = _decoder_path(model)  # a multimodal or encoder-decoder model: its text decoder's
    inside = [e for e in lists if within is None or (e[0] + ".").startswith(within + ".")]
    pool = inside or lists
    if within is None:
        decoder = [entry for entry in lists if "decoder" in entry[0].split(".")]
        pool = decoder or lists
    depth = min(n.count(".") for n, _ in pool)
    name, blocks = max(((n, m) for n, m in pool if n.count(".") == depth), key=lambda e: len(e[1]))
    return [(f"{name}.{i}", b) for i, b in enumerate(blocks)]


def _ancestors(name: str) -> list[str]:
    """model.layers.0.mlp → model, model.layers, model.layers.0."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _decoder_path(model: nn.Module) -> str | None:
    """The dotted name of the model's text decoder (transformers' get_decoder()), when it is a
    part of the model and not the model itself."""
    get = getattr(model, "get_decoder", None)
    try:
        decoder = get() if callable(get) else None
    except Exception:  # a model whose get_decoder needs more than it has
        return None
    if not isinstance(decoder, nn.Module) or decoder is model:
        return None
    return next((n for n, m in model.named_modules() if m is decoder and n), None)


def find_norm(model: nn.Module, blocks: Sequence[str], asked: str | None) -> tuple[str, Any]:
    """The final norm: --norm, else the last normalisation module registered after the blocks
    beside their list (model.norm, transformer.ln_f, decoder.final_layer_norm)."""
    if asked is not None:
        if asked.strip().lower() == "none":
            return "", None
        return asked, _module(model, asked, "--norm")
    parent = blocks[0].rsplit(".", 2)[0] if blocks[0].count(".") >= 2 else ""
    last = blocks[-1]
    seen_last = False
    found: tuple[str, Any] = ("", None)
    for name, m in model.named_modules():
        if name == last:
            seen_last = True
            continue
        if not seen_last or name.startswith(last + "."):
            continue
        inside = name.rsplit(".", 1)[0] if "." in name else ""
        if inside == parent and "norm" in type(m).__name__.lower():
            found = (name, m)
    return found


def find_unembed(model: nn.Module, asked: str | None) -> tuple[str, nn.Module]:
    """The unembedding: --unembed, else the model's output embeddings (lm_head)."""
    if asked is not None:
        return asked, _module(model, asked, "--unembed")
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if isinstance(head, nn.Module):
        for name, m in model.named_modules():
            if m is head:
                return name, m
    raise UsageError(
        "no unembedding found: the model has no output embeddings (lm_head).",
        "name it with --unembed MODULE.",
    )


def _module(model: nn.Module, name: str, option: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError as exc:
        raise UsageError(
            f"{option} {name!r} is not a module of the model.",
            "`hookcli layers MODEL` lists the modules.",
        ) from exc


def _first_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, tuple | list) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def lens_report(model: ModelOptions, inputs: InputOptions, options: LensOptions) -> LensReport:
    """The logit lens of every block over the input's tokens: the blocks' outputs kept during
    the pass (batch x tokens x hidden each), the final norm told by the order of the calls
    (the norm that runs after the last block), then norm, unembedding and top-k per block."""
    from hookcli.commands.inspect import input_info, model_info
    from hookcli.engine.hooks import HookSession
    from hookcli.engine.passes import hooked_pass, prepare
    from hookcli.sources.hfbase import logits_of
    from hookcli.sources.lm import CausalLM, Seq2SeqLM

    if options.topk < 1:
        raise UsageError(f"--topk must be 1 or more, got {options.topk}.", "use --topk 5.")
    prepared = prepare(model, None, inputs)
    loaded = prepared.loaded
    if not isinstance(loaded.kind, CausalLM):
        raise UsageError(
            f"{loaded.spec} is not a language model ({loaded.task}): the lens reads tokens.",
            "give a causal or seq2seq LM (hf:PATH of one, hf:gpt2, …).",
        )
    module = loaded.module
    blocks = find_blocks(module, options.blocks)
    names = [n for n, _ in blocks]
    unembed_name, unembed = find_unembed(module, options.unembed)
    model_input = prepared.model_input
    assert model_input is not None
    seq2seq = isinstance(loaded.kind, Seq2SeqLM)
    mask = None if seq2seq else model_input.token_mask  # the decoder's positions: unpadded
    kept: dict[str, torch.Tensor] = {}
    order: list[str] = []  # blocks and norm candidates, in the order they returned
    asked_norm = options.norm is not None
    weight = getattr(unembed, "weight", None)  # (vocab, hidden): the width it reads
    width = None
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        width = int(weight.shape[-1])
    candidates = {} if asked_norm else norm_candidates(module, names)

    def keep(name: str) -> Any:
        def hook(_m: nn.Module, _args: Any, output: Any) -> None:
            order.append(name)
            h = _first_tensor(output)
            if name in candidates or name == UNEMBED or h is None or name in kept:
                return
            if h.dim() == 3 and (width is None or h.shape[-1] == width):
                kept[name] = h.detach()  # (batch, tokens, hidden): what the unembedding reads

        return hook

    watched = [*blocks, *candidates.items(), (UNEMBED, unembed)]
    handles = [m.register_forward_hook(keep(n)) for n, m in watched]
    session = HookSession([], statistics())
    try:
        with hooked_pass(prepared, session) as result:
            logits = logits_of(result.output)
    finally:
        for h in handles:
            h.remove()
    if not kept:
        raise UsageError(
            "no block returned a (batch, tokens, hidden) output the unembedding "
            f"({unembed_name}) reads.",
            "name the blocks with --blocks GLOB (model.layers.*).",
        )
    if asked_norm:
        norm_name, norm = find_norm(module, names, options.norm)
    else:
        norm_name = final_norm(order, names, candidates)
        norm = candidates.get(norm_name) if norm_name else None
    tops, last = _read(kept, names, norm, unembed, options.topk)
    notes = list(prepared.notes)
    if norm is None:
        notes.append(
            "no norm runs after the last block: each block's output goes to the unembedding "
            "as it is (--norm names one)"
        )
    diff = None
    if last is not None and isinstance(logits, torch.Tensor) and logits.shape == last.shape:
        diff = float((last.double() - logits.detach().double()).abs().max())
        scale = float(logits.detach().double().abs().max())
        if diff > 1e-5 * max(scale, 1.0):
            notes.append(
                f"the last block's lens differs from the model's logits by up to {diff:.3g}: the "
                "model changes its logits after the unembedding (a scale or a soft cap), or "
                "--norm/--unembed name other modules"
            )
    ids = model_input.kwargs.get(loaded.kind.ids_key)
    return LensReport(
        model=model_info(loaded, seed=prepared.seed),
        input=input_info(model_input),
        device=str(prepared.device),
        blocks=[n for n in names if n in tops],
        norm=norm_name or None,
        unembed=unembed_name,
        lens=_cells(tops, names, loaded.categories, mask),
        tokens=_position_tokens(ids, mask, loaded.categories),
        last_vs_logits=diff,
        notes=notes,
        hookcli_version=__version__,
    )


def norm_candidates(model: nn.Module, blocks: Sequence[str]) -> dict[str, nn.Module]:
    """Normalisation modules outside the blocks: one of them may be the final norm."""
    inside = tuple(b + "." for b in blocks)
    return {
        n: m
        for n, m in model.named_modules()
        if n and "norm" in type(m).__name__.lower() and n not in blocks and not n.startswith(inside)
    }


UNEMBED = "(unembedding)"  # the unembedding's place in the order of the calls


def final_norm(order: Sequence[str], blocks: Sequence[str], candidates: Any) -> str:
    """The norm that ran last between the last block's return and the unembedding ("" when
    none did): BART's layernorm_embedding is registered after its layers but runs before
    them; with blocks inside the layers (--blocks model.layers.*.self_attn), the layers' own
    norms that run after the last of them are not the final one."""
    last = max((i for i, n in enumerate(order) if n == blocks[-1]), default=None)
    if last is None:
        return ""
    after = order[last + 1 :]
    end = after.index(UNEMBED) if UNEMBED in after else len(after)
    between = [n for n in after[:end] if n in candidates]
    return between[-1] if between else ""


def _read(
    kept: dict[str, torch.Tensor],
    names: Sequence[str],
    norm: Any,
    unembed: nn.Module,
    topk: int,
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """Each kept block output through norm and unembedding: its top-k probabilities and ids;
    and the last block's logits."""
    tops: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    last = None
    with torch.no_grad():
        for name in names:
            h = kept.get(name)
            if h is None:
                continue
            logits = unembed(norm(h) if norm is not None else h)
            if name == names[-1]:
                last = logits
            probs = torch.softmax(logits.double(), dim=-1)
            values, ids = probs.topk(min(topk, probs.shape[-1]), dim=-1)
            tops[name] = (values, ids)
    return tops, last


def _position_tokens(
    ids: Any, mask: torch.Tensor | None, labels: Sequence[str] | None
) -> list[list[str | None]] | None:
    """Per sequence, the token at each position the lens read (padding left out)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return None
    real = None if mask is None else mask.cpu().tolist()
    out = []
    for b, row in enumerate(ids.cpu().tolist()):
        out.append(
            [
                labels[i] if labels is not None and 0 <= i < len(labels) else None
                for p, i in enumerate(row)
                if real is None or real[b][p]
            ]
        )
    return out


def _cells(
    tops: dict[str, tuple[torch.Tensor, torch.Tensor]],
    names: Sequence[str],
    labels: Sequence[str] | None,
    mask: torch.Tensor | None,
) -> list[LensCell]:
    real = None if mask is None else mask.cpu().tolist()
    cells = []
    for name in names:
        if name not in tops:
            continue
        values, indices = (t.cpu().tolist() for t in tops[name])
        for b, (vrow, irow) in enumerate(zip(values, indices, strict=True)):
            for p, (v, i) in enumerate(zip(vrow, irow, strict=True)):
                if real is not None and not real[b][p]:
                    continue
                top = [
                    LensToken(j, labels[j] if labels is not None and j < len(labels) else None, pv)
                    for pv, j in zip(v, i, strict=True)
                ]
                cells.append(LensCell(name, b, p, top))
    return cells
