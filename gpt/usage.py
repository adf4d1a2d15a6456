"""
`--help` for the commands that take settings (configurator.py): the script's docstring, then every setting with its
default and the comment beside it in the script's DEFAULTS, grouped under the comment lines that head groups there.
Read from the source itself, so the help cannot drift from the settings. In DEFAULTS, a comment-only line at the
settings' indent heads a group; one indented deeper continues the comment of the setting above it.
"""

import io
import os
import re
import sys
import textwrap
import tokenize

NOTE_COLUMN = 36  # where each setting's comment starts


def usage(defaults):
    """The --help text for the script whose module-level DEFAULTS is `defaults`."""
    # each module's own names only: a lazy module (transformers') imports a submodule on any attribute it is asked for
    module = next((m for m in list(sys.modules.values()) if getattr(m, "__dict__", {}).get("DEFAULTS") is defaults),
                  None)
    path = getattr(module, "__file__", None) or ""
    events = settings_source(path) if path.endswith(".py") else []
    explained = {event[1] for event in events if event[0] == "key"}
    script = os.path.basename(path)
    lines = [f"usage: python {script or 'script.py'} [config/file.py ...] [--setting=value ...]"]
    if module is not None and module.__doc__:
        lines += ["", module.__doc__.strip()]
    lines += ["", "settings (a config file, then each --setting=value, overrides the default shown):"]
    keys, shown, next_key = list(defaults), set(), 0

    def show(key, note=""):
        setting = f"  --{key}={defaults[key]!r}"
        if note:  # the comment in a column of its own, wrapped at 120 characters
            setting = textwrap.fill(note, 120, initial_indent=f"{setting:<{NOTE_COLUMN - 1}} ",
                                    subsequent_indent=" " * NOTE_COLUMN)
        lines.append(setting)
        shown.add(key)

    for kind, *rest in events:
        if kind == "heading":
            lines += ["", f"{rest[0]}:"]
        elif kind == "key" and rest[0] in defaults:
            show(*rest)
            next_key = keys.index(rest[0]) + 1
        elif kind == "splat":  # the settings a **NAME line brings in: those up to the next one written out
            lines.append(f"  ({rest[0]})" if rest[0] else "")
            while next_key < len(keys) and keys[next_key] not in explained:
                show(keys[next_key])
                next_key += 1
    for key in keys:  # settings the source did not show (no DEFAULTS = dict(...) found)
        if key not in shown:
            show(key)
    return "\n".join(lines)


def settings_source(path):
    """[("heading", text) | ("key", name, comment) | ("splat", comment)] in the order DEFAULTS = dict(...) in the
    source file at path lists them; [] if there is none."""
    with open(path, encoding="utf-8") as f:
        source = f.read()
    comments = {}  # line number -> (column, text) of each comment
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = (token.start[1], token.string[1:].strip())
    lines = source.split("\n")
    start = next((i for i, line in enumerate(lines) if line.startswith("DEFAULTS = dict(")), None)
    if start is None:
        return []
    block = []
    for number, line in enumerate(lines[start + 1:], start + 2):  # line numbers count from 1
        if line.startswith(")"):
            break
        block.append((number, line))
    indent = next((len(line) - len(line.lstrip()) for _, line in block if re.match(r"\s*(\w+=|\*\*)", line)), 4)
    events = []
    for number, line in block:
        setting, splat = re.match(r"\s*(\w+)=", line), re.match(r"\s*\*\*\w+", line)
        column, comment = comments.get(number, (None, ""))
        if setting:
            events.append(("key", setting.group(1), comment))
        elif splat:
            events.append(("splat", comment))
        elif comment and column == indent:
            events.append(("heading", comment))
        elif comment and events and events[-1][0] != "heading":  # indented deeper: the comment goes on
            events[-1] = events[-1][:-1] + (f"{events[-1][-1]} {comment}",)
    return events
