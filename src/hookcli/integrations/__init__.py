"""Adapters that put hookcli into other frameworks' training loops.

Each lives in a module of its own and imports its framework only when used, so hookcli never
depends on a framework it does not need: `hookcli.integrations.lightning` is PyTorch Lightning's
callback around `hookcli.watch`.
"""
