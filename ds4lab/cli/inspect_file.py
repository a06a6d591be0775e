"""``ds4lab inspect FILE``: a GGUF model file's summary (:meth:`ds4lab.gguf_file.GGUFModelFile.print_summary`) or a
``.kv`` cache file's (:meth:`ds4lab.kv.kvfile.KVFile.summary`) with its checksum verdict."""

from __future__ import annotations

import os
from pathlib import Path

from .common import EXIT_RUNTIME, err


def inspect_command(args) -> int:
    path: Path = args.file
    if not path.exists():
        raise OSError(f"{path}: " + ("a symbolic link to nothing (or a loop of links)" if path.is_symlink() else
                                     "no such file"))
    if not path.is_file():
        raise OSError(f"{path}: not a regular file")
    with path.open("rb") as f:
        magic = f.read(4)
    if not magic:
        raise ValueError(f"{path}: the file is empty (0 bytes): neither a GGUF model nor a KVC cache file")
    if magic == b"GGUF" or path.suffix.lower() == ".gguf":
        return _inspect_gguf(path)
    if magic[:3] == b"KVC":
        return _inspect_kv(path)
    raise ValueError(f"{path}: neither a GGUF model nor a KVC cache file: it starts with {magic!r}, expected "
                     "b'GGUF' (a model) or b'KVC' (a .kv file)")


def _inspect_kv(path: Path) -> int:
    """Print a ``.kv`` file's summary and its checksum verdict (ok / mismatch / none). A mismatch, or a file whose
    structure does not parse, exits non-zero after printing what can be read (the header, the checksum)."""
    try:
        from ..kv.kvfile import KVFile, KVFileError
    except ImportError:
        raise RuntimeError(f"{path}: not a GGUF file, and this version of ds4lab cannot read .kv files "
                           "(ds4lab.kv.kvfile is missing)") from None
    try:
        kf = KVFile.open(path)
    except KVFileError:
        _inspect_kv_damaged(path)
        raise  # one error line, exit 1
    print(kf.summary())
    state, verdict = kf.checksum_status()
    print(f"checksum: {verdict}")
    if state == "mismatch":
        err(f"error: {path}: checksum mismatch: the file is damaged (ds4lab's store would remove it)")
        return EXIT_RUNTIME
    return 0


def _inspect_kv_damaged(path: Path) -> None:
    """What a ``.kv`` file that does not parse still shows: its size, fixed header and checksum verdict."""
    import mmap

    from ..kv.kvfile import PREFIX_BYTES, KVFileError, KVHeader, checksum_status, open_regular, read_trailers

    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
    except (OSError, KVFileError, ValueError):
        return
    print(f"{path}: {size:,} bytes (damaged: see the error below)")
    # a file cut short (or grown) holds no trailer where its end is: its last bytes read as one would only mislead
    unread = f"checksum: not read ({size} bytes, fewer than the fixed header's {PREFIX_BYTES})" if size < PREFIX_BYTES \
        else None
    try:
        header = KVHeader.unpack(data, path)
    except KVFileError:
        pass
    else:
        print("KVC header: " + ", ".join(f"{k} {v}" for k, v in header.as_dict().items()))
        try:
            read_trailers(header, size, lambda at, n: bytes(data[at:at + n]), path)
        except KVFileError as e:
            if e.field == "file size":
                unread = "checksum: not read (the file's size is not the one its header gives)"
    print(unread or f"checksum: {checksum_status(data, path)[1]}")


def _inspect_gguf(path: Path) -> int:
    from ..gguf_file import GGUFModelFile

    f = GGUFModelFile.open(path)  # refuses a damaged file with a one-line ModelFileError
    problem = f.print_summary()
    if problem is not None:
        err(f"error: {problem}")
        return EXIT_RUNTIME
    return 0
