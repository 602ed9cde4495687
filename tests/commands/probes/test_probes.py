"""The probe seam (engine/probes.py): a capability plugs into the measured pass as one Probe,
armed before the pass, reading while the gradients live, folding into the report after; and
where a capability may run is declared on it (commands/probes), so a run in batches refuses
every one-batch probe by its flag, from one place."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from torch import nn

import hookcli
from hookcli.commands import probes as probing
from hookcli.commands.inspect import input_info, model_info
from hookcli.engine.measure import finish, measured_pass, statistics
from hookcli.engine.prepare import prepare
from hookcli.engine.probes import Armed, Measured, Probe
from hookcli.errors import ModelError, UsageError
from hookcli.options import BackwardOptions, InputOptions, ModelOptions, RunOptions, Selection
from hookcli.records import Report
from tests.support.llm import save
from tests.support.paths import CAT


class _GradPeak(Probe):
    """A capability of a test's own: the largest |gradient| of the first Linear's weight,
    read while the gradients live, and a note; the order of its steps is kept."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.peak: float | None = None

    @contextlib.contextmanager
    def arm(self, armed: Armed) -> Iterator[None]:
        self.steps.append("arm")
        try:
            yield
        except BaseException:
            self.steps.append("failed")
            raise
        self.steps.append("closed")

    def read(self, measured: Measured) -> None:
        self.steps.append("read")
        weight = measured.armed.prepared.loaded.module[0].weight
        assert weight.grad is not None  # the gradients are alive here
        self.peak = float(weight.grad.abs().max())

    def finish(self, measured: Measured, report: Report) -> None:
        self.steps.append("finish")
        report.notes.append(f"peak gradient {self.peak}")


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def test_a_probe_of_ones_own_plugs_into_the_measured_pass() -> None:
    model = _model()
    x = torch.randn(4, 6)
    prepared = prepare(
        ModelOptions(model, device="cpu"),
        Selection(),
        InputOptions((x,)),
        backward=BackwardOptions(target="sum"),
    )
    probe = _GradPeak()
    with measured_pass(prepared, statistics(), backward=True, probes=[probe]) as measured:
        assert probe.steps == ["arm", "read"]
    assert probe.steps == ["arm", "read", "closed"]
    assert model[0].weight.grad is None  # the user's .grad left as found
    assert measured.model_input is not None
    report = Report(
        model=model_info(prepared.loaded),
        input=input_info(measured.model_input),
        device="cpu",
        layers=measured.calls,
    )
    finish(measured, report, [probe])
    # the oracle: torch.autograd.grad of the same scalar
    (grad,) = torch.autograd.grad(model(x).sum(), [model[0].weight])
    assert probe.peak == pytest.approx(float(grad.abs().max()), rel=1e-6)
    assert report.notes == [f"peak gradient {probe.peak}"]
    assert probe.steps[-1] == "finish"
    assert [c.name for c in report.layers] == ["0", "1", "2"]


def test_a_probe_sees_the_pass_fail_and_its_context_closes() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("boom")

    prepared = prepare(
        ModelOptions(Broken(), device="cpu"), Selection(), InputOptions((torch.ones(2),))
    )
    probe = _GradPeak()
    with pytest.raises(ModelError), measured_pass(prepared, statistics(), probes=[probe]):
        pass
    assert probe.steps == ["arm", "failed"]


def _images(root: Path, n: int) -> Path:
    root.mkdir()
    photo = Image.open(CAT).convert("RGB")
    for i in range(n):
        photo.crop((i, i, 200 + i, 200 + i)).save(root / f"{i}.png")
    return root


# each one-batch probe's option through the API, as a run would ask for it
ASKED: dict[str, dict[str, Any]] = {
    "ablate": {"ablate": ["conv1=zero"]},
    "per-token": {"per_token": True},
    "save": {"save": "out.safetensors"},
    "heads": {"heads": True},
    "generate": {"generate": 2},
}


def test_a_probe_whose_option_names_no_run_option_is_refused_when_made() -> None:
    """`option` is read by name: a misspelt one would read as never asked; it fails at once."""
    with pytest.raises(TypeError, match="'per_tokens' is not a RunOptions field"):

        class Misspelt(Probe):
            option = "per_tokens"

    class Spelt(Probe):
        option = "per_token"

    assert Spelt.wanted(RunOptions(per_token=True)) and not Spelt.wanted(RunOptions())


@pytest.mark.parametrize(
    "probe", [p for p in probing.PROBES if not p.batched and p.flag], ids=lambda p: p.flag
)
def test_a_run_in_batches_refuses_every_one_batch_probe_by_its_declaration(
    probe: type[Probe], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    folder = _images(tmp_path / "images", 3)
    asked = ASKED.get(probe.flag, {probe.option: True})
    assert probe.wanted(RunOptions(**{probe.option: next(iter(asked.values()))}))
    with pytest.raises(UsageError) as caught:
        hookcli.inspect("resnet18", [str(folder)], batch_size=2, layers=["conv1"], **asked)
    if probe.text_only:  # the way round is text, not fewer images
        said = f"--{probe.flag} reads a text's tokens; this run is a folder of images."
    elif probe.refusal is not None:
        said = probe.refusal[0]
    else:
        said = f"--{probe.flag} works on one batch, not on a folder run."
    assert caught.value.message == said
    assert not (tmp_path / "out.safetensors").exists()


def test_what_merges_over_batches_is_declared_so_and_runs_on_a_folder(tmp_path: Path) -> None:
    """channels and profile merge; a folder run with both gives the folder's numbers."""
    assert {p.flag for p in probing.PROBES if p.batched and p.flag} == {"channels", "profile"}
    folder = _images(tmp_path / "images", 3)
    report = hookcli.inspect(
        "resnet18", [str(folder)], batch_size=2, layers=["conv1"], channels=True, profile=True
    )
    assert report.profile is not None
    assert report.layers[0].outputs[0].channels is not None
    assert report.outliers is not None


def test_a_rule_needing_a_one_batch_probe_is_refused_on_a_folder(tmp_path: Path) -> None:
    folder = _images(tmp_path / "images", 3)
    with pytest.raises(UsageError, match="--heads works on one batch"):
        hookcli.check("resnet18", [str(folder)], batch_size=2, layers=["conv1"], max_sink=0.9)
    with pytest.raises(UsageError) as caught:
        hookcli.check("resnet18", [str(folder)], batch_size=2, fail_on="dead-experts")
    assert probing.Experts.refusal is not None
    assert caught.value.message == probing.Experts.refusal[0]


def test_a_batched_text_run_refuses_one_batch_flags_before_the_probes_own_refusals(
    tmp_path: Path,
) -> None:
    """Two one-batch options on a run in batches: the flag's refusal comes first, the
    probes' own (--memory, the expert rules) after, as before the seam."""
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(f"line {i}" for i in range(40)))
    folder = save(tmp_path / "llama", "llama")
    with pytest.raises(UsageError) as caught:
        hookcli.inspect(f"hf:{folder}", text_file=texts, heads=True, memory=True)
    assert caught.value.message.startswith("--heads works on one batch of text")
    with pytest.raises(UsageError) as caught:
        hookcli.check(f"hf:{folder}", text_file=texts, memory=True, fail_on="dead-experts")
    assert caught.value.message == probing.Experts.refusal[0]  # type: ignore[index]


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save(tmp_path_factory.mktemp("moe") / "mixtral", "mixtral")


def test_profile_times_before_any_probe_hooks_so_expert_rows_are_one_pass(mixtral: Path) -> None:
    """--channels reads a fused MoE block's experts through hooks of its own; --profile's
    timed passes run before them, so the rows are the measured pass's alone."""
    texts = ["Once upon a time there was a model.", "hello", "a dog"]
    kw: dict[str, Any] = {"text": texts, "layers": ["model.layers.0.mlp.*"], "topk": 0}
    plain = hookcli.inspect(f"hf:{mixtral}", channels=True, **kw)
    timed = hookcli.inspect(f"hf:{mixtral}", channels=True, profile=True, **kw)

    def experts(report: Report) -> list[tuple[str, int, int]]:
        return [(c.name, c.call, c.inputs[0].numel) for c in report.layers if ".experts." in c.name]

    assert experts(plain) and experts(timed) == experts(plain)
    assert {call for _, call, _ in experts(timed)} == {0}
    assert timed.notes == plain.notes


def test_profile_with_generate_times_every_generated_step(mixtral: Path) -> None:
    report = hookcli.inspect(
        f"hf:{mixtral}", text=["hello there"], layers=["lm_head"], generate=3, profile=True
    )
    calls = [c for c in report.layers if c.name == "lm_head"]
    assert [c.call for c in calls] == [0, 1, 2]
    assert all(c.profile is not None for c in calls)  # generate's every step, not one forward
    assert report.generated is not None
