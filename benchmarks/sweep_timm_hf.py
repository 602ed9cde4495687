"""Run hookcli offline on timm and Hugging Face models; write docs/models_timm_hf.md.

- timm: the smallest variant (fewest parameters, counted on the meta device) of every model
  file timm registers (`timm.list_modules()`), its `test_*` toy models aside;
- hf: every model type with an image-classification head (`hookcli models --source hf`), and
  TEXT_TYPES with a sequence-classification head. A type whose default config holds more than
  SHRINK_ABOVE parameters is built with num_hidden_layers=2 (stated in its row).

Each model runs in a fresh process (random init, CPU): `hookcli inspect` (the default input of
the model's own size, statistics of every leaf call), then for image models `hookcli cam` on
sample_images/cat.jpeg with the default layer. A row shows the status (a failure: its one-line
hookcli message), how many 3-D/4-D outputs read as NCHW, NHWC or tokens and how many could not
be told, the default CAM layer and the layout it was read in, seconds and peak memory. The pass
rate counts models whose inspect ran.

Usage: python benchmarks/sweep_timm_hf.py [--source all|timm|hf] [--only GLOB] [--timeout S]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import platform
import sys
import time
import warnings
from pathlib import Path

from _common import run_child

ROOT = Path(__file__).resolve().parent.parent
CAT = ROOT / "sample_images" / "cat.jpeg"
SHRINK_ABOVE = 1.5e9
TEXT_TYPES = [
    *("albert", "bart", "bert", "big_bird", "bloom", "deberta-v2", "distilbert", "electra"),
    *("gpt2", "llama", "longformer", "mistral", "modernbert", "mpnet", "opt", "phi", "qwen2"),
    *("roberta", "t5", "xlnet"),
]

CHILD = """
import collections, json, resource, sys, tempfile, time
t0 = time.perf_counter()
import hookcli
from hookcli.errors import HookcliError
spec, model_args, image = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
out = {"name": spec}
head = {"head": "seq-cls"} if len(sys.argv) > 4 and sys.argv[4] == "text" else {}
try:
    r = hookcli.inspect(spec, device="cpu", topk=1, model_args=model_args, **head)
    kinds = collections.Counter(
        t.layout.split(":")[0] for c in r.layers for t in c.outputs if t.layout
    )
    out.update(status="ok", calls=len(r.layers), layouts=dict(kinds),
               input=", ".join("x".join(map(str, s)) for s in r.input.shapes))
except HookcliError as exc:
    out.update(status=f"exit {exc.exit_code}", message=str(exc))
else:
    if image:
        try:
            d = hookcli.cam(spec, image, device="cpu", model_args=model_args)
            out.update(cam=d.layer, cam_layout=d.picture.layout, cam_notes=len(d.notes))
        except HookcliError as exc:
            out.update(cam=f"exit {exc.exit_code}", cam_message=str(exc))
out["seconds"] = time.perf_counter() - t0
out["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out))
"""


def _params(build: object) -> int | None:
    """Parameters of the model `build()` makes on the meta device (no memory, no init);
    None when it cannot be built there."""
    import torch

    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            model = build()  # type: ignore[operator]
    except Exception:
        return None
    return int(sum(p.numel() for p in model.parameters()))


def timm_models() -> list[dict[str, object]]:
    """The smallest variant of each timm model file."""
    import timm

    rows = []
    for module in timm.list_modules():
        sized = []
        for name in timm.list_models(module=module):
            if name.startswith("test_"):
                continue
            n = _params(lambda name=name: timm.create_model(name))
            if n is not None:
                sized.append((n, name))
        if not sized:  # none builds on meta: the first by name, run for real
            names = [n for n in timm.list_models(module=module) if not n.startswith("test_")]
            sized = [(0, names[0])] if names else []
        if sized:
            n, name = min(sized)
            rows.append({"spec": f"timm:{name}", "group": module, "params": n, "args": {}})
    return rows


def hf_models() -> list[dict[str, object]]:
    """Every HF image-classification type, and TEXT_TYPES, sized on meta."""
    import transformers as tf

    from hookcli.sources.hf import model_types

    tf.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    rows: list[dict[str, object]] = []
    for kind, types, auto in (
        ("image", model_types("image"), tf.AutoModelForImageClassification),
        ("text", TEXT_TYPES, tf.AutoModelForSequenceClassification),
    ):
        for t in types:

            def build(t: str = t, auto: object = auto, **kw: object) -> object:
                config = tf.AutoConfig.for_model(t, **kw)
                config.architectures = []
                return auto.from_config(config)  # type: ignore[attr-defined]

            n = _params(build)
            args: dict[str, object] = {}
            if n is not None and n > SHRINK_ABOVE:
                args = {"num_hidden_layers": 2}
                n = _params(lambda build=build: build(num_hidden_layers=2))
            rows.append({"spec": f"hf:{t}", "group": kind, "params": n, "args": args})
    return rows


def _layouts(r: dict[str, object]) -> str:
    kinds = r.get("layouts")
    if not isinstance(kinds, dict):
        return ""
    return ", ".join(f"{k} {kinds[k]}" for k in ("NCHW", "NHWC", "tokens", "unknown") if k in kinds)


def _cam(r: dict[str, object]) -> str:
    if "cam" not in r:
        return ""
    if str(r["cam"]).startswith("exit "):
        return f"{r['cam']}: {r.get('cam_message', '')}"
    notes = int(str(r.get("cam_notes") or 0))
    return f"`{r['cam']}` ({r.get('cam_layout', '')}{', note' if notes else ''})"


def _cell(text: object) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def table(rows: list[dict[str, object]], took: float) -> str:
    import timm
    import torch
    import transformers

    ok = sum(r["status"] == "ok" for r in rows)
    cams = [r for r in rows if "cam" in r]
    cam_ok = sum(not str(r["cam"]).startswith("exit ") for r in cams)
    lines = [
        "# timm and Hugging Face models under `hookcli inspect` and `hookcli cam`",
        "",
        f"Made by `python benchmarks/sweep_timm_hf.py`: **{ok} of {len(rows)} models ran "
        f"({100 * ok / max(len(rows), 1):.1f}%)**; the default CAM layer was found for "
        f"{cam_ok} of the {len(cams)} image models whose inspect ran. torch {torch.__version__}, "
        f"timm {timm.__version__}, transformers {transformers.__version__}, "
        f"{platform.machine()} CPU, 2 cores, offline; {took / 60:.0f} min of model runs.",
        "",
        "timm: the smallest variant (fewest parameters) of every model file, `test_*` models "
        "aside. hf: every model type with an image-classification head, and 20 text types with "
        "a sequence-classification head; a type whose default config exceeds "
        f"{SHRINK_ABOVE / 1e9:.1f} B parameters is built with `--model-arg num_hidden_layers=2`. "
        "Random weights; the default input of the size each model expects (timm: its data "
        "config; hf: `config.image_size`; text: 16 random token ids); statistics of every "
        "leaf call. Layouts: how the 3-D/4-D layer outputs were read (engine.layout); "
        "`unknown` ones are refused by maps and cam rather than guessed. CAM: the layer "
        "`hookcli cam MODEL sample_images/cat.jpeg` picks without `-l`, and the layout it was "
        "read in (`note`: the picture carries a note, e.g. constant scores from random "
        "weights). Seconds: the whole run in a fresh process (import, build, inspect, cam); "
        "peak: the process's peak resident memory.",
        "",
        "| model | file / kind | params | status | input | layer calls | layouts | CAM layer "
        "| seconds | peak MiB |",
        "|---|---|---:|---|---|---:|---|---|---:|---:|",
    ]
    for r in rows:
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('message', '')}"
        params = r.get("params")
        args = r.get("args") or {}
        name = str(r["name"]) + "".join(f" `{k}={v}`" for k, v in dict(args).items())  # type: ignore[call-overload]
        lines.append(
            f"| {_cell(name)} | {r.get('group', '')} "
            f"| {f'{int(str(params)) / 1e6:.1f} M' if params else ''} | {_cell(status)} "
            f"| {r.get('input', '')} | {r.get('calls', '')} | {_layouts(r)} | {_cell(_cam(r))} "
            f"| {float(str(r['seconds'])):.1f} | {float(str(r.get('peak_mib') or 0)):.0f} |"
        )
    lines += ["", f"<!-- rows: {json.dumps(rows)} -->"]  # read back by --only
    return "\n".join(lines) + "\n"


def _merge(old: str, rows: list[dict[str, object]]) -> list[dict[str, object]]:
    """The rows of an existing table (as JSON, from its comment) with `rows` put in place."""
    saved = next((line for line in old.splitlines() if line.startswith("<!-- rows: ")), None)
    if saved is None:
        return rows
    kept: list[dict[str, object]] = json.loads(
        saved.removeprefix("<!-- rows: ").removesuffix(" -->")
    )
    fresh = {r["name"]: r for r in rows}
    merged = [fresh.pop(str(r["name"]), r) for r in kept]
    return merged + list(fresh.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", choices=("all", "timm", "hf"), default="all")
    parser.add_argument(
        "--only",
        action="append",
        help="glob on model specs (timm:..., hf:...), repeatable; the rows of an existing "
        "table are replaced, the others kept",
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "models_timm_hf.md"))
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"  # the children inherit it: nothing is downloaded
    t0 = time.perf_counter()
    picked = (timm_models() if args.source in ("all", "timm") else []) + (
        hf_models() if args.source in ("all", "hf") else []
    )
    globs = args.only or ["*"]
    picked = [p for p in picked if any(fnmatch.fnmatchcase(str(p["spec"]), g) for g in globs)]
    print(f"{len(picked)} models picked in {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for i, p in enumerate(picked, 1):
        image = "" if p["group"] == "text" else str(CAT)
        spec = str(p["spec"])
        row = run_child(
            CHILD, [spec, json.dumps(p["args"]), image, str(p["group"])], spec, args.timeout
        )
        row.update(group=p["group"], params=p["params"], args=p["args"])
        rows.append(row)
        print(
            f"[{i}/{len(picked)}] {spec}: {row['status']} {row.get('message', '')} "
            f"cam={row.get('cam', '')} {float(str(row['seconds'])):.1f} s",
            flush=True,
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.only and out.exists():  # refresh those rows in the existing table
        rows = _merge(out.read_text(), rows)
    out.write_text(table(rows, sum(float(str(r["seconds"])) for r in rows)))
    print(f"wrote {out}")
    if any(str(r["status"]).startswith(("crashed", "timeout")) for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
