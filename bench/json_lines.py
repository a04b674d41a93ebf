"""The JSON lines of a benchmark's output, for the scripts that plot them."""

import json


def json_rows(lines, keep=lambda row: True):
    """Each line of `lines` that is a JSON object and that `keep` accepts, parsed, in order
    (other lines, log lines included, are passed over)."""
    rows = []
    for line in lines:
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if keep(row):
            rows.append(row)
    return rows
