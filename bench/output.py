"""How every benchmark reports: JSON on stdout, and in a file when asked."""

import json


def emit(result, path=None):
    text = json.dumps(result, indent=2)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
