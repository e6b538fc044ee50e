"""What the project writes and how it reads it back: a file written whole or not at all (atomic_write),
JSON and JSONL (one JSONL reader, its errors naming the file and line), an OSError re-raised naming its
file, the log line on stderr with URL credentials redacted (endpoints.redact; keys are never logged), and
the one refusal of settings that differ from those a file records. No torch and no run folder: the Run
(runs.py), the jobs and the benchmark builder all write through these."""
import contextlib
import hashlib
import json
import os
import sys

import endpoints
from settings import SettingsError, of_kind


def log(msg):
    print(endpoints.redact(msg), file=sys.stderr, flush=True)


@contextlib.contextmanager
def naming(path):
    """An OSError raised without a file name (write() on a full disk or past a size limit: "No space
    left on device", "File too large") re-raised naming `path`, so the one-line error says where."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, path) from None
        raise


def atomic_write(path, text):
    """Write aside, then rename: the file is whole or as before; a failure (full disk) leaves no temp file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with naming(path), open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json(path, obj):
    atomic_write(path, json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


class JSONFileError(ValueError):
    """A JSON file that does not read as JSON (a run's file edited by hand or cut by a full disk, a user's
    table mistyped): its path named, as every error a user can fix names its file."""


def read_json(path, default=None):
    """A JSON file's value, `default` when there is none; JSONFileError naming it when it is not JSON."""
    if not os.path.isfile(path):
        return default
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, RecursionError) as e:       # (UnicodeDecodeError is a ValueError)
        raise JSONFileError(f"{path}: not JSON ({str(e)[:100]})") from None


def file_sha1(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha1").hexdigest()


def append_jsonl(path, rec):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with naming(path), open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(rec) + "\n")


def write_jsonl(path, recs):
    """A JSONL file of the run folder written whole (atomic_write); strings keep their characters."""
    atomic_write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))


def read_jsonl(path, skip_bad=False):
    """The one reader of the run folder's JSONL files -> [(line number, value)], blank lines skipped.
    Lines end at "\n" only: str.splitlines() would also break at U+2028 or U+0085, which write_jsonl
    leaves raw inside strings. A line that does not parse (nested too deeply included) is an error naming
    the file and line, or, with skip_bad (a record file appended to as it goes, whose last line a kill
    may cut), skipped."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as e:
        raise SettingsError(f"{path}: not UTF-8 ({e})") from None
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append((n, json.loads(line)))
        except (ValueError, RecursionError) as e:
            if not skip_bad:
                why = "nested too deeply" if isinstance(e, RecursionError) else e
                raise SettingsError(f"{path}, line {n}: not JSON ({why})") from None
    return out


# A record file's JSON types by name, as its errors name them
JSON_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", list: "a list",
              dict: "an object", type(None): "null"}


def check_record(path, n, r, fields, what="a record"):
    """Line n of a record file the run reads back (results, candidates, survivors), each of `fields` (name ->
    a type, or a tuple of them, None for null; settings.of_kind: an integer counts as a number, a boolean as
    nothing else) checked before anything is computed from it -> r; an error names the file, line and field."""
    if not isinstance(r, dict):
        raise SettingsError(f"{path}, line {n}: {what} must be a JSON object, got {JSON_TYPES[type(r)]}")
    for name, kinds in fields.items():
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        if name not in r or not any(r[name] is None if k is None else of_kind(r[name], k) for k in kinds):
            want = " or ".join(JSON_TYPES[type(None) if k is None else k] for k in kinds)
            raise SettingsError(f"{path}, line {n}: {name} must be {want}, got "
                                f"{JSON_TYPES[type(r[name])] if name in r else 'no such field'}")
    return r


def changed_settings(path, made, old, new, todo):
    """The one refusal of settings that differ from those a file records (config.json, results/
    settings.json, attack-settings.json, harden/settings.json): the file, what was made with which
    values, what this command asks for, what to do. `old`, `new`: the differing settings only."""
    shown = lambda d: ", ".join(f"{k}={d.get(k)!r}" for k in new)
    return SettingsError(f"{path}: {made} with different {', '.join(new)} ({shown(old)}); this command asks for "
                         f"{shown(new)}. {todo}")
