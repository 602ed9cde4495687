"""`hookcli calib`: each layer's input channels over calibration data, for quantization."""

from __future__ import annotations

from dataclasses import dataclass, field

from hookcli.records.core import InputInfo, ModelInfo
from hookcli.records.llm import ChannelStats


@dataclass(slots=True)
class CalibLayer:
    """calib: one layer's input channels over every input, and its outlier ratios (largest
    channel max|x| ÷ the median channel's) of its input and weight, before and after
    SmoothQuant's smoothing (None where its weight is not per input channel)."""

    name: str
    type: str
    channels: ChannelStats
    act_ratio: float | None
    smoothed_act_ratio: float | None = None
    weight_ratio: float | None = None
    smoothed_weight_ratio: float | None = None


@dataclass(slots=True)
class CalibSkip:
    """calib: a selected layer (or one expert's projection) with no numbers, and why."""

    name: str
    type: str
    reason: str


@dataclass(slots=True)
class CalibReport:
    """`hookcli calib`: each selected layer's input channels; `hist_bounds` the inner bounds of
    every layer's |x| histogram (channels.abs_hist): bin 0 holds |x| below the first, bin k
    bounds[k-1] <= |x| < bounds[k], the last |x| at or above the last bound."""

    model: ModelInfo
    input: InputInfo
    device: str
    alpha: float
    layers: list[CalibLayer]
    hist_bounds: list[float]
    notes: list[str] = field(default_factory=list)
    command: str = "calib"
    # selected layers calib could not read (never ran, no float input, an expert no token
    # was routed to): listed, never dropped in silence
    skipped: list[CalibSkip] = field(default_factory=list)
    # what an imatrix file (-o FILE.imatrix) needs: the sequences (or inputs) calibrated on,
    # and a transformers model's type and blocks (its tensors' GGUF names); None otherwise
    sequences: int = 0
    model_type: str | None = None
    blocks: int | None = None
    experts: int | None = None  # a mixture of experts' routed experts per block
