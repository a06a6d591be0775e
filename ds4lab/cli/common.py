"""What the ``ds4lab`` commands share: exit codes and defaults, the thinking modes, the usage error, the one-line
error on stderr, the checks of input and output files before any work, and loading the model the flags name."""

from __future__ import annotations

import contextlib
import os
import stat
import sys
from pathlib import Path

from ..tokenizer import THINK_MAX_MIN_CTX, effective_think

EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
DEFAULT_SYSTEM = "You are a helpful assistant"  # ds4_cli.c; an empty --system disables it
DEFAULT_TOKENS = 50000  # ds4's -n default, clamped to the room left in the context
DEFAULT_CTX = 32768  # ds4's --ctx default, capped at the model's trained context
# the smallest context that generates: a prompt token, a generated one and the slot ds4 keeps free (generate.no_room)
MIN_CTX = 3


class UsageError(Exception):
    """Invalid arguments found after parsing (exit code 2)."""


def err(message: str) -> None:
    print(f"ds4lab: {message}", file=sys.stderr, flush=True)


def named_error(path, e: OSError) -> OSError:
    """``e`` naming ``path`` where it names no file (a write error such as ENOSPC or EIO carries none: Python says
    "[Errno 28] No space left on device" and nothing of which file); its errno kept, so a closed pipe is still a
    BrokenPipeError."""
    return e if e.filename else OSError(e.errno, e.strerror or str(e), str(path))


class NamedWrites:
    """A text stream whose write and flush errors name it (:func:`named_error`); the rest is the stream's own."""

    def __init__(self, out, path):
        self.out, self.path = out, path

    def write(self, text: str) -> int:
        try:
            return self.out.write(text)
        except OSError as e:
            raise named_error(self.path, e) from None

    def flush(self) -> None:
        try:
            self.out.flush()
        except OSError as e:
            raise named_error(self.path, e) from None

    def __getattr__(self, name: str):
        return getattr(self.out, name)


@contextlib.contextmanager
def named_stdout():
    """``sys.stdout`` as "stdout" in its write errors while a command runs; the text still buffered at the end is
    flushed inside, so a full disk is reported there too (not as an exception ignored at the interpreter's exit)."""
    stdout = sys.stdout
    if stdout is None:  # started with stdout closed (`ds4lab ... >&-`): nothing to name, and print() writes nowhere
        yield
        return
    sys.stdout = NamedWrites(stdout, "stdout")
    try:
        yield
        sys.stdout.flush()
    finally:
        sys.stdout = stdout


def _check_backend_flags(name: str, device: str | None) -> None:
    """The flag combinations that make no sense (usage errors); the choice itself is
    :func:`ds4lab.backends.resolve_backend`'s, the same rule as ``ds4lab.load(backend="auto")``."""
    if name == "numpy" and device == "gpu":
        raise UsageError("--device gpu needs the mlx backend (numpy runs on the CPU)")
    if name == "cupy" and device is not None:
        raise UsageError("--device is for the mlx backend; cupy runs on the current CUDA GPU")


def _check_matmul_flags(args, backend: str) -> None:
    """--prefill-matmul tf32/f16 and --decode-matmul q8 are CuPy's kernels' (usage errors elsewhere), refused by
    their flags before ``ds4lab.load`` refuses them by its keyword arguments."""
    asked = f"--backend {args.backend}" + (f", which chose {backend} here" if args.backend != backend else "")
    for flag, value, plain in (("--prefill-matmul", args.prefill_matmul, ("auto", "float32")),
                               ("--decode-matmul", args.decode_matmul, ("float32",))):
        if value in plain:
            continue
        if backend != "cupy":
            raise UsageError(f"{flag} {value} needs --backend cupy (got {asked}); other backends run "
                             f"{flag} float32")
        if args.no_kernels:
            raise UsageError(f"{flag} {value} needs the cupy backend's kernels: drop --no-kernels or {flag}")


def load_model(args):
    from .. import load
    from ..backends import resolve_backend

    _check_backend_flags(args.backend, args.device)
    check_input(args.model, "-m")
    backend = resolve_backend(args.backend, args.device)
    _check_matmul_flags(args, backend)
    return load(args.model, backend=backend, numerics=args.numerics,
                device=args.device if backend == "mlx" else None, kernels=False if args.no_kernels else None,
                prefill_matmul=args.prefill_matmul, decode_matmul=args.decode_matmul)


def describe(model) -> str:
    from ..backends import backend_label

    cfg = model.config
    return f"{model.path.name} ({cfg.n_layer} layers, vocab {cfg.n_vocab}), {backend_label(model.backend)}"


def context_size(ctx: int | None, model, flag: str = "--ctx") -> int:
    """The session's context: ``ctx`` (the flag's value), else :data:`DEFAULT_CTX` capped at the model's
    context length; a value outside [MIN_CTX, the model's context length] is a usage error naming ``flag``."""
    most = model.config.context_length
    if ctx is None:
        return min(DEFAULT_CTX, most) if most else DEFAULT_CTX
    if ctx < MIN_CTX or (most and ctx > most):
        raise UsageError(f"{flag} must be in [{MIN_CTX}, {most}] for this model, got {ctx}" if most else
                         f"{flag} must be at least {MIN_CTX}, got {ctx}")
    return ctx


def check_input(path: Path | None, flag: str) -> None:
    """Refuse an input file that is missing, a folder or unreadable before any work, naming it."""
    if path is None:
        return
    if not path.exists():
        raise OSError(f"{flag} {path}: no such file")
    if path.is_dir():
        raise OSError(f"{flag} {path}: is a directory, not a file")
    if not os.access(path, os.R_OK):
        raise OSError(f"{flag} {path}: not readable (permission denied)")


def _why_not_writable(folder: Path) -> str:
    """A read-only file system, where the system says so (statvfs: not on Windows), else permission denied."""
    try:
        if os.statvfs(folder).f_flag & os.ST_RDONLY:
            return "a read-only file system"
    except (AttributeError, OSError):
        pass
    return "permission denied"


def check_output(path: Path | None, flag: str) -> None:
    """Refuse an output path before any work, naming it: a folder, a parent folder that is missing, not a folder
    or not writable, or an existing file that refuses writes (such as /proc/version). Nothing is created or
    truncated here."""
    if path is None:
        return
    if path.is_dir():
        raise OSError(f"{flag} {path}: is a directory; give a file name")
    parent = path.parent
    if not parent.exists():
        raise OSError(f"{flag} {path}: the folder {parent} does not exist")
    if not parent.is_dir():
        raise OSError(f"{flag} {path}: {parent} is not a folder")
    if not path.exists():
        if not os.access(parent, os.W_OK | os.X_OK):
            raise OSError(f"{flag} {path}: cannot create a file in {parent} ({_why_not_writable(parent)})")
        return
    if stat.S_ISFIFO(path.stat().st_mode):
        return  # a pipe: opening it to test would wait for a reader
    try:  # opened without truncating; a zero-byte write reaches the file system's write (procfs refuses it)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, b"")
        finally:
            os.close(fd)
    except OSError as e:
        raise OSError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def check_distinct(outputs: list, inputs: list) -> None:
    """Refuse, before any work, an output path (``(path, flag)``; None: not given) that names an input's file or an
    earlier output's: writing it would destroy what the command reads, or the other output."""
    named = [(p, f) for p, f in inputs if p is not None]
    for path, flag in outputs:
        if path is None:
            continue
        for other, other_flag in named:
            if _same_file(path, other):
                raise UsageError(f"{flag} {path} is the file of {other_flag} {other}: writing it would overwrite "
                                 f"that; give another file name")
        named.append((path, flag))


def _same_file(a: Path, b: Path) -> bool:
    """Whether writing ``a`` would overwrite regular file ``b`` (a terminal or pipe, such as /dev/stdin and
    /dev/stdout, may be one device and still two streams)."""
    try:
        return stat.S_ISREG(os.stat(b).st_mode) and os.path.samefile(a, b)
    except OSError:  # a does not exist yet: b's file only by name
        return a.resolve() == b.resolve()


def decoded(text: str) -> str:
    """Text from the command line or a terminal with the bytes that are not UTF-8 (which Python keeps as lone
    surrogates) replaced by U+FFFD, as :func:`read_text` reads a file: the tokenizer cannot encode a surrogate."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def read_text(path: Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except IsADirectoryError:
        raise OSError(f"{path}: is a directory") from None
    except OSError as e:
        raise OSError(f"{path}: {e.strerror or e}") from None


# ---------------------------------------------------------------------------------------------------------
# Thinking modes: the flag that asks for each, and the one a context allows (ds4's rule: tokenizer.effective_think)


THINK_FLAGS = {"none": "--nothink", "high": "--think", "max": "--think-max"}  # the flag that asks for each mode


def thinking_mode(mode: str, ctx: int) -> str:
    """The mode a context allows for ``mode`` (ds4's rule), with a warning where Think Max falls back."""
    used = effective_think(mode, ctx)
    if used != mode:
        err(f"warning: --think-max needs --ctx >= {THINK_MAX_MIN_CTX}; ctx={ctx} uses normal thinking")
    return used

