"""Rich output of replicas (``display(...)``, matplotlib's ``plt.show()``): how a replica
sends a mime bundle and how the notebook keeps it among the replica's output lines.
IPython-free.

A replica writes the bundle (the mimes a notebook draws: images, HTML, Markdown, LaTeX, SVG,
JSON, and the text form) as a JSON file in its run's directory (:func:`save`) and sends a
:data:`colab_xla.wire.frames.DISPLAY` frame naming it, in order with its printed lines; the
notebook reads it back (:func:`load`) as a :class:`Display`: a line of the replica's output
whose text is the bundle's text form, so every view that shows lines shows it, and a view
that can draw (the widget, the saved HTML) draws its bundle in its place.

>>> d = Display.of({"text/plain": "<Figure size 640x480 with 1 Axes>",
...                 "image/png": "iVBORw0KGgo="})
>>> str(d), d.drawn
('[an image: image/png]', True)
>>> Display.of({"text/plain": "   a  b\\n0  1  2", "text/html": "<table/>"})
'   a  b\\n0  1  2'
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import re
from typing import Dict, Mapping

# The mimes a notebook draws that a replica's display sends (widgets cannot be: a forked
# replica has no connection to the browser).
KEPT = ("text/plain", "text/html", "text/markdown", "text/latex", "image/png", "image/jpeg",
        "image/svg+xml", "image/gif", "application/json")
# A text form that says nothing (an object's default repr, a figure's size).
_DEFAULT_REPR = re.compile(r"<.* object(?: at 0x[0-9a-f]+)?>|<Figure size .*>", re.DOTALL)
_counter = itertools.count()


def says_nothing(text: object) -> bool:
    """Whether a display's text form is no text at all: missing, an object's default repr,
    a figure's size."""
    return not isinstance(text, str) or bool(_DEFAULT_REPR.fullmatch(text.strip()))


class Display(str):
    """A line of a replica's output that is a displayed object: its text form, and
    ``bundle`` (mime -> data, as IPython's display data)."""

    bundle: Dict[str, object]

    @classmethod
    def of(cls, bundle: Mapping[str, object]) -> "Display":
        text = bundle.get("text/plain")
        if says_nothing(text):
            drawn = next((m for m in bundle if m != "text/plain"), "an object")
            kind = "an image" if drawn.startswith("image/") else "a display"
            text = f"[{kind}: {drawn}]"
        display = cls(text.rstrip("\n"))
        display.bundle = dict(bundle)
        return display

    @property
    def drawn(self) -> bool:
        """Whether it has more than a text form (something only a notebook draws)."""
        return any(m != "text/plain" for m in self.bundle)


def kept(data: Mapping[str, object]) -> Dict[str, object]:
    """The part of display data ``data`` a replica sends, as JSON holds it (an image's raw
    bytes in base64, as a kernel sends them).

    >>> kept({"image/png": b"\\x89PNG", "text/plain": "x", "application/x-other": 1})
    {'image/png': 'iVBORw==', 'text/plain': 'x'}
    """
    return {m: (base64.b64encode(v).decode("ascii") if isinstance(v, bytes) else v)
            for m, v in data.items() if m in KEPT}


def save(directory: str, bundle: Mapping[str, object]) -> str:
    """In a replica: write ``bundle`` to a new file in ``directory``; its name."""
    name = f"display-{os.getpid()}-{next(_counter)}.json"
    tmp = os.path.join(directory, name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(bundle, f)
    os.replace(tmp, os.path.join(directory, name))
    return name


def load(directory: str, name: str) -> Display:
    """In the notebook: the display a replica saved as ``name`` in ``directory`` (the run's);
    one that cannot be read is said as such."""
    if os.sep in name or not name.startswith("display-"):
        return Display.of({"text/plain": f"[a display that could not be read: {name!r}]"})
    try:
        with open(os.path.join(directory, name), encoding="utf-8") as f:
            bundle = json.load(f)
    except (OSError, ValueError) as exc:
        return Display.of({"text/plain": f"[a display that could not be read: {exc}]"})
    return Display.of(bundle)
