"""What the commands compute, for the CLI and the Python API alike. This is the package's face:
the names the CLI and `hookcli` reach, each computed in its own module.

run.py       inspect, grads and check as the command asks (run_command): the command rules
api.py       the Python API's keyword arguments → the same option objects (api_report)
drawing.py   maps, cam and attn as a Drawing (the PNG, the arrays it was drawn from)
inspect.py, folder.py, checks.py, ablation.py, pictures.py, attention.py, lens.py, profile.py,
shards.py, listing.py, diff/, watch/: each command's own computation

No torch at import: the engine, the folder runs and the pictures are imported on use.
"""

from __future__ import annotations

from hookcli.commands.api import api_report, rules_from_api
from hookcli.commands.drawing import PICTURE_KEYS, Drawing, attn, cam, maps, picture_options
from hookcli.commands.run import COMMANDS, Progress, Running, command_invocation, run_command

__all__ = [
    "COMMANDS",
    "PICTURE_KEYS",
    "Drawing",
    "Progress",
    "Running",
    "api_report",
    "attn",
    "cam",
    "command_invocation",
    "maps",
    "picture_options",
    "rules_from_api",
    "run_command",
]
