"""metrics.jsonl read back, as a resumed run, compare.py and plot.py read it: a torn last line (a crash or a full disk
mid-write) is set apart, not an error."""

import json


def read_jsonl(path):
    """(records, dropped): (line number, record) for each line of a JSON-lines file. A last line that does not parse
    is what a crash or a full disk leaves mid-write: it is returned as `dropped` (else None), not as a record. A bad
    line anywhere else raises ValueError naming the file and line."""
    with open(path, errors="replace") as f:
        lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    records = []
    for i, (lineno, line) in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                return records, line
            raise ValueError(f"{path}, line {lineno}: not valid JSON ({e.msg}, column {e.colno})") from None
        records.append((lineno, record))
    return records, None
