"""The files a user hands over (plans, clusters) and the ones the tool writes for them: every way reading can go
wrong is one PlannerError line, and no write can leave a file half written."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import reprlib
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_planner.errors import PlannerError
from fsdp_planner.fmt import cut_short, cut_short_stream

# The largest file read: a plan of 100,000 groups over a million params is tens of MiB; cluster files, configs and
# checkpoint metadata are far smaller.
MAX_FILE_BYTES = 256 << 20
WRITTEN_BY = "fsdp-planner"  # in every picture and page it writes (PNG Software, PDF/SVG Creator, HTML generator)
MAX_CONFIG_BYTES = 256 << 10  # a torchtitan TOML or an Accelerate YAML: a few KiB (a 40 MB YAML took minutes)
MAX_SOURCE_BYTES = 16 << 20  # a model's Python file or a Hugging Face config.json (ImageNet-21k labels: ~1 MiB)


def read_text(path: str | Path, label: str, expected: str, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of ``path``, at most ``limit`` bytes; ``label`` names it in messages ("plan file 'p.json'"),
    ``expected`` says what it should hold."""
    p = Path(path)
    check_regular_file(p, label)
    try:
        return read_bytes(p, label, expected, limit).decode("utf-8-sig")  # (a BOM an editor wrote is no text)
    except UnicodeDecodeError:
        raise PlannerError(f"{label} is not text: expected {expected}") from None


def check_regular_file(path: Path, label: str) -> None:
    """Refuse what is not a regular file to read, saying which: missing, a link leading nowhere (or round in a
    loop), or another kind of file (a FIFO, a device such as /dev/zero, which would block or never end)."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        what = "is a link to a file that does not exist" if path.is_symlink() else "does not exist"
        raise PlannerError(f"{label} {what}") from None
    except OSError as e:  # a loop of links (ELOOP), a name too long, a directory we may not enter
        raise PlannerError(f"cannot read {label}: {e.strerror}") from None
    if stat.S_ISDIR(mode):
        raise PlannerError(f"{label} is a directory: give a file in it")
    if not stat.S_ISREG(mode):
        raise PlannerError(f"{label} is not a regular file (a FIFO, socket or device): give the file itself")


def read_bytes(path: Path, label: str, expected: str, limit: int = MAX_FILE_BYTES) -> bytes:
    """``path``'s bytes, refused in one line past ``limit``: read whole and parsed whole, a larger file would take
    minutes and gigabytes. At most ``limit + 1`` bytes are read, whatever the size the file system reports."""
    try:
        size = path.stat().st_size
        if size <= limit:
            with open(path, "rb") as f:
                data = f.read(limit + 1)
    except OSError as e:
        raise PlannerError(f"cannot read {label}: {e.strerror}") from None
    if size > limit or len(data) > limit:  # the second: a file that grew, or one whose size reads 0 (/proc)
        shown = _size(size) if size > limit else f"over {_size(limit)}"
        raise PlannerError(f"{label} is {shown}: at most {_size(limit)} is read (expected {expected})")
    return data


def _size(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB" if n >= 2**10 else f"{n:,} bytes"


class DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys differ (``json.loads``' ``object_pairs_hook``; ``DuplicateKey`` otherwise): Python's
    reader keeps the last of a repeated key, so a plan file with two "groups" would be planned from one, silently."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


# The most values a JSON file may hold (counted from its commas and brackets, strings' included): a plan of a
# million params holds about that many, and Python builds each value as an object, ~64 bytes for an empty one (a
# trial's 198 MB file of empty objects took 5.2 GB before a later check refused it).
MAX_JSON_VALUES = 4_000_000


def parse_json(text: str | bytes, message: Callable[[str], str]) -> Any:
    """``json.loads``; on bad input, a PlannerError whose line is ``message(what is wrong)``. A key repeated in an
    object is refused: Python's reader (and transformers') would keep its last value, silently. A text of more
    than ``MAX_JSON_VALUES`` values is refused before it is read."""
    if isinstance(text, bytes):  # (json's own reader takes UTF-8, -16 and -32)
        try:
            text = text.decode(json.detect_encoding(text))
        except UnicodeDecodeError:
            raise PlannerError(message("it is not UTF-8 (or UTF-16, UTF-32) text")) from None
    if sum(text.count(m) for m in (",", "{", "[")) > MAX_JSON_VALUES:
        raise PlannerError(message(f"it holds more than {MAX_JSON_VALUES:,} values (counted from its commas and "
                                   "brackets), far more than any plan or config holds"))
    try:
        data = json.loads(text, object_pairs_hook=unique_keys)
        if LONE_SURROGATE.search(text) and (bad := _unwritable(data)) is not None:
            detail = f"the string {bad} holds a lone surrogate escape (\\ud800 to \\udfff alone), which no " \
                "text can hold"
        else:
            return data
    except DuplicateKey as e:
        detail = f"the key {shown_json(e.key)} appears twice in one object (which one is meant?)"
    except json.JSONDecodeError as e:
        detail = f"{e.msg.removesuffix(' at')} at line {e.lineno} column {e.colno}"
    except RecursionError:
        detail = "it nests too deeply to read"
    except ValueError:  # Python refuses integers of more than 4300 digits
        detail = "it holds a number too long to read, over 4300 digits"
    raise PlannerError(message(detail)) from None


LONE_SURROGATE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # how JSON spells a surrogate (paired or not)


def _unwritable(data: Any) -> str | None:
    """The first string (key or value) of parsed JSON that UTF-8 cannot encode (a lone surrogate a name would
    carry to the terminal, a picture or a page, where writing it fails), shown escaped; None when all can be."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return ascii(value[:40])
    return None


# Values a YAML document's aliases may add once expanded: an Accelerate config repeats none. Nine anchors of nine
# aliases each (1 KB) expand to 387 million strings.
MAX_YAML_VALUES = 10_000


def parse_yaml(text: str, label: str) -> Any:
    """PyYAML's ``safe_load`` (plain values only, nothing from the file runs), refusing a document whose aliases
    (``*name``) expand it past ``MAX_YAML_VALUES`` values or into itself, before any value is built."""
    try:
        import yaml
    except ImportError:
        raise PlannerError("reading an Accelerate YAML needs PyYAML (pip install pyyaml)") from None
    loader = None
    try:
        loader = yaml.SafeLoader(text)  # (its reader refuses control characters here: a YAMLError too)
        node = loader.get_single_node()
        if node is not None and _repeated(node) > MAX_YAML_VALUES:
            raise PlannerError(f"{label}: its aliases (*name) repeat more than {MAX_YAML_VALUES:,} values (an "
                               "Accelerate config repeats nothing)")
        if node is not None and (key := _repeated_key(node)) is not None:
            raise PlannerError(f"{label}: the key {shown_json(key)} appears twice in one mapping (which one is "
                               "meant?)")
        return loader.construct_document(node) if node is not None else None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        what = getattr(e, "problem", None) or getattr(e, "reason", None) or "cannot parse"  # (a ReaderError: reason)
        raise PlannerError(f"{label} is not valid YAML{at}: {what}") from None
    except RecursionError:
        raise PlannerError(f"{label} nests too deeply to read") from None
    except ValueError:  # Python refuses integers of more than 4300 digits
        raise PlannerError(f"{label} holds a number too long to read, over 4300 digits") from None
    finally:
        if loader is not None:
            loader.dispose()


def _repeated_key(root: Any) -> str | None:
    """The first plain key a mapping of the document repeats (PyYAML keeps the last, silently), or None."""
    import yaml

    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys = [k.value for k, _ in node.value if isinstance(k, yaml.ScalarNode)]
            if len(keys) != len(set(keys)):
                return next(k for i, k in enumerate(keys) if k in keys[:i])
            stack.extend(v for pair in node.value for v in pair)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
    return None


def _repeated(root: Any) -> float:
    """How many values the document's aliases add once expanded: its size with every alias expanded, less its
    distinct nodes (the values it spells out)."""
    distinct, stack = {id(root)}, [root]
    while stack:
        for child in _yaml_children(stack.pop()):
            if id(child) not in distinct:
                distinct.add(id(child))
                stack.append(child)
    return _expanded(root, {}, set(), len(distinct) + MAX_YAML_VALUES) - len(distinct)


def _expanded(node: Any, counted: dict[int, float], open_: set[int], cap: float) -> float:
    """The values ``node`` holds with every alias expanded, counted no further than ``cap``; each shared node is
    counted once (memo ``counted``), and a node holding an alias to itself (``&a [*a]``) holds infinitely many."""
    if id(node) in counted:
        return counted[id(node)]
    if id(node) in open_:
        return math.inf
    open_.add(id(node))
    total: float = 1
    for child in _yaml_children(node):
        total += _expanded(child, counted, open_, cap)
        if total > cap:
            break  # enough to refuse: the rest need not be counted
    open_.discard(id(node))
    counted[id(node)] = total
    return total


def _yaml_children(node: Any) -> list[Any]:
    import yaml

    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return node.value if isinstance(node, yaml.SequenceNode) else []


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write ``data`` (text as UTF-8) to ``path`` without ever leaving it half written: a regular file is written
    beside it and renamed over it, so a full disk or a kill leaves the previous file whole; a character device or a
    pipe (``/dev/stdout``) cannot be renamed over and is written directly (``_write_special``). Every file the tool
    writes goes through here; a failure is one line naming the file."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    if path.exists() and not path.is_file():
        _write_special(path, raw)
        return
    target = Path(os.path.realpath(path))  # through a symlink, as a plain write would
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
        _keep_mode(target, tmp)
        os.replace(tmp, target)
    except OSError as e:
        raise PlannerError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _write_special(path: Path, raw: bytes) -> None:
    """Write to a FIFO or a character device (``/dev/stdout``, ``/dev/null``), never waiting for a reader: the
    open does not block (a FIFO no one reads is refused in one line, where a plain ``open`` waited forever), and
    the writes do once it is open. A socket or a block device is no file to write a plan or a picture to."""
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISSOCK(mode) or stat.S_ISBLK(mode):
            raise PlannerError(f"cannot write {path}: it is a {'socket' if stat.S_ISSOCK(mode) else 'block device'}, "
                               "not a file (give a file name)")
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO opened for writing with no process reading it
            raise PlannerError(f"cannot write {path}: it is a named pipe (FIFO) that no process is reading (give a "
                               "file name, or start the reader first)") from None
        raise PlannerError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        os.set_blocking(fd, True)  # open: a reader is there, and a full pipe waits for it as a plain write would
        with open(fd, "wb") as f:
            f.write(raw)
    except OSError as e:
        raise PlannerError(f"cannot write {path}: {e.strerror or e}") from None


def _keep_mode(target: Path, tmp: Path) -> None:
    """A file written again keeps its permissions (the temporary file has the umask's)."""
    with contextlib.suppress(FileNotFoundError):  # a new file: the umask's mode, as a plain write gives
        os.chmod(tmp, os.stat(target).st_mode & 0o7777)


# The first line of every file ``export`` writes: the sha256 of the text below it. ``export --out`` replaces such a
# file only while that text still hashes to it: the header alone said "export wrote this", and a user's edits (a
# function appended) were lost to the next export.
EXPORT_STAMP = "# fsdp-planner export, sha256 of the text below: {digest} (export --out replaces it only unedited)\n"
_STAMP_LINE = re.compile(rb"# fsdp-planner export, sha256 of the text below: ([0-9a-f]{64})\b[^\n]*\n")


def stamped(text: str) -> str:
    """``text`` under ``EXPORT_STAMP``'s first line, its checksum."""
    return EXPORT_STAMP.format(digest=hashlib.sha256(text.encode("utf-8")).hexdigest()) + text


def as_stamped(data: bytes) -> bool | None:
    """Whether ``data`` (a file's bytes) below its first line is still the text that line's checksum is of
    (``stamped``); None where it has no such line (no file export writes, or one an older fsdp-planner wrote,
    whose edits cannot be told)."""
    found = _STAMP_LINE.match(data)
    if found is None:
        return None
    return hashlib.sha256(data[found.end():]).hexdigest() == found.group(1).decode("ascii")


def shown_json(value: Any) -> str:
    """A value from a file as the file spells it (true, 1.0, "1", null), cut short when long: a message never
    echoes an unbounded input, and no more of it is serialised than the message can show."""
    if isinstance(value, str):  # one chunk however long: its length is known, and said
        return cut_short(json.dumps(value))
    try:
        return cut_short_stream(json.JSONEncoder(default=_not_json).iterencode(value))  # lazy: chunk by chunk
    except (TypeError, ValueError):  # not JSON (a YAML date, a set), a cycle, or an integer too long to print
        return cut_short(_BOUNDED.repr(value))


def shown_key(value: Any) -> str:
    """A name from a file (a key, a function's name) as ``shown_json`` says it, without a string's quotes: a YAML
    key that is no string (``5``, ``true``, ``null``) as the file spells it (stripping the quotes off those, and off
    a name cut short, lost its first and last characters: "ru is not read")."""
    return cut_short(json.dumps(value)[1:-1]) if isinstance(value, str) else shown_json(value)


def _not_json(value: Any) -> Any:
    raise TypeError(type(value).__name__)


class _BoundedRepr(reprlib.Repr):
    """``repr`` that looks at no more than a few levels and items (``reprlib``'s bounds), and names an integer too
    long to print by its size."""

    def repr_int(self, x: int, level: int) -> str:
        return int.__repr__(x) if x.bit_length() < 10_000 else f"<an integer of {x.bit_length():,} bits>"


_BOUNDED = _BoundedRepr()
