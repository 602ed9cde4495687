"""`hookcli lens`: the logit lens. Each block's output goes through the model's own final norm
and unembedding (the very modules the model runs, found in its tree; --norm, --unembed
override), and the top-k tokens of every position of every block are reported. The last
block's lens is the model's own next-token distribution: what the model applies around its
unembedding — a scale of what it reads (T5's d_model**-0.5 of tied embeddings), a bias, a
soft cap (Gemma's final_logit_softcapping) or a scale of the logits — is found from the model
(read off the unembedding's own input and output in the pass, named from its config) and applied
to every block alike, and said; what cannot be told is said, with by how much the last block's
lens differs from the logits.

The lens is read inside the blocks' forward hooks, under no_grad, as each block returns:
only the top-k of each position is kept, never a (tokens x vocab) tensor per block.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hookcli._version import __version__
from hookcli.engine.measure import statistics
from hookcli.errors import UsageError, one_line
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


def _matrix(m: nn.Module) -> torch.Tensor | None:
    weight = getattr(m, "weight", None)
    return weight if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def check_unembed(model: nn.Module, name: str, unembed: nn.Module) -> None:
    """--unembed names a module that maps the hidden width to the vocabulary, before any pass:
    a Linear-like (vocab, hidden) weight, as wide as the model's vocabulary where its config
    says it; an Embedding (ids to vectors) or anything else is refused in one line."""
    where = f"--unembed {name}"
    hint = "name the model's output head with --unembed (lm_head; `hookcli layers MODEL`)."
    if isinstance(unembed, nn.Embedding):
        raise UsageError(
            f"{where} is an Embedding (token ids to vectors), not an unembedding (vectors to "
            "the vocabulary).",
            hint,
        )
    weight = _matrix(unembed)
    if weight is None:
        raise UsageError(
            f"{where} ({type(unembed).__name__}) has no (vocabulary, hidden) weight.", hint
        )
    config = getattr(model, "config", None)
    get = getattr(config, "get_text_config", None)
    try:
        text = get() if callable(get) else config
    except Exception:  # a config whose text config needs more than it has
        text = config
    vocab = getattr(text, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0 and weight.shape[0] != vocab:
        raise UsageError(
            f"{where} maps to {weight.shape[0]} outputs; the model's vocabulary has {vocab}.",
            hint,
        )


def check_norm(name: str, norm: nn.Module, unembed: nn.Module) -> None:
    """--norm names a module that keeps the hidden width the unembedding reads: not a Linear,
    an Embedding or another matrix, and a per-channel weight (if any) of that width."""
    weight = getattr(norm, "weight", None)
    width = None if (m := _matrix(unembed)) is None else int(m.shape[-1])
    fits = not isinstance(norm, nn.Linear | nn.Embedding) and (
        not isinstance(weight, torch.Tensor)
        or (weight.dim() == 1 and (width is None or weight.shape[0] == width))
    )
    hint = "name the final norm (model.norm; `hookcli layers MODEL`), or --norm none."
    if not fits:
        shape = "x".join(map(str, weight.shape)) if isinstance(weight, torch.Tensor) else "?"
        raise UsageError(
            f"--norm {name} ({type(norm).__name__}, weight {shape}) is not a norm of the hidden "
            f"width{f' {width}' if width else ''} the unembedding reads.",
            hint,
        )
    why = _not_a_norm(norm, width, _matrix(unembed))
    if why is not None:
        raise UsageError(f"--norm {name} ({type(norm).__name__}) {why}.", hint)


def _not_a_norm(norm: nn.Module, width: int | None, matrix: torch.Tensor | None) -> str | None:
    """Why `norm` cannot be called as the lens calls it, norm(hidden) -> hidden of the same
    shape (a block, an attention or a rotary embedding needs more), tried once on one zero
    position before the pass; None when it can, or when a trial would change it (a batch
    norm in training mode updates its running statistics)."""
    tracks = any(m.training and getattr(m, "track_running_stats", False) for m in norm.modules())
    # weights elsewhere (offloaded to meta and brought in by a hook, a shard of a DTensor):
    # no trial on a plain tensor here; the pass itself tells
    held = [*norm.parameters(), *norm.buffers()]
    elsewhere = any(t.is_meta or type(t) not in (torch.Tensor, nn.Parameter) for t in held)
    hooked = any(m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in norm.modules())
    if width is None or matrix is None or tracks or elsewhere or hooked:
        return None
    first = next(norm.parameters(), matrix)
    x = torch.zeros(1, 1, width, dtype=first.dtype, device=first.device)
    try:
        with torch.no_grad():
            out = norm(x)
    except Exception as exc:
        return f"cannot be called on the hidden states alone ({one_line(exc)})"
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(x.shape):
        got = (
            type(out).__name__
            if not isinstance(out, torch.Tensor)
            else "x".join(map(str, out.shape))
        )
        return f"returns {got} for hidden states of 1x1x{width}, not hidden states of that shape"
    return None


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
    (the norm that runs after the last block), then norm, unembedding and top-k per block.
    (--tp: every rank runs it on the model spread over them.)"""
    from hookcli.commands import shards

    with shards.spread_model(model):
        return _lens_report(model, inputs, options)


def _lens_report(model: ModelOptions, inputs: InputOptions, options: LensOptions) -> LensReport:
    from hookcli.commands.inspect import input_info, model_info
    from hookcli.engine.hooks import HookSession
    from hookcli.engine.passes import hooked_pass
    from hookcli.engine.prepare import prepare
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
    if options.unembed is not None:  # (the model's own output embeddings are its head)
        check_unembed(module, unembed_name, unembed)
    if options.norm is not None and options.norm.strip().lower() != "none":
        check_norm(options.norm, _module(module, options.norm, "--norm"), unembed)
    model_input = prepared.model_input
    assert model_input is not None
    seq2seq = isinstance(loaded.kind, Seq2SeqLM)
    mask = model_input.token_mask
    if seq2seq:  # the decoder's positions: those its own input holds (the targets' padding out)
        fed = model_input.kwargs.get("decoder_attention_mask")
        mask = fed.bool() if isinstance(fed, torch.Tensor) else None
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
            if name in candidates or h is None or name in kept:
                return
            if h.dim() == 3 and (width is None or h.shape[-1] == width):
                kept[name] = h.detach()  # (batch, tokens, hidden): what the unembedding reads

        return hook

    head_io: list[torch.Tensor | None] = []  # the unembedding's first call: input, output

    def at_head(_m: nn.Module, args: Any, output: Any) -> None:
        order.append(UNEMBED)
        if not head_io:
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            y = _first_tensor(output)
            head_io.extend([None if x is None else x.detach(), None if y is None else y.detach()])

    watched = [*blocks, *candidates.items()]
    handles = [m.register_forward_hook(keep(n)) for n, m in watched]
    handles.append(unembed.register_forward_hook(at_head))
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
    logits = logits.detach() if isinstance(logits, torch.Tensor) else None
    x, z = head_io if head_io else (None, None)
    last_h = kept.get(names[-1])
    with torch.no_grad():
        normed = None if last_h is None else (norm(last_h) if norm is not None else last_h)
    around = around_unembedding(
        module, normed=normed, x=x, z=z, logits=logits, unembed=unembed_name
    )
    tops, last = _read(
        kept, names=names, norm=norm, unembed=unembed, topk=options.topk, around=around
    )
    notes = list(prepared.notes)
    if norm is None:
        notes.append(
            "no norm runs after the last block: each block's output goes to the unembedding "
            "as it is (--norm names one)"
        )
    diff = None
    if last is not None and logits is not None and logits.shape == last.shape:
        diff, scale = _largest_difference(last, logits)
        if diff > 1e-5 * max(scale, 1.0):
            why = around.unknown or [
                f"--norm/--unembed/--blocks read other modules than the model's path from its "
                f"last block to its logits ({norm_name or 'no norm'}, {unembed_name})"
            ]
            notes.append(
                f"the last block's lens differs from the model's logits by up to {diff:.3g}: "
                + "; ".join(why)
            )
    elif logits is None or last is None:
        notes.append(
            "the last block's lens could not be checked against the model's logits (the "
            "output holds no logits of its shape)"
        )
    ids = model_input.kwargs.get(loaded.kind.ids_key)
    return LensReport(
        model=model_info(loaded, seed=prepared.seed),
        input=input_info(model_input),
        device=str(prepared.device),
        blocks=[n for n in names if n in tops],
        norm=norm_name or None,
        unembed=unembed_name,
        applied=around.said,
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


# ---------------------------------------------------------------- around the unembedding

Apply = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class Around:
    """What the model applies around its unembedding, as found: `pre` scales what the
    unembedding reads (T5's d_model**-0.5), `post` maps its output to the logits in order (a
    bias, a soft cap, a scale); `said` names each in words, `unknown` what could not be told."""

    pre: Apply | None = None
    post: list[Apply] = field(default_factory=list)
    said: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)

    def before(self, h: torch.Tensor) -> torch.Tensor:
        return h if self.pre is None else self.pre(h)

    def after(self, z: torch.Tensor) -> torch.Tensor:
        for f in self.post:
            z = f(z)
        return z


def around_unembedding(
    model: nn.Module,
    *,
    normed: torch.Tensor | None,
    x: torch.Tensor | None,
    z: torch.Tensor | None,
    logits: torch.Tensor | None,
    unembed: str = "the unembedding",
) -> Around:
    """What the model does between its final norm's output (`normed`, of the last block) and
    its `logits`, read off the unembedding's own input `x` and output `z` in the same pass:
    a scale of what it reads, and of its output the bias (BART's final_logits_bias) and soft
    cap (config.final_logit_softcapping) the model declares, and a scale; each named from the
    model's config where a number of it is the one found, and kept only where it reproduces
    the model's own tensor."""
    configs = _configs(model)
    out = Around()
    with torch.no_grad():
        if normed is not None and x is not None and not _close(normed, x):
            found = _scale(normed, x, configs) if normed.shape == x.shape else None
            if found is None:
                out.unknown.append(
                    f"{unembed} reads neither the final norm's output of the last block nor "
                    "a scale of it"
                )
            else:
                out.pre = found[0]
                out.said.append(f"{found[1]} before {unembed}")
        declared = _declared(model, configs, z)
        if z is None or logits is None or z.shape != logits.shape:
            for f, words in declared:
                out.post.append(f)
                out.said.append(f"{words} after {unembed}")
            if not declared and logits is not None:
                out.unknown.append(f"the model's logits are not {unembed}'s output as it is")
            return out
        chosen = _reproducing(declared, z, logits, configs)
        if chosen is None:
            chosen = declared
            out.unknown.append(
                f"the model's logits are neither {unembed}'s output nor a bias, soft cap or "
                "scale of it: hookcli cannot tell what the model applies after it"
            )
        for f, words in chosen:
            out.post.append(f)
            out.said.append(f"{words} after {unembed}")
    return out


def _reproducing(
    declared: list[tuple[Apply, str]],
    z: torch.Tensor,
    logits: torch.Tensor,
    configs: Sequence[Any],
) -> list[tuple[Apply, str]] | None:
    """The maps from the unembedding's output to the logits that reproduce them: what the
    model declares (then nothing, should it not apply them), each followed by a scale where
    one is needed; None when none does."""
    for chosen in [declared, []] if declared else [[]]:
        y = z
        for f, _ in chosen:
            y = f(y)
        if _close(y, logits):
            return chosen
        scaled = _scale(y, logits, configs)
        if scaled is not None:
            return [*chosen, scaled]
    return None


def _configs(model: nn.Module) -> list[Any]:
    """The model's config and, for a multimodal model, its text model's."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    found = [config]
    get = getattr(config, "get_text_config", None)
    try:
        text = get() if callable(get) else None
    except Exception:  # a config whose text config needs more than it has
        text = None
    if text is not None and text is not config:
        found.append(text)
    return found


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None


def _declared(
    model: nn.Module, configs: Sequence[Any], z: torch.Tensor | None
) -> list[tuple[Apply, str]]:
    """What the model declares it applies to its unembedding's output: a final logits bias
    (BART, Marian, Pegasus: a buffer of the model; applied when not all zero) and a soft cap
    (Gemma 2 and 3: config.final_logit_softcapping), in the order the model applies them."""
    found: list[tuple[Apply, str]] = []
    bias = getattr(model, "final_logits_bias", None)
    if (
        isinstance(bias, torch.Tensor)
        and bias.dim() >= 1
        and (z is None or bias.shape[-1] == z.shape[-1])
        and bool(bias.detach().abs().max() > 0)
    ):
        b = bias.detach()
        found.append((lambda t: t + b.to(t.device), "+ final_logits_bias"))
    for config in configs:
        cap = _number(getattr(config, "final_logit_softcapping", None))
        if cap is not None:
            c = config.final_logit_softcapping
            words = f"soft cap {c:g}*tanh(x/{c:g}) (config.final_logit_softcapping)"
            found.append((_capped(c), words))
            break
    return found


_SCALE_NAME = re.compile(r"logit|scal|multiplier")
# numbers of other parts of the model, never the logits' scale (Gemma's query_pre_attn_scalar,
# attn_logit_softcapping; rope scaling; a router's)
_NOT_LOGITS = re.compile(r"attn|attention|query|rope|rotary|router|embedding_multiplier")


def _scale(a: torch.Tensor, b: torch.Tensor, configs: Sequence[Any]) -> tuple[Apply, str] | None:
    """A scalar s with b = s * a, where there is one: named after the config number it is
    (x config.logit_scale, / config.logits_scaling, x config.d_model**-0.5) and applied as
    the model does, else the measured s; None when no scalar reproduces b."""
    if a.shape != b.shape:
        return None
    a, b = _sampled(a, b.to(a.device))
    a64, b64 = a.double(), b.double()
    aa = float((a64 * a64).sum())
    if not aa > 0:
        return None
    s = float((a64 * b64).sum()) / aa
    if not math.isfinite(s) or s == 0:
        return None
    for words, apply in _named_scales(configs, s):
        if _close(apply(a), b):
            return apply, words
    if _close(a * s, b):
        return _times(s), f"× {s:.6g} (measured: no config number of the model is it)"
    return None


def _named_scales(configs: Sequence[Any], s: float) -> list[tuple[str, Apply]]:
    """The config numbers that equal the scale s found, as the model would apply them."""
    out: list[tuple[str, Apply]] = []
    for config in configs:
        items = sorted(vars(config).items(), key=lambda kv: "logit" not in kv[0])
        for name, raw in items:
            v = _number(raw)
            if v is None:
                continue
            if _SCALE_NAME.search(name) and not _NOT_LOGITS.search(name):
                if math.isclose(v, s, rel_tol=1e-3):
                    out.append((f"× config.{name} ({v:g})", _times(raw)))
                if math.isclose(1 / v, s, rel_tol=1e-3):
                    out.append((f"÷ config.{name} ({v:g})", _divided(raw)))
            if name in ("d_model", "hidden_size") and math.isclose(v**-0.5, s, rel_tol=1e-3):
                flag = (
                    "config.scale_decoder_outputs"
                    if hasattr(config, "scale_decoder_outputs")
                    else "config.tie_word_embeddings"
                )
                out.append(
                    (
                        f"× {name}**-0.5 ({v**-0.5:.4g}: T5's scale of its tied embeddings, "
                        f"{flag})",
                        _times(raw**-0.5),
                    )
                )
    return out


def _times(r: Any) -> Apply:
    return lambda t: t * r


def _divided(r: Any) -> Apply:
    return lambda t: t / r


def _capped(c: Any) -> Apply:
    return lambda t: torch.tanh(t / c) * c  # as the model: / cap, tanh, * cap


ROWS_CHUNK = 64  # rows of (…, vocab) logits compared in float64 at once
SAMPLED_ROWS = 16  # rows a transform around the unembedding is found on


def _largest_difference(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """max |a - b| and max |b| over (…, vocab) tensors of one shape, in float64, a chunk of
    rows at a time (a large vocabulary's logits are never copied whole)."""
    a2, b2 = a.reshape(-1, a.shape[-1]), b.to(a.device).reshape(-1, b.shape[-1])
    diff = scale = 0.0
    for i in range(0, a2.shape[0], ROWS_CHUNK):
        x, y = a2[i : i + ROWS_CHUNK].double(), b2[i : i + ROWS_CHUNK].double()
        diff = max(diff, float((x - y).abs().max()))
        scale = max(scale, float(y.abs().max()))
    return diff, scale


def _sampled(*ts: torch.Tensor) -> list[torch.Tensor]:
    """The same evenly spaced rows (at most SAMPLED_ROWS) of tensors of one shape (…, vocab):
    what finding an elementwise transform needs, without float64 copies of whole logits."""
    rows = ts[0].reshape(-1, ts[0].shape[-1]).shape[0] if ts[0].dim() else 0
    if ts[0].dim() < 2 or rows <= SAMPLED_ROWS:
        return list(ts)
    pick = torch.linspace(0, rows - 1, SAMPLED_ROWS).round().long()
    return [t.reshape(-1, t.shape[-1]).index_select(0, pick.to(t.device)) for t in ts]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """a reproduces b: equal up to the rounding of b's precision (on sampled rows)."""
    if a.shape != b.shape:
        return False
    a, b = _sampled(a, b.to(a.device))
    a64, b64 = a.double(), b.double()
    scale = float(b64.abs().max()) if b64.numel() else 0.0
    eps = torch.finfo(b.dtype).eps if b.is_floating_point() else 0.0
    tol = max(1e-5, 4 * eps) * max(scale, 1e-30)
    return bool((a64 - b64).abs().max() <= tol) if b64.numel() else True


def _read(
    kept: dict[str, torch.Tensor],
    *,
    names: Sequence[str],
    norm: Any,
    unembed: nn.Module,
    topk: int,
    around: Around,
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
    """Each kept block output through norm and unembedding, and what the model applies
    around the unembedding: its top-k probabilities and ids; and the last block's logits."""
    tops: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    last = None
    with torch.no_grad():
        for name in names:
            h = kept.get(name)
            if h is None:
                continue
            logits = around.after(unembed(around.before(norm(h) if norm is not None else h)))
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
    out: list[list[str | None]] = []
    sequence = getattr(labels, "sequence", None)  # TokenLabels: a split character shown once
    for b, row in enumerate(ids.cpu().tolist()):
        if callable(sequence):
            out.append(list(sequence([i for p, i in enumerate(row) if real is None or real[b][p]])))
            continue
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
    """Each block's top tokens at each real position, the position counted in its own text (a
    left-padded sequence's first real token is position 0)."""
    real = None if mask is None else mask.cpu().tolist()
    cells = []
    for name in names:
        if name not in tops:
            continue
        values, indices = (t.cpu().tolist() for t in tops[name])
        for b, (vrow, irow) in enumerate(zip(values, indices, strict=True)):
            own = 0  # the position in the sequence's own text
            for p, (v, i) in enumerate(zip(vrow, irow, strict=True)):
                if real is not None and not real[b][p]:
                    continue
                top = [
                    LensToken(j, labels[j] if labels is not None and j < len(labels) else None, pv)
                    for pv, j in zip(v, i, strict=True)
                ]
                cells.append(LensCell(name, b, own, top))
                own += 1
    return cells
