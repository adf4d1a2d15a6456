"""Settings the nanoGPT way: `python train.py config/small.py --learning_rate=3e-4`. The script owns the defaults;
argv applies in order (later wins): a config file (Python; its public names are settings), `--key=value`, `--key value`
or a bare boolean `--flag`. A value is a Python literal, else the raw text (`--dataset=shakespeare`), checked against
the default's type (`--max_iters=1e5` is the int 100000); anything wrong is a one-line UserError; `--help` lists all."""

import ast
import sys
import types

from gpt import UserError

_BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False}


def configure(defaults: dict, argv: list[str]) -> dict:
    """Return a new dict: defaults, updated by the config files and --key=value overrides in argv, in order."""
    if "--help" in argv or "-h" in argv:
        from gpt.usage import usage
        print(usage(defaults))
        sys.exit(0)
    settings, args = dict(defaults), list(argv)  # args consumed front to back; `--key value` takes the next one too
    while args:
        arg = args.pop(0)
        if not arg.startswith("--"):
            for key, value in _run_config_file(arg).items():
                settings[key] = _coerce(_default(defaults, key, f"{arg}: "), value, None, f"{arg}: {key}")
            continue
        key, has_value, raw = arg[2:].partition("=")
        key = key.replace("-", "_")
        default = _default(defaults, key, "")
        if not has_value:  # `--key value`, or a bare boolean `--flag` (true unless a bool word follows)
            follows = bool(args) and not args[0].startswith("--")
            if not follows and not isinstance(default, bool):
                raise UserError(f"--{key} needs a value, as in --{key}=VALUE")
            boolean = isinstance(default, bool) and not (follows and args[0].lower() in _BOOL_WORDS)
            raw = "True" if boolean else args.pop(0)
        try:
            value = ast.literal_eval(raw)
        except Exception:  # not a literal (ValueError, SyntaxError, ...): the text itself, `--dataset=shakespeare`
            value = raw
        settings[key] = _coerce(default, value, raw, f"--{key}")
    return settings


def _coerce(default, value, raw, label):
    """value converted to the default's type, or UserError; raw is the command-line text, None in a file."""
    kind, number = type(default), isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is bool and str(value).lower() in _BOOL_WORDS:  # True, 1, "true" and "TRUE" all read as true
        return _BOOL_WORDS[str(value).lower()]
    if kind in (int, float) and number and (kind is float or float(value).is_integer()):
        return kind(value)  # so that --max_iters=1e5 is the int 100000
    if kind is str and (isinstance(value, str) or raw is not None):
        return value if isinstance(value, str) else raw  # the default says text: --dataset=123 means '123'
    if kind in (tuple, list) and isinstance(value, (tuple, list)):
        return kind(value)
    if default is None or kind not in (bool, int, float, str, tuple, list) and isinstance(value, kind):
        return value
    expected = {bool: "True or False", int: "an int", float: "a float", str: "a string"}.get(kind, "a " + kind.__name__)
    raise UserError(f"{label}: expected {expected}, got {raw if raw is not None else value!r}")


def _default(defaults, key, where):  # where: the config file that named key, if one did
    if key not in defaults:
        from gpt.hints import did_you_mean
        raise UserError(f"{where}unknown setting {key!r}{did_you_mean(key, defaults)}")
    return defaults[key]


def _run_config_file(path):
    """The settings a config file assigns, or UserError naming the file (and the line, if it ran)."""
    try:
        with open(path, "rb") as f:  # bytes, so compile() honours the file's encoding declaration
            source = f.read()
    except OSError as e:
        from gpt.hints import config_file_hint
        raise UserError(f"cannot read config file {path!r}: {e.strerror}{config_file_hint(path)}") from None
    namespace = {}
    try:
        exec(compile(source, path, "exec"), namespace)
    except Exception as e:  # a SyntaxError, or an error running it
        from gpt.hints import config_file_error
        raise UserError(config_file_error(path, e)) from None
    return {name: value for name, value in namespace.items()
            if not name.startswith("_") and not isinstance(value, types.ModuleType) and not callable(value)}
