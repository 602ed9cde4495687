"""The command line: the only package that knows Typer and exit codes.

Commands parse options into the option objects (hookcli.options), call the API's core
(hookcli.commands, imported lazily: `hookcli --help` never imports torch) and render what it
returns. Errors from the core become one line on stderr naming the problem and the next step,
with the exit code docs/usage.md lists.

    app.py       the Typer app, --version, the console script (main)
    params.py    shared option declarations; the project config as Click's default_map
    console.py   one-line errors and exit codes, the spinner, stdout or a claimed file
    listing.py   models, layers, show
    inspect.py   inspect, grads, check
    diff.py      diff
    pictures.py  maps, cam
"""

from hookcli.cli.app import app, main

__all__ = ["app", "main"]
