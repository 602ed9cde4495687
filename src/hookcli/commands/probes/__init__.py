"""The probes of inspect, grads and check: one module per capability a measured pass can carry
(the seam: engine/probes.py). A capability is a Probe subclass in a module of its own and one
line in PROBES; the order of PROBES is the order their findings fold into the report.

ablation.py   --ablate (the second pass of an ablation)
channels.py   --channels, and a fused MoE block's experts read per expert
tokens.py     --per-token
profile.py    --profile
memory.py     --memory
saving.py     --save
experts.py    MoE routing (always on, where routers are), and a fused block's unpaired experts
heads.py      --heads
generation.py --generate
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hookcli.commands.probes.ablation import Ablate
from hookcli.commands.probes.channels import Channels
from hookcli.commands.probes.experts import ExpertPairs, Experts
from hookcli.commands.probes.generation import Generation
from hookcli.commands.probes.heads import Heads
from hookcli.commands.probes.memory import Memory
from hookcli.commands.probes.profile import Profiled
from hookcli.commands.probes.saving import Save
from hookcli.commands.probes.tokens import PerToken, label_tokens, token_grid
from hookcli.engine.probes import Probe

if TYPE_CHECKING:
    from hookcli.commands.checks import Rules
    from hookcli.options import RunOptions

PROBES: tuple[type[Probe], ...] = (
    Ablate,
    Channels,
    ExpertPairs,
    PerToken,
    Profiled,
    Save,
    Experts,
    Memory,
    Heads,
    Generation,
)

__all__ = [
    "PROBES",
    "Ablate",
    "Channels",
    "ExpertPairs",
    "Experts",
    "Generation",
    "Heads",
    "Memory",
    "PerToken",
    "Probe",
    "Profiled",
    "Save",
    "inspection",
    "label_tokens",
    "one_batch_only",
    "token_grid",
]


def inspection(run: RunOptions, command: str) -> list[Probe]:
    """The probes a run (RunOptions) of inspect, grads or check arms, in PROBES' order."""
    return [cls.of(run, command) for cls in PROBES if cls.wanted(run)]


def one_batch_only(run: RunOptions, rules: Rules | None = None) -> list[type[Probe]]:
    """The probes the run or its rules ask for that read one batch (not merged over batches):
    a run in batches refuses them."""
    return [cls for cls in PROBES if not cls.batched and cls.asked(run, rules)]
