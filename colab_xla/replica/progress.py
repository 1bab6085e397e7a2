"""tqdm in a replica: each bar's state goes to the notebook, which draws it (a bar per
replica in the widget, a line now and then in the text view), instead of ``\\r`` text on
stderr.

``tqdm.auto``, ``tqdm.notebook`` and plain ``tqdm`` are all tqdm's text bar here (the
notebook bar is a widget, which a forked replica cannot draw), whose drawing is replaced:
where it would write its line (at tqdm's own pace, ``mininterval``: a few times a second),
it sends a ``{"progress": ...}`` note with the bar's count, total, description and the text
line tqdm would have printed; when it closes, a last one (``"closed"``, and ``"leave"``: the
notebook then keeps its last line among the replica's output).
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import sys
import types

from ..wire.frames import NOTE


def install(process) -> None:
    """In a replica process (``process``: its :class:`~colab_xla.replica.process.ReplicaProcess`):
    every tqdm bar reports to the notebook."""
    if importlib.util.find_spec("tqdm") is None:
        return
    import tqdm.std

    for name in ("tqdm.auto", "tqdm.autonotebook", "tqdm.notebook"):
        module = types.ModuleType(name)
        module.tqdm, module.trange = tqdm.std.tqdm, tqdm.std.trange
        module.tqdm_notebook, module.tnrange = tqdm.std.tqdm, tqdm.std.trange
        sys.modules[name] = module
    tqdm_pkg = sys.modules.get("tqdm")
    for attr in ("auto", "autonotebook", "notebook"):
        if tqdm_pkg is not None:
            setattr(tqdm_pkg, attr, sys.modules[f"tqdm.{attr}"])

    bar_class = tqdm.std.tqdm
    real_close = bar_class.close

    def send(bar, **final) -> None:
        ordinal = process.ordinal()
        fmt = bar.format_dict
        state = {"bar": f"{os.getpid()}-{id(bar)}", "n": fmt.get("n"), "total": fmt.get("total"),
                 "desc": fmt.get("prefix") or "", "text": bar.format_meter(**fmt), **final}
        process.writer.send(NOTE, ordinal, json.dumps({"progress": state}).encode())

    def display(self, msg=None, pos=None):
        if self.disable or getattr(self, "_colab_xla_closed", False):
            return True
        send(self)
        return True

    def close(self):
        if not self.disable and not getattr(self, "_colab_xla_closed", False):
            self._colab_xla_closed = True
            send(self, closed=True, leave=bool(self.leave))
            self.fp = io.StringIO()  # (where tqdm ends its line: nothing was drawn there)
        return real_close(self)

    bar_class.display, bar_class.close = display, close
