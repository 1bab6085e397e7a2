"""Shared results file for the benchmarks: each one owns a section of results.md.

``write_section(name, markdown, raw)`` replaces only the text between
``<!-- section:NAME -->`` and ``<!-- /section:NAME -->`` in ``results.md`` (appending the
section if it is new) and writes ``raw`` to ``results/NAME.json``, so benchmarks run one
at a time never clobber each other's figures.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
_TITLE = ("# Benchmark results\n\n"
          "Written by `bench/run`; each section is replaced only by its own benchmark. "
          "See [README.md](README.md).\n")


def write_section(name: str, markdown: str, raw: Any, out_dir: str = BENCH_DIR) -> str:
    """Put ``markdown`` in section ``name`` of ``out_dir/results.md``; return its path."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise ValueError(f"section name {name!r}: letters, digits, '_', '.', '-' only")
    os.makedirs(os.path.join(out_dir, "results"), exist_ok=True)
    _write(os.path.join(out_dir, "results", f"{name}.json"),
           json.dumps(raw, indent=2, sort_keys=True) + "\n")

    path = os.path.join(out_dir, "results.md")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        text = _TITLE
    begin, end = f"<!-- section:{name} -->", f"<!-- /section:{name} -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    _write(path, text)
    return path


def _write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)  # a reader never sees half a file


def publish(name: str, markdown: str, raw: Any, out_dir: str = BENCH_DIR) -> int:
    """A benchmark's last step: write its section and raw figures, show the section."""
    path = write_section(name, markdown, raw, out_dir=out_dir)
    print(markdown)
    print(f"\nwrote {path}", file=sys.stderr)
    return 0


def machine_line(info: dict, name: str, seconds: float, how: str, packages: str = "") -> str:
    """The closing line of a section: machine, versions, date, how it ran, commit, raw file."""
    dirty = " (colab_xla/ modified)" if info["colab_xla_dirty"] else ""
    return (f"Machine: {info['cores']} cores ({info['cores_usable']} usable), CPU only; "
            f"Python {info['python']}, torch {info['torch']}, torch_xla {info['torch_xla']}"
            f"{', ' + packages if packages else ''}; {info['date']}; {how}; commit "
            f"{info['git_commit'] or '?'}{dirty}; benchmark took {seconds:.0f} s. "
            f"Raw figures: [results/{name}.json](results/{name}.json).")
