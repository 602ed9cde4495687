"""`hookcli calib`: per input channel activation ranges of every Linear-like layer and routed
MoE expert over a text file, a folder or given inputs, written as safetensors for quantization
tools."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from hookcli.cli import params as opt
from hookcli.cli.console import claim, emit, err, handled, output_format, rendered, status
from hookcli.options import DEFAULTS
from hookcli.render.writers import Kind


def calib(
    ctx: typer.Context,
    model: opt.ModelArg = None,
    inputs: opt.InputsArg = None,
    text: opt.TextOpt = None,
    text_file: opt.TextFileOpt = None,
    chat: opt.ChatOpt = DEFAULTS.inputs.chat,
    padding_side: opt.PaddingSideOpt = None,
    tokenizer: opt.TokenizerOpt = None,
    input_spec: opt.InputSpecOpt = None,
    layer: opt.LayerOpt = None,
    type_: opt.TypeOpt = None,
    batch_size: Annotated[
        int,
        typer.Option(
            "--batch-size", help="Sequences (or images) per pass; the passes merge exactly."
        ),
    ] = DEFAULTS.calib.batch_size,
    alpha: Annotated[
        float,
        typer.Option(
            "--alpha",
            help="SmoothQuant's migration strength for the before/after outlier ratios (0-1).",
        ),
    ] = DEFAULTS.calib.alpha,
    head: opt.HeadOpt = None,
    weights: opt.WeightsOpt = DEFAULTS.model.weights,
    seed: opt.SeedOpt = DEFAULTS.model.seed,
    device: opt.DeviceOpt = DEFAULTS.model.device,
    model_arg: opt.ModelArgOpt = None,
    fmt: opt.FormatOpt = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            metavar="FILE.safetensors|FILE.imatrix",
            help="Write the scales: NAME (max|x| per input channel: SmoothQuant's act_scales), "
            "NAME.min_val and NAME.max_val (PerChannelMinMaxObserver's), NAME.histogram; or, "
            "to FILE.imatrix, llama.cpp's importance matrix (Σx² per input channel of each "
            "weight, by GGUF name) for llama-quantize --imatrix.",
        ),
    ] = None,
    force: opt.ForceOpt = False,
    config: opt.ConfigOpt = None,
    no_config: opt.NoConfigOpt = False,
) -> None:
    """Calibrate activations for quantization: the input of every Linear-like layer (Linear
    and its subclasses, convolutions, Conv1D) and of each routed expert of a fused MoE block,
    per channel over all tokens (padding never counted): max|x|, min, max and a histogram of
    |x|, and each layer's outlier ratio before and after SmoothQuant's smoothing. A selected
    layer with no numbers is listed as not calibrated, with why.

    Example: hookcli calib hf:./tiny-llama --text-file calib.txt -o act_scales.safetensors
    (or -o model.imatrix for llama-quantize --imatrix)
    """
    with handled():
        p, used = opt.configured(ctx)
        if used:
            err(f"config: {used}")
        reads = opt.reads(p, used)
        out = p.get("output")
        imatrix = out is not None and str(out).lower().endswith((".imatrix", ".gguf"))
        suffix = Path(str(out)).suffix.lower() if imatrix else ".safetensors"
        dest = claim(out, "-o", suffix=suffix, stdout_ok=False, reads=reads)
        if imatrix:  # before any work: what an imatrix needs
            from hookcli.commands.imatrix import check_imatrix_model

            check_imatrix_model(str(p.get("model") or ""))
        form = output_format(p["fmt"], None, kind=Kind.calib)
        from hookcli.commands.calib import calib_report, calib_tensors
        from hookcli.options import CalibOptions, pick

        model_opts = opt.model_options(p, "calib")
        with status(f"calibrating {model_opts.model}…"):
            report = calib_report(
                model_opts, opt.selection(p), opt.input_options(p), pick(CalibOptions, p)
            )
        emit(rendered(report, form, None), None)
        if dest is not None and imatrix:
            from hookcli.commands.imatrix import imatrix_bytes
            from hookcli.io.output import write_bytes

            dataset = str(p.get("text_file") or report.input.description)  # llama.cpp: the file
            data, written, unnamed = imatrix_bytes(report, dataset)
            write_bytes(dest, data)
            left = (
                f"; {len(unnamed)} calibrated layers have no GGUF name, not in it "
                f"(first {unnamed[0]})"
                if unnamed
                else ""
            )
            err(f"wrote {dest.label} ({written} weights, llama.cpp's imatrix{left})")
        elif dest is not None:
            from hookcli.io.saving import TensorSaver

            saver = TensorSaver(
                dest,
                {
                    "format": "hookcli calib",
                    "model": report.model.spec,
                    "input": report.input.description,
                    "alpha": f"{report.alpha:g}",
                    # the selected layers with no numbers, each with why (JSON)
                    "skipped": json.dumps(
                        [
                            {"layer": k.name, "type": k.type, "reason": k.reason}
                            for k in report.skipped
                        ]
                    ),
                },
            )
            try:
                for key, tensor in calib_tensors(report).items():
                    saver.add(key, tensor)
            except BaseException:
                saver.discard()  # never a half-written file
                raise
            saver.close()
            gone = f"; {len(report.skipped)} not calibrated, listed" if report.skipped else ""
            err(f"wrote {dest.label} ({len(report.layers)} layers{gone})")
