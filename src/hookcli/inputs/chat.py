"""`--chat`: each text a user turn through the tokenizer's chat template, rendered with bounds.

A chat template is a Jinja program that comes with a tokenizer folder: data, not code the user
wrote. transformers renders it in Jinja's sandbox, which stops escapes but not cost — a nested
loop that never returns, or a template that writes gigabytes of text. Here it renders in a
forked child process (the tokenizer already loaded, transformers' own rendering) under a time
limit, an address-space limit and a cap on the text it returns; any of them reached is one line
naming the limit. Where fork does not exist the template renders in this process, unbounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import time
from collections.abc import Sequence
from typing import Any

from hookcli.errors import UsageError, one_line

CHAT_SECONDS = 20.0  # wall time the template may take over all the texts
CHAT_MEMORY = 1 << 30  # address space the rendering may add to the process's
CHAT_TEXT = 16 << 20  # characters of rendered text over all the texts (as --text-file's cap)
_NEXT = "drop --chat and give the text as the model should see it."


def render_chat(tokenizer: Any, texts: Sequence[str]) -> list[str]:
    """Each text as the user turn of the tokenizer's chat template, with the generation prompt
    after it, as transformers renders it; bounded (see the module docstring)."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(
            "--chat: the tokenizer has no chat template (chat_template in "
            "tokenizer_config.json or chat_template.jinja).",
            _NEXT,
        )
    if not hasattr(os, "fork"):
        return [_render(tokenizer, t) for t in texts]
    return _bounded(tokenizer, list(texts))


def _render(tokenizer: Any, text: str) -> str:
    try:
        return _apply(tokenizer, text)
    except Exception as exc:
        raise UsageError(
            f"--chat: the tokenizer's chat template failed: {one_line(exc)}.", _NEXT
        ) from exc


def _apply(tokenizer: Any, text: str) -> str:
    return str(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    )


def _bounded(tokenizer: Any, texts: list[str]) -> list[str]:
    read, write = os.pipe()
    quiet = "TOKENIZERS_PARALLELISM" not in os.environ
    if quiet:  # the Rust tokenizers' fork warning is not printed when this is set
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pid = os.fork()
    finally:
        if quiet:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
    if pid == 0:  # the child: render, write the answer, leave without running any cleanup
        code = 0
        try:
            os.close(read)
            _child(tokenizer, texts, write)
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write)
    try:
        data, why = _collect(read, pid)
    except BaseException:  # Ctrl-C while it renders: the child goes too
        _kill(pid)
        raise
    finally:
        os.close(read)
    if why is not None:
        raise UsageError(f"--chat: the tokenizer's chat template {why}.", _NEXT)
    try:
        answer = json.loads(data)
    except ValueError as exc:
        raise UsageError(
            "--chat: the tokenizer's chat template stopped before it finished rendering.", _NEXT
        ) from exc
    if "error" in answer:
        raise UsageError(f"--chat: the tokenizer's chat template {answer['error']}.", _NEXT)
    return [str(x) for x in answer["texts"]]


def _child(tokenizer: Any, texts: list[str], write: int) -> None:
    import resource

    try:  # the memory this process has mapped already, plus the allowance
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = mapped + CHAT_MEMORY
        if hard == resource.RLIM_INFINITY or limit < hard:
            resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    except (OSError, ValueError):
        pass
    try:
        out: list[str] = []
        total = 0
        for text in texts:
            out.append(_apply(tokenizer, text))
            total += len(out[-1])
            if total > CHAT_TEXT:
                raise _TooLong
        answer: dict[str, Any] = {"texts": out}
    except _TooLong:
        answer = {"error": f"rendered more than {CHAT_TEXT >> 20} MB of text"}
    except MemoryError:
        answer = {"error": f"needed more than {CHAT_MEMORY >> 30} GiB of memory to render"}
    except RecursionError:
        answer = {"error": "failed: it recurses too deep"}
    except Exception as exc:
        answer = {"error": f"failed: {one_line(exc).rstrip('.')}"}
    data = json.dumps(answer).encode()
    view = memoryview(data)
    while view:
        view = view[os.write(write, view) :]


class _TooLong(Exception):
    pass


def _collect(read: int, pid: int) -> tuple[bytes, str | None]:
    """The child's answer, read until it closes the pipe; why it failed where it was stopped
    (too slow, too much text) or died."""
    chunks: list[bytes] = []
    size = 0
    cap = 6 * CHAT_TEXT + (1 << 20)  # JSON of the capped text (escapes at most 6 bytes each)
    deadline = time.monotonic() + CHAT_SECONDS
    why: str | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            why = f"did not finish rendering within {CHAT_SECONDS:g} s (a loop without end?)"
            break
        ready, _, _ = select.select([read], [], [], min(left, 1.0))
        if not ready:
            continue
        chunk = os.read(read, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
        if size > cap:
            why = f"rendered more than {CHAT_TEXT >> 20} MB of text"
            break
    if why is not None:
        _kill(pid)
        return b"", why
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return b"", f"stopped rendering: the process was killed by signal {sig}"
    return b"".join(chunks), None


def _kill(pid: int) -> None:
    """The child stopped and reaped (already gone, or reaped by someone else: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


__all__: Sequence[str] = ("render_chat",)
