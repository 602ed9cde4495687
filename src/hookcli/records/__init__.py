"""Plain dataclasses a run produces: numbers and strings, never tensors. Renderers read these
and nothing else, so they never need torch.

The records live by subject — core (a tensor's statistics, a layer call, …), report, listing,
diff, lens, calib, runlog, llm (channels, heads, experts) — and every one is read from here
(`from hookcli.records import Report`).
"""

from __future__ import annotations

from hookcli.records.calib import CalibLayer as CalibLayer
from hookcli.records.calib import CalibReport as CalibReport
from hookcli.records.calib import CalibSkip as CalibSkip
from hookcli.records.core import LOG_SCHEMA as LOG_SCHEMA
from hookcli.records.core import READABLE_LOG_SCHEMAS as READABLE_LOG_SCHEMAS
from hookcli.records.core import READABLE_SCHEMAS as READABLE_SCHEMAS
from hookcli.records.core import SCHEMA_VERSION as SCHEMA_VERSION
from hookcli.records.core import TENSOR_STATS as TENSOR_STATS
from hookcli.records.core import Ablation as Ablation
from hookcli.records.core import Backward as Backward
from hookcli.records.core import CallMemory as CallMemory
from hookcli.records.core import CallProfile as CallProfile
from hookcli.records.core import Candidate as Candidate
from hookcli.records.core import CheckResult as CheckResult
from hookcli.records.core import Failure as Failure
from hookcli.records.core import Generated as Generated
from hookcli.records.core import ImageNonfinite as ImageNonfinite
from hookcli.records.core import InputInfo as InputInfo
from hookcli.records.core import LayerCall as LayerCall
from hookcli.records.core import LayerChange as LayerChange
from hookcli.records.core import Memory as Memory
from hookcli.records.core import ModelInfo as ModelInfo
from hookcli.records.core import Origin as Origin
from hookcli.records.core import ParamStats as ParamStats
from hookcli.records.core import Prediction as Prediction
from hookcli.records.core import Profile as Profile
from hookcli.records.core import TensorStats as TensorStats
from hookcli.records.core import TextInfo as TextInfo
from hookcli.records.core import TokenRow as TokenRow
from hookcli.records.core import rescale as rescale
from hookcli.records.diff import DiffCall as DiffCall
from hookcli.records.diff import DiffReport as DiffReport
from hookcli.records.diff import TensorDiff as TensorDiff
from hookcli.records.diff import TokenDistances as TokenDistances
from hookcli.records.diff import WeightDistance as WeightDistance
from hookcli.records.lens import LensCell as LensCell
from hookcli.records.lens import LensReport as LensReport
from hookcli.records.lens import LensToken as LensToken
from hookcli.records.listing import KVCache as KVCache
from hookcli.records.listing import LayersReport as LayersReport
from hookcli.records.listing import ModelEntry as ModelEntry
from hookcli.records.listing import ModuleRow as ModuleRow
from hookcli.records.listing import SavedFile as SavedFile
from hookcli.records.listing import WeightBytes as WeightBytes
from hookcli.records.llm import ChannelStats as ChannelStats
from hookcli.records.llm import ExpertStats as ExpertStats
from hookcli.records.llm import HeadStats as HeadStats
from hookcli.records.llm import LensViewed as LensViewed
from hookcli.records.llm import Massive as Massive
from hookcli.records.llm import MassiveAt as MassiveAt
from hookcli.records.llm import OutlierFeature as OutlierFeature
from hookcli.records.llm import Outliers as Outliers
from hookcli.records.llm import Rendered as Rendered
from hookcli.records.report import Report as Report
from hookcli.records.report import Viewed as Viewed
from hookcli.records.runlog import BundleInfo as BundleInfo
from hookcli.records.runlog import LoggedCall as LoggedCall
from hookcli.records.runlog import LoggedParam as LoggedParam
from hookcli.records.runlog import NonfiniteLine as NonfiniteLine
from hookcli.records.runlog import StepLine as StepLine
from hookcli.records.runlog import log_line as log_line
from hookcli.records.statfields import Stat as Stat
